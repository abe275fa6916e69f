"""Which Python a task's image means by ``python3``, and where its packages are. Pure.

Under Harbor with Docker, a test script's bare ``python3``/``python``, ``pip install`` and
``python -m pytest`` are the image's: a ``python:3.13`` image's tests import the numpy the
image installed. The runner never runs the agent's interpreter (it is the agent's to
replace), but when the image's ``python3`` is a version the runner carries, the runner's
``python3`` (and its ``pip`` environment) is that version and finds the image's
site-packages **after** everything of its own (:mod:`.pysite`: a name the runner must
provide never comes from there; an import from there is in the trial's notes).

Where ``python3`` is looked for, in PATH order: ``/usr/local/bin`` (the official Python
images) then ``/usr/bin`` (a distribution's Python).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["ImagePython", "image_python", "IMAGE_PYTHON_VAR", "IMAGE_SITE_VAR"]

IMAGE_PYTHON_VAR = "SEQUESTER_IMAGE_PYTHON"  # "3.13": the runner's python3 shims pick that version
IMAGE_SITE_VAR = "SEQUESTER_IMAGE_SITE_DIRS"  # the image's site folders: the shims' Pythons get them (see pysite)


@dataclass(frozen=True)
class ImagePython:
    version: str  # "3.13"
    site: tuple[str, ...]  # the image's package folders for that version, in its sys.path order
    where: str  # the image's interpreter, for notes


def image_python(kind: Callable[[str], str], versions: Iterable[str]) -> ImagePython | None:
    """The image's ``python3`` if it is one of ``versions`` (``X.Y``), else None.
    ``kind(path)``: what the image has at ``path`` (``"other"`` for a file or a link,
    ``"dir"``, ``"none"``: :func:`sequester.images.stack.image_path_kind`'s answers)."""
    ordered = sorted(set(versions), key=lambda v: tuple(int(p) for p in v.split(".")), reverse=True)
    for prefix in ("/usr/local", "/usr"):
        for version in ordered:
            where = f"{prefix}/bin/python{version}"
            if kind(where) != "other":
                continue
            if prefix == "/usr/local":
                site: tuple[str, ...] = (f"/usr/local/lib/python{version}/site-packages",)
            else:  # Debian's and Ubuntu's layout
                site = (
                    f"/usr/local/lib/python{version}/dist-packages",
                    "/usr/lib/python3/dist-packages",
                    f"/usr/lib/python{version}/dist-packages",
                )
            return ImagePython(version, site, where)
    return None

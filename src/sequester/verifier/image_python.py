"""Which Python a task's image means by ``python3``, and where its packages are. Pure.

Under Harbor with Docker, a test script's bare ``python3``/``python``, ``pip install`` and
``python -m pytest`` are the image's: a ``python:3.13`` image's tests import the numpy the
image installed. The runner never runs the agent's interpreter (it is the agent's to
replace), but when the image's ``python3`` is a version the runner carries, the runner's
``python3`` (and its ``pip`` environment) is that version and finds the image's
site-packages **after** everything of its own (:mod:`.pysite`: a name the runner must
provide never comes from there; an import from there is in the trial's notes).

``python3`` is looked for in PATH order, ``/usr/local/bin`` (the official Python images)
then ``/usr/bin`` (a distribution's Python), and followed through its links; a version the
runner does not carry leaves the runner's default Python (and no image site folders).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["ImagePython", "image_python", "IMAGE_PYTHON_VAR", "IMAGE_SITE_VAR"]

_VERSIONED = re.compile(r"^python(3\.\d{1,2})$")
IMAGE_PYTHON_VAR = "SEQUESTER_IMAGE_PYTHON"  # "3.13": the runner's python3 shims pick that version
IMAGE_SITE_VAR = "SEQUESTER_IMAGE_SITE_DIRS"  # the image's site folders: the shims' Pythons get them (see pysite)


@dataclass(frozen=True)
class ImagePython:
    version: str  # "3.13"
    site: tuple[str, ...]  # the image's package folders for that version, in its sys.path order
    where: str  # the image's interpreter, for notes


def image_python(
    kind: Callable[[str], str], link: Callable[[str], str | None], versions: Iterable[str]
) -> ImagePython | None:
    """The image's ``python3`` if its version is one of ``versions`` (``X.Y``), else None.
    ``python3`` is looked for as the image's PATH finds it (``/usr/local/bin``, then
    ``/usr/bin``) and followed through its links (``/usr/local/bin/python3`` ->
    ``/usr/bin/python3`` -> ``python3.13``) to a ``pythonX.Y``. ``kind(path)``: what the
    image has at ``path`` (``"other"`` for a file or a link, ``"dir"``, ``"none"``:
    :func:`sequester.images.stack.image_path_kind`'s answers); ``link(path)``: a link's
    target, else None (:func:`sequester.images.stack.image_link`)."""
    carried = set(versions)
    for start in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if kind(start) != "other":
            continue
        where = start
        for _ in range(8):  # links followed, at most
            target = link(where)
            if target is None:
                break
            where = posixpath.normpath(posixpath.join(posixpath.dirname(where), target))
        match = _VERSIONED.match(posixpath.basename(where))
        if match is None or kind(where) != "other":
            return None  # python3 is a file of its own, or leads nowhere: its version is not known here
        version = match[1]
        if version not in carried:
            return None
        if where.startswith("/usr/local/"):
            site: tuple[str, ...] = (f"/usr/local/lib/python{version}/site-packages",)
        else:  # Debian's and Ubuntu's layout
            site = (
                f"/usr/local/lib/python{version}/dist-packages",
                "/usr/lib/python3/dist-packages",
                f"/usr/lib/python{version}/dist-packages",
            )
        return ImagePython(version, site, where)
    return None

"""The agent's ``/etc/resolv.conf`` (in an episode with a network) and ``/etc/hosts``
(always, as Docker writes them): put in the writable layer of its view before the sandbox
starts, as regular files of the layer's owner.

Nothing is bound over the path and nothing is written through it: an image's
``/etc/resolv.conf`` is often a link (``../run/systemd/resolve/stub-resolv.conf``), and a
bind mount or a write would follow it (out of the view, when bwrap resolves it on the
host). A regular file in the upper layer hides whatever the lower layers have there,
link or file, and changes nothing of them.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["place_resolv_conf", "place_etc_file"]


def place_resolv_conf(upper_etc: Path, text: str, *, like: Path | None = None) -> None:
    """``upper_etc/resolv.conf`` holding ``text`` (:func:`place_etc_file`)."""
    place_etc_file(upper_etc, "resolv.conf", text, like=like)


def place_etc_file(upper_etc: Path, name: str, text: str, *, like: Path | None = None) -> None:
    """``upper_etc/name`` holding ``text`` (``upper_etc``: the writable layer's ``/etc``,
    made when missing, with the mode of ``like``, the lower ``/etc``): ``resolv.conf``,
    ``hosts``."""
    if not upper_etc.is_dir() or upper_etc.is_symlink():
        if os.path.lexists(upper_etc):
            raise OSError(f"{upper_etc} is not a folder")
        upper_etc.mkdir()
        if like is not None:
            try:
                os.chmod(upper_etc, os.lstat(like).st_mode & 0o7777)
            except OSError:
                pass
    target = upper_etc / name
    if os.path.lexists(target) and (target.is_symlink() or not target.is_file()):
        os.unlink(target)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)

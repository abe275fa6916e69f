"""Checkpoints of an episode on an image: its writable layer sealed under a fresh one.

An episode on an image is one overlay at ``/``: the image's layers beneath one writable
layer (:mod:`.image_view`). A checkpoint freezes the agent's processes, ends the
sandbox (a live overlay cannot change its layers under the processes that hold
descriptors, working directories and mappings in it), moves the writable layer out of
the episode's folder into a folder of its own, where nothing ever writes it again, and
starts the episode anew on the image's layers plus every sealed layer, under a fresh
writable one. :meth:`~.episode.Episode.rollback` starts it anew on a checkpoint's layers
(the writable layer since is dropped); :meth:`~.episode.Episode.fork` starts N new
episodes on them, each with its own writable layer, namespaces, network and processes.

**Processes are restarted, not restored**, and the checkpoint says which: the agent's
shell starts again in the working directory and with the exported variables it had
(read from the shell itself just before the freeze); shell functions, aliases,
unexported variables and every other process (background jobs, services) are not
carried over, and are listed in :attr:`Checkpoint.not_restored` and the episode's notes.
CRIU could restore them; it is not used (Debian 12's 3.17 needs ``CAP_CHECKPOINT_RESTORE``
or root, and a restore into new namespaces of a process tree that holds a pty and
pidfds of the host's was not measured to work here), so a checkpoint is never silently
partial: what was not restored is named. Nothing of a process's memory is copied, so a
fork shares no random state with its siblings; each fork also gets a machine id of its
own (``/etc/machine-id``, when the view has a non-empty one).

**Layers** are reference-counted folders ``<state_dir>/<pid>-ckpt-<random>/`` (the
``layer`` and a copy of the agent's log folders, ``logs``): held by each
:class:`Checkpoint` until :meth:`Checkpoint.release` and by each episode running on
them until it stops; removed with the last. A process that dies leaves them to the
next start's clean-up of dead processes' folders (:func:`.state.remove_stale`), like its
episodes' folders. Bounds: an episode stands on at most ``[episodes] checkpoint_depth``
sealed layers (a deeper checkpoint's layers are squashed into one, :func:`squash`: hard
links to the files, folders and whiteouts made again, as overlayfs resolves the stack),
and the sealed layers of this process take at most ``[episodes] checkpoint_disk_mb``
(measured before the layer is sealed: a checkpoint that would pass it is refused and the
episode goes on as it was).
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sequester.environments.local.state import EpisodeDirs
from sequester.errors import EpisodeError
from sequester.images.choose import Choice
from sequester.sandbox.idmap import IdMap
from sequester.sandbox.idspace import remove_mapped_tree
from sequester.tasks import Task

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SHELL_STATE_COMMAND",
    "parse_shell_state",
    "seal",
    "new_folder",
    "squash",
    "squash_into",
    "tree_bytes",
    "held_bytes",
    "copy_logs",
    "hold",
    "hold_for",
    "discard_folder",
    "plain_path",
    "let_go",
]


class CheckpointError(EpisodeError):
    """A checkpoint, rollback or fork that cannot be made (the reason named); the episode
    is left as it was."""


# What the agent's shell says of its state: its working directory, then each exported
# variable, NUL-separated (bash's own builtins only: the image may have no `env`).
SHELL_STATE_COMMAND = (
    "\\builtin printf '%s\\0' \"$PWD\"; "
    'for __seq_v in $(\\builtin compgen -e); do \\builtin printf \'%s=%s\\0\' "$__seq_v" "${!__seq_v}"; done'
)
# Set by bash itself in every shell, or the episode's own protocol: never carried over.
_NOT_CARRIED = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "BASH_FUNC"})


def parse_shell_state(output: str) -> tuple[str | None, dict[str, str]]:
    """``SHELL_STATE_COMMAND``'s output: ``(working directory or None, exported
    variables)``. Pure; malformed parts are skipped."""
    parts = output.split("\0")
    if len(parts) < 2:
        return None, {}
    cwd = parts[0] if parts[0].startswith("/") else None
    env: dict[str, str] = {}
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if sep and name.isidentifier() and name not in _NOT_CARRIED and not name.startswith("__seq"):
            env[name] = value
    return cwd, env


class _Refs:
    """Users of each checkpoint folder (checkpoints and running episodes); the last one's
    release removes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[Path, int] = {}
        self._bytes: dict[Path, int] = {}

    def add(self, folders: Iterable[Path], size: dict[Path, int] | None = None) -> None:
        with self._lock:
            for folder in folders:
                self._count[folder] = self._count.get(folder, 0) + 1
                if size and folder in size:
                    self._bytes[folder] = size[folder]

    def add_for(self, cp: Checkpoint) -> None:
        """A hold on ``cp``'s layers, unless it was released (checked in the same lock
        as its release: a fork that starts while its checkpoint is released either holds
        the layers or is refused, never left on removed ones)."""
        with self._lock:
            if cp.released:
                raise CheckpointError(f"checkpoint {cp.id} was released")
            for folder in _folders(cp.layers):
                self._count[folder] = self._count.get(folder, 0) + 1

    def release(self, cp: Checkpoint) -> None:
        with self._lock:
            if cp.released:
                return
            cp.released = True
            gone = self._dropped(_folders(cp.layers))
        for folder in gone:
            remove_mapped_tree(folder)

    def drop(self, folders: Iterable[Path]) -> None:
        with self._lock:
            gone = self._dropped(folders)
        for folder in gone:
            remove_mapped_tree(folder)

    def _dropped(self, folders: Iterable[Path]) -> list[Path]:
        gone = []
        for folder in folders:
            left = self._count.get(folder, 0) - 1
            if left > 0:
                self._count[folder] = left
            else:
                self._count.pop(folder, None)
                self._bytes.pop(folder, None)
                gone.append(folder)
        return gone

    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())


_REFS = _Refs()


def held_bytes() -> int:
    """Disk taken by the sealed layers this process holds (see ``checkpoint_disk_mb``)."""
    return _REFS.held_bytes()


def hold(layers: Iterable[Path]) -> None:
    """A hold on the layers (their folders): a checkpoint's on those below its own."""
    _REFS.add(_folders(layers))


def hold_for(cp: Checkpoint) -> None:
    """A running episode's hold on the layers of the checkpoint it starts on;
    :class:`CheckpointError` if it was released."""
    _REFS.add_for(cp)


def let_go(layers: Iterable[Path]) -> None:
    _REFS.drop(_folders(layers))


def _folders(layers: Iterable[Path]) -> list[Path]:
    return [layer.parent for layer in layers]


@dataclass(eq=False)
class Checkpoint:
    """A sealed state of an episode: the layers above the image (lowest first), the shell's
    working directory and exported variables, what was not restored. Hold it while it may
    be rolled back to or forked from; :meth:`release` (or ``with``) lets its layers go once
    no episode stands on them either."""

    task: Task
    choice: Choice
    layers: tuple[Path, ...]
    workdir: str  # the episode's own (the task's): the tests', the artifacts', never the shell's
    env: dict[str, str]
    shell_cwd: str | None = None  # where the agent's shell was (checked again where it starts)
    not_restored: tuple[str, ...] = ()
    layer_bytes: int = 0  # the disk its own (top) layer takes
    remaining: float | None = None  # the agent's time left when it was made (None: no limit)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    released: bool = False

    @property
    def depth(self) -> int:
        """How many sealed layers it stands on."""
        return len(self.layers)

    @property
    def logs(self) -> Path:
        """The agent's log folders as they were (``agent``, ``artifacts``)."""
        return self.layers[-1].parent / "logs"

    def release(self) -> None:
        """Idempotent; the layers go once no episode stands on them either."""
        _REFS.release(self)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def tree_bytes(root: Path, *, limit: int = 2_000_000, seconds: float = 20.0) -> int:
    """Disk blocks under ``root`` in bytes: every entry ``lstat``-ed once, no link
    followed, no recursion (a stack of folders). Hard links within the tree count once.
    More than ``limit`` entries, or a scan past ``seconds``: :class:`CheckpointError` (a
    layer it cannot measure is one it will not seal: red team, a layer counted only up to
    the limit passed the disk cap with the rest uncounted)."""
    total, seen, stack, entries = 0, set(), [root], 0
    deadline = time.monotonic() + seconds
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    entries += 1
                    if entries > limit or (entries % 4096 == 0 and time.monotonic() > deadline):
                        raise CheckpointError(
                            f"the writable layer holds more than {limit} entries, or more than {seconds:g} s "
                            "of them to measure: it is not sealed"
                        )
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if st.st_nlink > 1:
                        if (st.st_dev, st.st_ino) in seen:
                            continue
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(Path(entry.path))
        except CheckpointError:
            raise
        except OSError:
            continue
    return total


def new_folder(state_dir: Path) -> Path:
    """A checkpoint's folder (``<pid>-ckpt-*``: a dead process's goes with the next
    start's clean-up), not held yet."""
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-ckpt-", dir=state_dir))


def seal(dirs: EpisodeDirs, folder: Path, size: int) -> Path:
    """Move the episode's writable layer (its sandbox ended) into ``folder``
    (:func:`new_folder`, the agent's logs copied there already); returns the layer. Held
    once (for the checkpoint that is being made)."""
    layer = folder / "layer"
    try:
        os.rename(dirs.upper_root, layer)
    except BaseException:
        remove_mapped_tree(folder)
        raise
    _REFS.add([folder], {folder: size})
    return layer


# What a checkpoint copies of the agent's log folders, at most (red team: a sparse file of
# 10 TB, or a chain of 700 folders, in /logs/agent).
LOG_ENTRIES, LOG_DEPTH = 20_000, 64


def copy_logs(source: Path, dest: Path, budget: int) -> int:
    """The agent's log folders (``/logs/agent``, ``/logs/artifacts``) copied into ``dest``:
    folders, regular files (their bytes as they read: a sparse file counts whole) and
    links (as links); nothing else (a FIFO, a socket, a device is left out). No link is
    followed, no recursion; at most ``LOG_ENTRIES`` entries ``LOG_DEPTH`` deep and
    ``budget`` bytes, else :class:`CheckpointError`. Returns the bytes copied."""
    copied, entries = 0, 0
    dest.mkdir(mode=0o755, exist_ok=True)
    if not source.is_dir() or source.is_symlink():
        return 0
    stack: list[tuple[Path, Path, int]] = [(source, dest, 0)]
    while stack:
        src_dir, dst_dir, depth = stack.pop()
        with os.scandir(src_dir) as it:
            found = list(it)
        for entry in found:
            entries += 1
            if entries > LOG_ENTRIES or depth >= LOG_DEPTH:
                raise CheckpointError(
                    f"the agent's log folders hold more than {LOG_ENTRIES} entries or go deeper than {LOG_DEPTH}"
                )
            st = entry.stat(follow_symlinks=False)
            target = dst_dir / entry.name
            if stat.S_ISDIR(st.st_mode):
                target.mkdir(mode=stat.S_IMODE(st.st_mode) | 0o700, exist_ok=True)
                stack.append((Path(entry.path), target, depth + 1))
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(entry.path), target)
            elif stat.S_ISREG(st.st_mode):
                copied += st.st_size
                if copied > budget:
                    raise CheckpointError(
                        f"the agent's log folders hold more than the {budget >> 20} MB left of checkpoint_disk_mb"
                    )
                _copy_file(entry.path, target, st)
    return copied


def _copy_file(source: str, target: Path, st: os.stat_result) -> None:
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # (one the caller may not read: an ordinary caller's, of another of the episode's users)
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # (swapped since the listing)
            return
        with open(fd, "rb", closefd=False) as src, open(target, "wb") as dst:
            left = st.st_size
            while left > 0 and (chunk := src.read(min(left, 1 << 20))):
                dst.write(chunk)
                left -= len(chunk)
        os.chmod(target, stat.S_IMODE(st.st_mode) & 0o777)
    finally:
        os.close(fd)


# overlayfs (mounted by bwrap in a user namespace: userxattr) marks a folder whose lower
# content is hidden with this xattr; a whiteout is a character device 0:0.
_OPAQUE = "user.overlay.opaque"
_SQUASH_ENTRIES = 5_000_000  # entries one squash may walk (the layers are bounded by checkpoint_disk_mb too)


def squash(layers: Sequence[Path], state_dir: Path, ids: IdMap | None) -> Path:
    """One sealed layer that stands for ``layers`` (lowest first) over the same image, as
    overlayfs would resolve them (:func:`squash_into`), in a folder of its own like
    :func:`seal`'s (held once). Files are hard links to the layers' (nothing is copied but
    folders and whiteouts); an ordinary caller does it as root of a namespace mapping the
    episode's ids (the layers hold files of its subordinate ids)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-ckpt-", dir=state_dir))
    layer = folder / "layer"
    try:
        if os.getuid() != 0 and ids is not None:
            from sequester.sandbox.idspace import run_in_id_space

            run_in_id_space(ids, __name__, "squash_into", [str(p) for p in layers], str(layer))
        else:
            squash_into([str(p) for p in layers], str(layer))
        size = tree_bytes(layer)
    except BaseException:
        remove_mapped_tree(folder)
        raise
    _REFS.add([folder], {folder: size})
    return layer


def squash_into(layers: list[str], dest: str) -> int:
    """Apply each layer (lowest first) onto ``dest``, as overlayfs resolves an upper over a
    lower: a whiteout removes what is below and stays (the image below may have the path);
    an opaque folder replaces what is below; a folder over a folder merges, and one over
    a file or a whiteout becomes opaque (nothing of the image below shows through, as
    before); anything else replaces what is below, as a hard link to the layer's file.
    Folders keep their mode, owner, xattrs and times. Nothing is followed; no recursion
    (a stack); at most ``_SQUASH_ENTRIES`` entries. Returns the entries applied."""
    os.mkdir(dest, 0o755)
    applied = 0
    for layer in layers:
        stack = [""]
        while stack:
            rel = stack.pop()
            src_dir = os.path.join(layer, rel) if rel else layer
            with os.scandir(src_dir) as it:
                entries = list(it)
            for entry in entries:
                applied += 1
                if applied > _SQUASH_ENTRIES:
                    raise CheckpointError(f"the layers to squash hold more than {_SQUASH_ENTRIES} entries")
                name = os.path.join(rel, entry.name) if rel else entry.name
                src, dst = entry.path, os.path.join(dest, name)
                st = entry.stat(follow_symlinks=False)
                there = _lstat(dst)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
                    _remove(dst, there)
                    os.mknod(dst, stat.S_IFCHR | 0o000, 0)
                elif stat.S_ISDIR(st.st_mode):
                    opaque = _xattr(src, _OPAQUE) == b"y"
                    merge = there is not None and stat.S_ISDIR(there.st_mode) and not opaque
                    if not merge:
                        _remove(dst, there)
                        os.mkdir(dst, 0o700)
                    _copy_dir_meta(src, dst, st)
                    if not merge and (opaque or there is not None):
                        os.setxattr(dst, _OPAQUE, b"y", follow_symlinks=False)
                    elif merge and _xattr(dst, _OPAQUE) == b"y":
                        pass  # (stays opaque: what it hid is hidden still)
                    stack.append(name)
                else:
                    _remove(dst, there)
                    os.link(src, dst, follow_symlinks=False)
        # (folder times are set again after their content changed)
    _fix_times(layers, dest)
    return applied


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def _remove(path: str, st: os.stat_result | None) -> None:
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        from sequester.sandbox.remove import remove_tree

        remove_tree(Path(path))
    else:
        os.unlink(path)


def _copy_dir_meta(src: str, dst: str, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if name.startswith(("user.overlay.", "trusted.overlay.")):
            continue  # overlayfs's own: decided above
        try:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
        except OSError:
            pass  # (a namespace this caller cannot write, e.g. security.*)


def _fix_times(layers: list[str], dest: str) -> None:
    """Each folder of ``dest`` gets the times of the topmost layer's folder at its path (a
    stack, no link followed)."""
    for layer in layers:
        stack = [""]
        while stack:
            rel = stack.pop()
            root = os.path.join(layer, rel) if rel else layer
            target = os.path.join(dest, rel) if rel else dest
            try:
                st = os.lstat(root)
                if stat.S_ISDIR(os.lstat(target).st_mode):
                    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
                with os.scandir(root) as it:
                    stack.extend(
                        os.path.join(rel, e.name) if rel else e.name for e in it if e.is_dir(follow_symlinks=False)
                    )
            except OSError:
                continue


def discard_folder(folder: Path) -> None:
    """A checkpoint folder that was never sealed (its checkpoint refused)."""
    remove_mapped_tree(folder)


def plain_path(path: str | None) -> bool:
    """``path`` is absolute, normal (no ``.``, ``..`` or empty part), of at most 4096 bytes
    and parts of at most 255: a shell's working directory fit to start in. Pure."""
    if not path or not path.startswith("/") or "\0" in path or len(path.encode(errors="replace")) > 4096:
        return False
    parts = path.split("/")[1:]
    return path == "/" or all(p not in ("", ".", "..") and len(p.encode(errors="replace")) <= 255 for p in parts)

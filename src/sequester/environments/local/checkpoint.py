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


# How deep a layer may go for the host to measure or squash it (one descriptor per level).
MAX_DEPTH = 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def tree_bytes(root: Path, *, limit: int = 2_000_000, seconds: float = 20.0) -> int:
    """Disk blocks under ``root`` in bytes, walked by folder descriptors (no path is built,
    so no name length or depth of the agent's can make a lookup fail; nothing is followed;
    no recursion). Hard links within the tree count once. More than ``limit`` entries,
    folders more than ``MAX_DEPTH`` deep, a scan past ``seconds``, or anything it cannot
    read: :class:`CheckpointError` (a layer it cannot measure whole is not sealed: red team,
    a file below a path longer than ``PATH_MAX`` went uncounted, and so past the disk cap)."""
    total, seen, entries = 0, set(), 0
    deadline = time.monotonic() + seconds
    stack: list[tuple[int, list[str]]] = []
    try:
        fd = os.open(root, _DIR_FLAGS)
        stack.append((fd, os.listdir(fd)))
        while stack:
            fd, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            name = names.pop()
            entries += 1
            if entries > limit or (entries % 4096 == 0 and time.monotonic() > deadline):
                raise CheckpointError(
                    f"the writable layer holds more than {limit} entries, or more than {seconds:g} s of them to "
                    "measure: it is not sealed"
                )
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= MAX_DEPTH:
                    raise CheckpointError(f"the writable layer goes more than {MAX_DEPTH} folders deep: not sealed")
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                stack.append((child, os.listdir(child)))
    except OSError as exc:
        raise CheckpointError(f"the writable layer could not be measured ({exc.strerror}): it is not sealed") from None
    finally:
        for fd, _ in stack:
            os.close(fd)
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
    try:
        return _copy_logs(source, dest, budget)
    except OSError as exc:  # (a name too long, a folder it cannot read: not copied, not sealed)
        raise CheckpointError(f"the agent's log folders could not be copied: {exc}") from None


def _copy_logs(source: Path, dest: Path, budget: int) -> int:
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
# content is hidden with this xattr; a whiteout is a character device 0:0. Its own names
# are user.overlay.*; an agent's own user.overlay.X is stored escaped, user.overlay.overlay.X.
_OPAQUE = "user.overlay.opaque"
_SQUASH_ENTRIES = 5_000_000  # entries one squash may walk (the layers are bounded by checkpoint_disk_mb too)


def _overlays_own(name: str) -> bool:
    return name.startswith(("user.overlay.", "trusted.overlay.")) and not name.startswith(
        ("user.overlay.overlay.", "trusted.overlay.overlay.")
    )


def squash(layers: Sequence[Path], state_dir: Path, ids: IdMap | None) -> Path:
    """One sealed layer that stands for ``layers`` (lowest first) over the same image, as
    overlayfs would resolve them (:func:`squash_into`), in a folder of its own (held once).
    Files are hard links to the layers' (nothing is copied but folders and whiteouts); an
    ordinary caller does it as root of a namespace mapping the episode's ids (the layers
    hold files of its subordinate ids). :class:`CheckpointError` when it cannot be made."""
    folder = new_folder(state_dir)
    layer = folder / "layer"
    try:
        if os.getuid() != 0 and ids is not None:
            from sequester.sandbox.idspace import run_in_id_space

            run_in_id_space(ids, __name__, "squash_into", [str(p) for p in layers], str(layer))
        else:
            squash_into([str(p) for p in layers], str(layer))
        size = tree_bytes(layer)
    except BaseException as exc:
        remove_mapped_tree(folder)
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            raise CheckpointError(f"the sealed layers could not be squashed into one: {exc}") from None
        raise
    _REFS.add([folder], {folder: size})
    return layer


def squash_into(layers: list[str], dest: str) -> int:
    """Apply each layer (lowest first) onto ``dest``, as overlayfs resolves an upper over a
    lower: a whiteout removes what is below and stays (the image below may have the path);
    an opaque folder replaces what is below; a folder over a folder merges, and one over a
    file or a whiteout becomes opaque (nothing of the image below shows through, as
    before); anything else replaces what is below, as a hard link to the layer's file. A
    folder takes the mode, owner, times and xattrs of the topmost layer's (exactly: a name
    that layer lacks is removed). By folder descriptors, pairwise (no path is built: no
    name length or depth of the agent's makes a lookup fail), nothing followed, no
    recursion; at most ``_SQUASH_ENTRIES`` entries and ``MAX_DEPTH`` folders deep, else
    :class:`CheckpointError`. Returns the entries applied."""
    os.mkdir(dest, 0o755)
    applied = 0
    dest_fd = os.open(dest, _DIR_FLAGS)
    try:
        for layer in layers:
            src_root = os.open(layer, _DIR_FLAGS)
            stack: list[tuple[int, int, list[str]]] = []
            try:
                _copy_dir_meta(src_root, dest_fd, os.fstat(src_root))
                stack.append((src_root, os.dup(dest_fd), os.listdir(src_root)))
            except BaseException:
                os.close(src_root)
                raise
            try:
                while stack:
                    src_fd, dst_fd, names = stack[-1]
                    if not names:  # done with this folder: its times now (its entries changed them)
                        st = os.fstat(src_fd)
                        os.utime(dst_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                        os.close(src_fd)
                        os.close(dst_fd)
                        stack.pop()
                        continue
                    name = names.pop()
                    applied += 1
                    if applied > _SQUASH_ENTRIES:
                        raise CheckpointError(f"the layers to squash hold more than {_SQUASH_ENTRIES} entries")
                    child = _apply(src_fd, dst_fd, name)
                    if child is not None:
                        if len(stack) >= MAX_DEPTH:
                            os.close(child[0])
                            os.close(child[1])
                            raise CheckpointError(f"the layers to squash go more than {MAX_DEPTH} folders deep")
                        stack.append((*child, os.listdir(child[0])))
            finally:
                for src_fd, dst_fd, _ in stack:
                    os.close(src_fd)
                    os.close(dst_fd)
    finally:
        os.close(dest_fd)
    return applied


def _apply(src_fd: int, dst_fd: int, name: str) -> tuple[int, int] | None:
    """One entry of a layer onto the squashed tree; for a folder, both folders' descriptors
    (to walk next)."""
    st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
    try:
        there: os.stat_result | None = os.stat(name, dir_fd=dst_fd, follow_symlinks=False)
    except FileNotFoundError:
        there = None
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
        _remove_at(dst_fd, name, there)
        os.mknod(name, stat.S_IFCHR | 0o000, 0, dir_fd=dst_fd)
        return None
    if not stat.S_ISDIR(st.st_mode):
        _remove_at(dst_fd, name, there)
        os.link(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
        return None
    src_child = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
    try:
        opaque = _fxattr(src_child, _OPAQUE) == b"y"
        merge = there is not None and stat.S_ISDIR(there.st_mode) and not opaque
        if not merge:
            _remove_at(dst_fd, name, there)
            os.mkdir(name, 0o700, dir_fd=dst_fd)
        dst_child = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
    except BaseException:
        os.close(src_child)
        raise
    try:
        was_opaque = _fxattr(dst_child, _OPAQUE) == b"y"
        _copy_dir_meta(src_child, dst_child, st)
        # Opaque when it hides what is below it in the image: marked so in the layer, or
        # put over something that was not a folder, or merged into one that was opaque.
        if opaque or (not merge and there is not None) or (merge and was_opaque):
            os.setxattr(dst_child, _OPAQUE, b"y")
    except BaseException:
        os.close(src_child)
        os.close(dst_child)
        raise
    return src_child, dst_child


def _fxattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def _remove_at(dir_fd: int, name: str, st: os.stat_result | None) -> None:
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        from sequester.sandbox.remove import remove_tree_at

        remove_tree_at(dir_fd, name)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _copy_dir_meta(src_fd: int, dst_fd: int, st: os.stat_result) -> None:
    """Mode, owner, times and the xattrs (exactly the source's, but overlayfs's own names)."""
    os.fchown(dst_fd, st.st_uid, st.st_gid)
    os.fchmod(dst_fd, stat.S_IMODE(st.st_mode))
    wanted = {n for n in os.listxattr(src_fd) if not _overlays_own(n)}
    for name in os.listxattr(dst_fd):
        if name not in wanted and not _overlays_own(name):
            try:
                os.removexattr(dst_fd, name)
            except OSError:
                pass
    for name in wanted:
        try:
            os.setxattr(dst_fd, name, os.getxattr(src_fd, name))
        except OSError:
            pass  # (a namespace this caller cannot write, e.g. security.*)


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

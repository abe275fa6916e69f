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
sealed layers (a deeper checkpoint is refused, naming the setting: roll back or fork
from an earlier one), and the sealed layers of this process take at most
``[episodes] checkpoint_disk_mb`` (measured before the layer is sealed: a checkpoint
that would pass it is refused and the episode goes on as it was).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sequester.environments.local.state import EpisodeDirs
from sequester.errors import EpisodeError
from sequester.images.choose import Choice
from sequester.sandbox.idspace import remove_mapped_tree
from sequester.tasks import Task

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SHELL_STATE_COMMAND",
    "parse_shell_state",
    "seal",
    "tree_bytes",
    "held_bytes",
    "copy_logs",
    "hold",
    "hold_for",
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
    workdir: str
    env: dict[str, str]
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


def tree_bytes(root: Path, *, limit: int = 2_000_000) -> int:
    """Disk blocks under ``root`` in bytes: every entry ``lstat``-ed once, no link
    followed, no recursion (a stack of folders), at most ``limit`` entries (then what was
    counted). Hard links within the tree count once."""
    total, seen, stack, entries = 0, set(), [root], 0
    while stack and entries < limit:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    entries += 1
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
        except OSError:
            continue
    return total


def seal(dirs: EpisodeDirs, state_dir: Path, size: int) -> Path:
    """Move the episode's writable layer (its sandbox ended) into a folder of its own,
    with a copy of the agent's log folders; returns the layer. Held once (for the
    checkpoint that is being made)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-ckpt-", dir=state_dir))
    layer = folder / "layer"
    try:
        os.rename(dirs.upper_root, layer)
        copy_logs(dirs.root / "logs", folder / "logs")
    except BaseException:
        remove_mapped_tree(folder)
        raise
    _REFS.add([folder], {folder: size})
    return layer


def copy_logs(source: Path, dest: Path) -> None:
    """The agent's log folders (``/logs/agent``, ``/logs/artifacts``): a copy, links kept
    as links, modes kept. A file that cannot be read is left out."""
    if not source.is_dir():
        return
    shutil.copytree(
        source, dest, symlinks=True, ignore_dangling_symlinks=True, dirs_exist_ok=True, copy_function=_copy_or_skip
    )


def _copy_or_skip(src: str, dst: str) -> None:
    try:
        shutil.copy2(src, dst, follow_symlinks=False)
    except OSError:
        pass

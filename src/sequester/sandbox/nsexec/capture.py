"""The test script's own reward writes, out of reach of every program it runs.

Attack (strict xfails until this module): a program the tests run leaves a writer behind
that rewrites ``/logs/verifier/reward.txt`` between the script's last write and its
exit, or hands a descriptor of the folder to an agent process left running; both turned
the script's 0 into 1. Every process of the tests shares the shell's mount namespace,
user and capabilities, so no file the shell can write is out of their reach: the shell's
reward writes must not land in a file at all.

How: the shell that runs ``test.sh`` (the runner's bash, forked by the namespace
helper's worker) loads a filter that hands every open for writing to that worker
(seccomp user notification, :func:`sequester.guard.seccomp.compile_write_watch`), and
sends it the notification descriptor before it execs bash. The worker answers each
call:

* the shell's own open of ``/logs/verifier/reward.txt`` or ``reward.json`` (named by an
  absolute path): the worker makes a unix stream socket pair, keeps one end (with
  ``SO_PASSCRED``: the kernel tells it which process wrote each piece, and never joins
  pieces of different writers) and installs the other as the call's result
  (``SECCOMP_IOCTL_NOTIF_ADDFD``). The shell's ``echo 1 >`` writes into it; only what
  the shell's own process wrote counts (a program the shell runs with that descriptor
  as its output, ``if cmd; then ...; fi > reward.txt``, writes nothing that counts);
  nothing else can name, open or trace the worker's end;
* everything else (other processes, other paths): the call goes on unchanged
  (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``), so the visible folder holds what it always did.

When the shell has ended, what it wrote is the verdict, whatever the visible files say
(see ``server._captured``: where the shell wrote no reward file and ended normally, a
program it ran, a Python scorer, wrote it, and the visible file counts, as under Docker).

The path is read from the shell's memory with ``process_vm_readv`` (no program of the
tests can write that memory: they cannot name the shell), and the notification checked
still valid after the read. Cost: a round trip through the worker for each open for
writing by the tests (measured in ``benchmarks/episode_bench.py``'s evaluate rows).
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import select
import socket
import struct
from dataclasses import dataclass, field

from sequester.sandbox.nsexec.ns import libc

__all__ = ["VERDICT_NAMES", "Capture", "verdict_name"]

VERDICT_NAMES = ("reward.txt", "reward.json")
VERDICT_DIR = "/logs/verifier"
_PATH_MAX = 4096
LIMIT = 1 << 20  # what the shell writes to one reward file; beyond it is not kept
_AT_FDCWD = -100
_UCRED = struct.Struct("iII")  # pid, uid, gid


def verdict_name(path: bytes) -> str | None:
    """``reward.txt`` or ``reward.json`` when ``path`` names that file of the verdict
    folder by an absolute path (lexically: ``//logs/./verifier/reward.txt`` too), else
    None (relative paths included: the shell's working folder is not followed)."""
    if not path.startswith(b"/") or b"\0" in path:
        return None
    try:
        text = path.decode()
    except UnicodeDecodeError:
        return None
    folder, name = posixpath.split(posixpath.normpath("/" + text.lstrip("/")))
    return name if folder == VERDICT_DIR and name in VERDICT_NAMES else None


# -- the kernel's interface (linux/seccomp.h) -----------------------------------------


class _Data(ctypes.Structure):
    _fields_ = [
        ("nr", ctypes.c_int),
        ("arch", ctypes.c_uint32),
        ("instruction_pointer", ctypes.c_uint64),
        ("args", ctypes.c_uint64 * 6),
    ]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("data", _Data)]


class _Resp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class _AddFd(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("srcfd", ctypes.c_uint32),
        ("newfd", ctypes.c_uint32),
        ("newfd_flags", ctypes.c_uint32),
    ]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _ioc(direction: int, nr: int, size: int) -> int:
    return direction << 30 | size << 16 | ord("!") << 8 | nr


_IOW, _IOR = 1, 2
_NOTIF_RECV = _ioc(_IOW | _IOR, 0, ctypes.sizeof(_Notif))
_NOTIF_SEND = _ioc(_IOW | _IOR, 1, ctypes.sizeof(_Resp))
_NOTIF_ID_VALID = _ioc(_IOW, 2, 8)
_NOTIF_ADDFD = _ioc(_IOW, 3, ctypes.sizeof(_AddFd))
_FLAG_CONTINUE = 1
_ADDFD_FLAG_SEND = 2

libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
libc.process_vm_readv.restype = ctypes.c_ssize_t


@dataclass
class _Stream:
    """One open of a reward file by the shell: the worker's end of its socket pair, and
    what arrived there from the shell itself and from others (a program the shell ran with
    that descriptor as its output)."""

    name: str
    sock: socket.socket
    own: bytearray = field(default_factory=bytearray)
    others: bytearray = field(default_factory=bytearray)
    open: bool = True

    def content(self) -> tuple[bytes, bool]:
        """What this open wrote, and whether it came from others: the shell's own bytes
        when it wrote any (then nothing else counts: ``if prog; ...; fi > reward.txt``),
        else what a program it ran wrote through it (``{ scorer; } > reward.txt``)."""
        return (bytes(self.own), False) if self.own else (bytes(self.others), bool(self.others))


_READS_PER_TURN = 64  # reads of one stream before the others get a turn (a writer that never stops)


@dataclass
class Capture:
    """The worker's side: answers the shell's filter until the shell has ended."""

    listener: int
    shell: int
    calls: dict[int, str]  # this machine's numbers of open, openat, creat, openat2 (the host's libseccomp)
    handled: int = 0
    _opens: dict[str, list[_Stream]] = field(default_factory=dict)  # by name, since its last truncating open
    _streams: dict[int, _Stream] = field(default_factory=dict)  # by the worker's descriptor, while open
    _poller: select.poll = field(default_factory=select.poll)
    _ended: bool = False

    @property
    def contents(self) -> dict[str, bytes]:
        """What the script wrote to each reward file it opened (see :meth:`_Stream.content`)."""
        return {name: b"".join(st.content()[0] for st in opens)[:LIMIT] for name, opens in self._opens.items()}

    @property
    def borrowed(self) -> set[str]:
        """Names whose content came (in part) from a program the shell ran, not the shell."""
        return {name for name, opens in self._opens.items() if any(st.content()[1] for st in opens)}

    @property
    def others(self) -> set[str]:
        """Names into whose shell descriptor another process wrote, counted or not."""
        return {name for name, opens in self._opens.items() if any(st.others for st in opens)}

    def serve(self) -> int:
        """Answer notifications and read the script's writes until the shell ends; its
        wait status. (The tests' processes are all dead then: what is left in the sockets
        is read, the shell's own; what arrives later, from an agent process that was
        handed a descriptor, is not.)"""
        pidfd = os.pidfd_open(self.shell)
        try:
            self._poller.register(pidfd, select.POLLIN)
            self._poller.register(self.listener, select.POLLIN)
            listening = True
            while True:
                for fd, events in self._poller.poll():
                    if fd == pidfd:
                        status = os.waitpid(self.shell, 0)[1]
                        self._ended = True
                        for key in list(self._streams):
                            self._drain(key, turns=LIMIT // (1 << 16) + 1)
                        return status
                    if fd in self._streams:
                        self._drain(fd)
                    elif events & select.POLLIN:
                        self._answer()
                    elif listening:  # (no filter user is left)
                        self._poller.unregister(self.listener)
                        listening = False
        finally:
            os.close(pidfd)
            for stream in self._streams.values():
                stream.sock.close()
            self._streams.clear()

    def _drain(self, key: int, turns: int = _READS_PER_TURN) -> None:
        """Read what is waiting on one stream (at most ``turns`` reads); keep each byte
        with who wrote it (the shell, or others), each side at most :data:`LIMIT`."""
        stream = self._streams[key]
        for _ in range(turns):
            try:
                data, ancillary, _, _ = stream.sock.recvmsg(
                    1 << 16, socket.CMSG_SPACE(_UCRED.size), socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every holder closed it
                self._poller.unregister(key)
                stream.sock.close()
                stream.open = False
                del self._streams[key]
                return
            pid = next(
                (
                    _UCRED.unpack(cdata[: _UCRED.size])[0]
                    for level, kind, cdata in ancillary
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                ),
                None,
            )
            side = stream.own if pid == self.shell else stream.others
            if pid != self.shell and self._ended:
                continue  # (after the shell's end: only an agent process handed a descriptor is left)
            side += data[: max(0, LIMIT - len(side))]

    def _answer(self) -> None:
        notif = _Notif()
        if libc.ioctl(self.listener, _NOTIF_RECV, ctypes.byref(notif)) != 0:
            return  # (the caller went away before it was read: ENOENT)
        self.handled += 1
        fd, error = None, 0
        try:
            if notif.pid == self.shell:
                fd, error = self._open_for_shell(notif)
        except OSError as exc:
            error = exc.errno or errno.EIO
        if fd is not None:
            addfd = _AddFd(notif.id, _ADDFD_FLAG_SEND, fd, 0, os.O_CLOEXEC if self._flags(notif) & os.O_CLOEXEC else 0)
            added = libc.ioctl(self.listener, _NOTIF_ADDFD, ctypes.byref(addfd))
            failed = ctypes.get_errno() if added < 0 else 0
            os.close(fd)  # (the shell's end: the shell holds its own copy now)
            if added >= 0 or failed == errno.ENOENT:  # (ENOENT: the shell is gone)
                return
            error = failed or errno.EIO  # (its descriptor table full: the open fails, never waits)
        resp = _Resp(notif.id, 0, -error if error else 0, 0 if error else _FLAG_CONTINUE)
        libc.ioctl(self.listener, _NOTIF_SEND, ctypes.byref(resp))

    def _flags(self, notif: _Notif) -> int:
        call, args = self.calls.get(notif.data.nr), notif.data.args
        if call == "openat":
            return int(args[2])
        if call == "open":
            return int(args[1])
        if call == "creat":
            return os.O_CREAT | os.O_WRONLY | os.O_TRUNC
        return 0

    def _open_for_shell(self, notif: _Notif) -> tuple[int | None, int]:
        """The private file for the shell's open of a reward file, or (None, 0): go on."""
        call, args = self.calls.get(notif.data.nr), notif.data.args
        if call == "openat":
            dirfd = ctypes.c_int32(args[0] & 0xFFFFFFFF).value
            address, mode = args[1], args[3]
            if dirfd != _AT_FDCWD:
                return None, 0  # (relative to a folder descriptor: not followed)
        elif call in ("open", "creat"):
            address, mode = args[0], args[2] if call == "open" else args[1]
        else:
            return None, 0  # (openat2: its flags are behind a pointer; bash never uses it)
        del mode  # (a socket has none)
        name = verdict_name(self._read_path(address))
        if name is None or libc.ioctl(self.listener, _NOTIF_ID_VALID, ctypes.byref(ctypes.c_uint64(notif.id))) != 0:
            return None, 0
        flags = self._flags(notif)
        # What the shell wrote before comes first; a truncating open starts over.
        for key in [k for k, st in self._streams.items() if st.name == name]:
            self._drain(key)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ours.shutdown(socket.SHUT_WR)  # (the shell reads nothing from it)
        stream = _Stream(name, ours)
        if flags & os.O_APPEND and name in self._opens:
            self._opens[name].append(stream)
        else:
            self._opens[name] = [stream]
        self._streams[ours.fileno()] = stream
        self._poller.register(ours.fileno(), select.POLLIN)
        return theirs.detach(), 0

    def _read_path(self, address: int) -> bytes:
        """The NUL-terminated path at ``address`` in the shell (at most PATH_MAX bytes)."""
        out = b""
        while len(out) < _PATH_MAX:
            step = min(256, 4096 - (address + len(out)) % 4096)  # (never across a page)
            buf = ctypes.create_string_buffer(step)
            local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), step)
            remote = _IoVec(ctypes.c_void_p(address + len(out)), step)
            got = libc.process_vm_readv(self.shell, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                return b""
            chunk = buf.raw[:got]
            if b"\0" in chunk:
                return out + chunk[: chunk.index(b"\0")]
            out += chunk
        return b""

"""The syscall filter that makes process creation impossible, whatever the Python code does.

Compiled on the host with libseccomp (through ``pyseccomp``) into a BPF program; the
kernel process loads that program on itself (:func:`load_filter`) with ``TSYNC``, so
threads started before the filter (the network bridge) are covered too. Compiling on
the host keeps libseccomp out of the kernel's memory and its start-up time.

What the filter refuses (everything else is allowed, so Python and threads work):

* process creation: ``execve`` (except the one handoff from the kernel's first stage
  into its cell runner, recognised by the address of its path argument, see
  :mod:`.handoff`), ``execveat``, ``fork``, ``vfork``, ``clone`` without
  ``CLONE_THREAD``; ``clone3`` answers ``ENOSYS`` so libc falls back to ``clone``;
* ``memfd_create``: a memfd is an exec-capable file that lives nowhere, so a library
  written into one could be ``dlopen``-ed from ``/proc/self/fd`` although every
  writable mount of the kernel is ``noexec``;
* namespace and privilege games: ``unshare``, ``setns``, ``mount`` and friends, ``bpf``,
  ``ptrace``, ``process_vm_*``, ``keyctl`` and friends (the keyring is shared by uid), ...;
* sockets other than TCP over IPv4/IPv6 (no unix socket to a daemon that happens to be
  visible; no UDP, raw, SCTP or MPTCP socket: in guard-only mode, where no network
  namespace holds the kernel, Landlock limits TCP only, and a datagram could go anywhere);
* ``io_uring`` (its operations would bypass this filter);
* kernel state a sandbox could attach to a file or folder it only sees, and so reach past
  its sandbox: leases (``fcntl(F_SETLEASE)``: a host process opening the file would wait
  for the sandbox, and the sandbox learns of the open), directory notifications
  (``fcntl(F_NOTIFY)``, ``inotify_*``: every process's activity in a watched folder, the
  host's and the verifier's included), write-life hints (``F_SET_RW_HINT``, kept on the
  inode) and a read that answers only from the page cache (``preadv2`` with ``RWF_NOWAIT``:
  whether another process read the file lately). Advisory locks (``flock``,
  ``fcntl(F_SETLK)``) stay: sqlite and pip need them; a lock on a file two sandboxes see is
  the documented channel between them.

A guard-only kernel (no namespace holds it) also gets no ``listen``: Landlock checks an
explicit ``bind`` only, and ``listen`` on an unbound socket serves every address.

The ``agent`` profile (an episode's shell and its verifier) is no wider than Docker's
default profile for a container's capabilities: it refuses the second group, what Docker's
refuses beside it (NUMA policy calls, ``personality`` beyond ``PER_LINUX32``/``UNAME26``,
``AF_VSOCK`` sockets, ``clone`` with namespace flags, ``clone3`` answered ``ENOSYS``,
obsolete calls), and adds ``io_uring``, leases, ``F_NOTIFY`` and inotify: agents start
processes, ``chroot``, debug them and talk to local daemons of their own (inotify is
refused because an episode's view binds host folders too, where a watch sees the host's
activity; file watchers fall back to polling). ``docs/security.md`` lists every refusal.

Why a denylist: an allowlist precise enough for arbitrary Python (numpy, threads,
asyncio) is brittle across libc versions; the namespaces already contain what the
remaining syscalls can reach.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from sequester.guard.handoff import HANDOFF_ADDRESS

__all__ = [
    "AGENT_FCNTL_REFUSED",
    "DENIED_SYSCALLS",
    "FORK_CLONE_FLAGS",
    "FORK_NAMESPACES",
    "KERNEL_FCNTL_REFUSED",
    "WATCH_SYSCALLS",
    "WRITE_OPEN_FLAGS",
    "PROCESS_SYSCALLS",
    "compile_filter",
    "compile_write_watch",
    "load_filter",
    "syscall_number",
    "warm_clone_rules",
]

CLONE_THREAD = 0x00010000
# A warm kernel's allowances (profile "warm", see kernel/stage0_fork.c): clone with
# glibc's fork() flags (CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD), alone or with
# any of a fork's namespace flags (user, mount, PID, network, IPC, UTS: the single-threaded
# copy's clone of the fork), and nothing else that makes no thread.
FORK_CLONE_FLAGS = 0x01200011
FORK_NAMESPACES = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
# ... and the mounts a fork's plan makes in its own namespaces (the warm kernel holds no
# capability over its own mount namespace: they fail there).
WARM_ALLOWED = ("mount", "umount2", "mount_setattr")

PROCESS_SYSCALLS = ("execve", "execveat", "fork", "vfork")

# Denied to everything sequester confines, kernels and agents alike: what a container
# runtime refuses too (namespaces, mounts, kernel modules, keyrings, clocks, ...).
DENIED_SYSCALLS = (
    # namespaces, mounts, privileges
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "umount",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "pidfd_getfd",
    "kcmp",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "fanotify_init",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "vhangup",
    "uselib",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # refused by Docker's default profile too (not in its allowlist, or only with a
    # capability a container lacks: SYS_NICE, SYS_PTRACE, SYS_ADMIN)
    "get_mempolicy",
    "set_mempolicy",
    "set_mempolicy_home_node",
    "mbind",
    "migrate_pages",
    "move_pages",
    "process_madvise",
    "lookup_dcookie",
    "nfsservctl",
    "sysfs",
    "ustat",
    "_sysctl",
    "vm86",
    "vm86old",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "quotactl_fd",
    "stime",
)
# Only kernels: an agent's shell debugs its programs (ptrace) and names its host.
# chroot: an agent holds CAP_SYS_CHROOT, as a container does.
KERNEL_ONLY_DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "sethostname",
    "setdomainname",
    "memfd_create",
    "chroot",
)
# Docker's: personality() may only set PER_LINUX, PER_LINUX32, UNAME26 (bits 0x20008),
# never ADDR_NO_RANDOMIZE and the rest; every other bit of the low 32 refused (the query
# 0xffffffff too: a narrower rule than Docker's, which one-comparison rules cannot avoid).
PERSONALITY_ALLOWED_BITS = 0x20008
AF_VSOCK = 40  # a socket to the hypervisor: Docker refuses it
# clone() flags that make namespaces (Docker refuses them without CAP_SYS_ADMIN; an agent
# lacks it anyway, and its namespace allows no user namespace below it).
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

# Socket families the kernel may create (everything else: EPERM). AF_INET=2, AF_INET6=10.
ALLOWED_SOCKET_FAMILIES = (2, 10)  # not ``socket``'s names: the kernel imports this module
# ... of type SOCK_STREAM (1; the low 4 bits of the type, flags aside) only, with protocol
# 0 or IPPROTO_TCP (6). The other types and protocols: EPERM.
SOCK_STREAM, SOCK_TYPE_MASK, IPPROTO_TCP = 1, 0xF, 6
REFUSED_SOCKET_TYPES = (2, 3, 4, 5, 6, 10)  # DGRAM, RAW, RDM, SEQPACKET, DCCP, PACKET

# fcntl commands that attach kernel state to a file or folder (see the module): refused to
# kernels; leases and dnotify to agents too. F_SETLEASE, F_NOTIFY, F_SET_RW_HINT.
F_SETLEASE, F_NOTIFY, F_SET_RW_HINT = 1024, 1026, 1036
KERNEL_FCNTL_REFUSED = (F_SETLEASE, F_NOTIFY, F_SET_RW_HINT)
RWF_NOWAIT = 0x8
AGENT_FCNTL_REFUSED = (F_SETLEASE, F_NOTIFY)
# Watches on files and folders (fanotify is refused to everyone): refused to kernels and
# agents alike (an episode's view binds host folders too: the Python installation, the
# runner; a watch there saw the host's reads, red team).
WATCH_SYSCALLS = ("inotify_init", "inotify_init1", "inotify_add_watch")


_COMPILED: dict[str, bytes] = {}


def compile_filter(profile: str = "kernel") -> bytes:
    """The BPF program (raw ``struct sock_filter`` array) for this machine's architecture.

    ``kernel``: everything below. ``guard``: a guard-only kernel's, the kernel's plus no
    ``listen`` (no namespace holds it). ``warm``: a warm kernel's (it forks kernels, see
    :func:`warm_clone_rules`), the kernel's but for ``fork()``'s ``clone`` (with a fork's
    namespace flags or without) and the mounts (:data:`WARM_ALLOWED`). ``agent`` (an episode's shell and verifier):
    :data:`DENIED_SYSCALLS`, leases, ``F_NOTIFY`` and inotify; processes, ptrace and unix
    sockets stay allowed. Compiled once per process and profile (it depends on nothing else).
    """
    if profile not in _COMPILED:
        _COMPILED[profile] = _compile(profile)
    return _COMPILED[profile]


def _compile(profile: str) -> bytes:
    import contextlib

    import pyseccomp as sc

    if profile not in ("kernel", "guard", "agent", "build", "warm"):
        raise ValueError(f"unknown seccomp profile {profile!r}")
    warm = profile == "warm"
    if warm:
        profile = "kernel"  # the kernel's, with the warm kernel's allowances below
    flt = sc.SyscallFilter(sc.ALLOW)
    if profile == "build":
        # A build's RUN is one uid in its user namespace (its files are the caller's on
        # disk, whatever their owner in the image), so a chown to another uid would fail
        # with EINVAL and fail the build (dpkg, useradd, "chown -R app /app"). As podman's
        # ignore_chown_errors: the chown family succeeds and changes nothing.
        for name in ("chown", "fchown", "lchown", "fchownat"):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                flt.add_rule(sc.ERRNO(0), name)
    eperm = sc.ERRNO(errno.EPERM)
    kernel_names = tuple(n for n in PROCESS_SYSCALLS if n != "execve") + KERNEL_ONLY_DENIED
    names = DENIED_SYSCALLS + (kernel_names if profile in ("kernel", "guard") else ())
    if warm:
        names = tuple(n for n in names if n not in WARM_ALLOWED)
    for name in names:
        try:
            flt.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):
            pass  # not a syscall on this architecture
    if profile in ("agent", "build"):
        for bit in range(32):
            if not PERSONALITY_ALLOWED_BITS & (1 << bit):
                flt.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
        # socket's family is an int: the low 32 bits only (red team: 1 << 32 | AF_VSOCK
        # passed an EQ rule and made a vsock socket)
        flt.add_rule(eperm, "socket", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, AF_VSOCK))
        for flag in CLONE_NAMESPACE_FLAGS:
            flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # as Docker: libc falls back to clone
    if profile in ("kernel", "guard", "agent"):
        # fcntl's command is an int: the kernel reads the low 32 bits, so compare those only
        # (red team: 1 << 32 | F_SETLEASE passed an EQ rule and still took the lease).
        for command in AGENT_FCNTL_REFUSED if profile == "agent" else KERNEL_FCNTL_REFUSED:
            flt.add_rule(eperm, "fcntl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, command))
        for name in WATCH_SYSCALLS:
            flt.add_rule(eperm, name)
    if profile in ("kernel", "guard"):
        # preadv2 with RWF_NOWAIT answers whether a page of a file is in the page cache, so
        # whether the host (or another kernel) read it lately (red team); its flags are the
        # sixth argument on every architecture that has it.
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            flt.add_rule(eperm, "preadv2", sc.Arg(5, sc.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    if profile == "guard":
        # No network namespace holds a guard-only kernel, and Landlock checks an explicit
        # bind only: listen() on an unbound socket picks a port and serves every address
        # (red team). A guard-only kernel serves nothing.
        flt.add_rule(eperm, "listen")
    if profile in ("kernel", "guard"):
        # execve: only the first stage's handoff, whose path lives at HANDOFF_ADDRESS.
        flt.add_rule(eperm, "execve", sc.Arg(0, sc.NE, HANDOFF_ADDRESS))
        # clone: allowed only when making a thread (a warm kernel: or exactly fork()'s).
        for mask, value in warm_clone_rules() if warm else ((CLONE_THREAD, 0),):
            flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, mask, value))
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        # socket(domain, ...): refuse every family but the allowed ones (ranges between them).
        low, high = sorted(ALLOWED_SOCKET_FAMILIES)
        flt.add_rule(eperm, "socket", sc.Arg(0, sc.LT, low))
        flt.add_rule(eperm, "socket", sc.Arg(0, sc.GT, high))
        for family in range(low + 1, high):
            flt.add_rule(eperm, "socket", sc.Arg(0, sc.EQ, family))
        # ... and, within them, TCP only (see the module).
        for kind in REFUSED_SOCKET_TYPES:
            flt.add_rule(eperm, "socket", sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, kind))
        flt.add_rule(eperm, "socket", sc.Arg(2, sc.GT, IPPROTO_TCP))
        for protocol in range(1, IPPROTO_TCP):
            flt.add_rule(eperm, "socket", sc.Arg(2, sc.EQ, protocol))
    return _export(flt)


def warm_clone_rules(fork_flags: int = FORK_CLONE_FLAGS, free: int = FORK_NAMESPACES) -> list[tuple[int, int]]:
    """``(mask, value)`` pairs, each refusing the ``clone`` calls whose flags ``f`` have
    ``f & mask == value``: together exactly the calls that make no thread and whose flags
    differ from ``fork_flags`` in a bit outside ``free``. (One comparison per rule, as
    libseccomp's rules are: such a call differs from ``fork_flags`` in some bit ``b``, and
    the rule of that bit refuses it; a thread, or ``fork_flags`` with any of ``free``,
    matches none.)"""
    if (fork_flags | free) & CLONE_THREAD or fork_flags & free:
        raise ValueError("fork's flags cannot make a thread, nor overlap the free bits")
    return [
        (CLONE_THREAD | 1 << bit, ~fork_flags & 1 << bit)
        for bit in range(64)
        if 1 << bit != CLONE_THREAD and not free & 1 << bit
    ]


def _export(flt: Any) -> bytes:
    """A pyseccomp filter's BPF program, as bytes."""
    read_fd, write_fd = os.pipe()
    try:
        with os.fdopen(write_fd, "wb") as out:
            flt.export_bpf(out)
        with os.fdopen(read_fd, "rb") as inp:
            return inp.read()
    except BaseException:
        for fd in (read_fd, write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        raise


# Every open for writing (an access mode but read-only, or O_CREAT, O_TRUNC, O_APPEND).
WRITE_OPEN_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND)


def compile_write_watch() -> bytes:
    """A filter that hands every open for writing (``open``, ``openat``, ``creat`` with
    :data:`WRITE_OPEN_FLAGS`; every ``openat2``, whose flags are behind a pointer) to a
    supervisor (``SECCOMP_RET_USER_NOTIF``) and allows everything else: the verifier's
    capture of the test script's own reward writes (:mod:`sequester.sandbox.nsexec.capture`).
    Loaded with :func:`load_filter` ``listener=True``; it refuses nothing itself."""
    if "write-watch" not in _COMPILED:
        import contextlib

        import pyseccomp as sc

        flt = sc.SyscallFilter(sc.ALLOW)
        for flag in WRITE_OPEN_FLAGS:  # the rules of one call are ORed: any of the bits
            flt.add_rule(sc.NOTIFY, "openat", sc.Arg(2, sc.MASKED_EQ, flag, flag))
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # (not on every architecture)
                flt.add_rule(sc.NOTIFY, "open", sc.Arg(1, sc.MASKED_EQ, flag, flag))
        for name in ("creat", "openat2"):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                flt.add_rule(sc.NOTIFY, name)
        _COMPILED["write-watch"] = _export(flt)
    return _COMPILED["write-watch"]


_NUMBERS: dict[str, int] = {}


def syscall_number(name: str) -> int:
    """This architecture's number of a syscall, from libseccomp's tables (host side)."""
    if name not in _NUMBERS:
        import pyseccomp as sc

        _NUMBERS[name] = int(sc.resolve_syscall(sc.system_arch(), name))
    return _NUMBERS[name]


# -- inside the kernel ---------------------------------------------------------------

_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 8


def load_filter(program: bytes, seccomp_nr: int, *, listener: bool = False) -> int:
    """Install ``program`` on every thread of this process. Irreversible.

    ``listener``: the program hands calls to a supervisor; returns the notification
    descriptor the kernel makes for it (``SECCOMP_FILTER_FLAG_NEW_LISTENER``; this
    process must then be single-threaded: no ``TSYNC``). Otherwise returns 0.
    Raises ``OSError`` if the kernel refuses, or if a thread could not be synchronised.
    """
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    if len(program) % 8:
        raise ValueError("a BPF program is a whole number of 8-byte instructions")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    res = libc.syscall(
        ctypes.c_long(seccomp_nr),
        ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(_SECCOMP_FILTER_FLAG_NEW_LISTENER if listener else _SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(prog),
    )
    if listener and res >= 0:
        return int(res)
    if res != 0:
        if res > 0:
            raise OSError(errno.EAGAIN, f"seccomp TSYNC failed: thread {res} could not be synchronised")
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp(SET_MODE_FILTER) failed: {os.strerror(err)}")
    return 0

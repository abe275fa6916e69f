"""``sequester check``: prove, on this machine, each property a kernel is promised.

Every probe runs in a real kernel under the given policy and compares what the kernel
sees with what the host sees (a hidden folder proves nothing if it was empty anyway).
The network probe starts two loopback services on the host and allows exactly one.
``fork=True`` (``sequester check --fork``) runs every probe in a fork of a warm kernel
(:meth:`Kernel.fork`) instead, and compares it with a second fork of the same warm kernel.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sequester.kernel.check_native import ctypes_unloadable
from sequester.kernel.client import Kernel
from sequester.policy import Isolation, Policy
from sequester.sandbox.host import gather_host_facts
from sequester.sandbox.mounts import hidden_paths, mount_backs
from sequester.sandbox.probe import namespace_support

__all__ = ["Finding", "CheckReport", "run_check", "tagged_service"]


@dataclass(frozen=True)
class Finding:
    name: str
    passed: bool
    evidence: str


@dataclass(frozen=True)
class CheckReport:
    mode: Isolation
    findings: tuple[Finding, ...]
    # Which first stage confined the probe kernel: "native" (stage0.c, one interpreter
    # start), "python" (no C compiler, or SEQUESTER_NATIVE_STAGE=0), "none" (off).
    first_stage: str = ""
    # Where its view came from: "template" (kept per policy, sandbox.template), "bwrap" (its own), "none".
    view: str = ""
    # Why a kernel that would have come from a view template has a bwrap of its own here.
    view_note: str = ""

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.findings)


@contextmanager
def tagged_service(tag: bytes, host: str = "127.0.0.1", *, echo: bool = False) -> Iterator[int]:
    """A TCP service on the host (yields its port) that greets every client with ``tag``
    and, with ``echo``, then sends back what it receives. Used as evidence by ``check``."""
    server = socket.create_server((host, 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                continue
            with client:
                client.sendall(tag)
                client.settimeout(2)
                try:
                    while echo and (data := client.recv(4096)):
                        client.sendall(data)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        server.close()


def _probe(kernel: Kernel, code: str) -> dict:
    """Run probe code that prints one JSON object; a failure becomes ``{"error": ...}``."""
    result = kernel.run(code, timeout=30)
    if result.error is not None:
        return {"error": str(result.error)}
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"probe printed no JSON: {result.stdout[-200:]!r}"}


_PROCESS_ROUTES = r"""
import json, os, sys
marker = os.path.join(os.getcwd(), "spawned")
shell = ["/bin/sh", "-c", "echo yes > " + marker]
def fork_exec():
    import _posixsubprocess
    r, w = os.pipe()
    args = [[b"/bin/sh"], [b"/bin/sh"], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w,
            True, False, -1, None, None, None, -1, None, False]
    try:
        return _posixsubprocess.fork_exec(*args)
    except TypeError:  # one argument fewer on some versions
        return _posixsubprocess.fork_exec(*(args[:16] + args[17:]))
def mp(method):
    import multiprocessing
    p = multiprocessing.get_context(method).Process(target=print)
    p.start(); p.join()
routes = {
    "subprocess": lambda: __import__("subprocess").run(shell),
    "os.system": lambda: os.system(" ".join(shell)),
    "os.fork": os.fork,
    "os.posix_spawn": lambda: os.posix_spawn(shell[0], shell, {}),
    "os.execv": lambda: os.execv(shell[0], shell),
    "pty.spawn": lambda: __import__("pty").spawn(shell),
    "_posixsubprocess.fork_exec": fork_exec,
    "multiprocessing.fork": lambda: mp("fork"),
    "multiprocessing.spawn": lambda: mp("spawn"),
    "multiprocessing.forkserver": lambda: mp("forkserver"),
}
out = {}
for name, call in routes.items():
    try:
        call()
        out[name] = "ran"
    except BaseException as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"routes": out, "marker": os.path.exists(marker)}))
"""


# A warm kernel's init for ``--fork``: what a fork must see of it, and a listener and a
# file of its own that no fork may reach.
_WARM_INIT = r"""
import json, os, socket
init_mark = "left by init"
init_listener = socket.socket()
init_listener.bind(("127.0.0.1", 0))
init_listener.listen()
with open("/tmp/init-file", "w") as _f:
    _f.write("init")
"""


@contextmanager
def _probe_kernels(policy: Policy, fork: bool) -> Iterator[tuple[Kernel, Callable[[], Kernel]]]:
    """The kernel the probes run in and how to make a second one to compare it with: a
    fresh kernel each, or (``fork``) two forks of one warm kernel."""
    if not fork:
        with Kernel(policy) as kernel:
            yield kernel, lambda: Kernel(policy).start()
        return
    with Kernel(policy, init=_WARM_INIT) as warm, warm.fork() as kernel:
        yield kernel, warm.fork


def run_check(policy: Policy, *, fork: bool = False) -> CheckReport:
    findings: list[Finding] = []
    support = namespace_support()
    findings.append(Finding("user namespaces available", support.available, support.detail))
    facts = gather_host_facts(scan_ffi=True, extra_roots=tuple(policy.readonly))
    with tagged_service(b"allowed") as allowed_port, tagged_service(b"other") as other_port:
        probe_policy = policy.with_overrides(allow=[f"127.0.0.1:{allowed_port}"])
        with _probe_kernels(probe_policy, fork) as (kernel, another):
            mode = kernel.mode
            first_stage = str(kernel.report.get("first_stage", ""))
            view = str(kernel.report.get("view", ""))
            view_note = str(kernel.report.get("view_note", ""))
            findings += [
                _files_hidden(kernel, policy, facts),
                _source_readonly(kernel, policy, facts),
                _workspace_writable(kernel),
                _network(kernel, allowed_port, other_port, mode),
                _processes_blocked(kernel),
                _processes_invisible(kernel),
                _capabilities(kernel),
                _no_file_state(kernel),
                _own_memory(kernel),
                _kernels_apart(kernel, another, fork),
                *([_init_state(kernel)] if fork else []),
                _ctypes(kernel),
                # last: it switches the audit hook off
                Finding("ctypes unloadable (hook off)", *ctypes_unloadable(kernel, facts.ffi_libraries)),
            ]
    return CheckReport(mode, tuple(findings), first_stage, view, view_note)


def _files_hidden(kernel: Kernel, policy: Policy, facts) -> Finding:
    dirs, _ = hidden_paths(policy, facts)
    backs = mount_backs(policy, facts)
    probes = []
    for path in dirs:
        try:
            host_entries = len(os.listdir(path))
        except OSError:
            continue
        # A mount-back inside a hidden folder leaves its top folder visible (.pyenv in /root).
        expected = sorted({b.relative_to(path).parts[0] for b in backs if b.is_relative_to(path) and b != path})
        probes.append((str(path), host_entries, expected))
    code = (
        "import json, os\nseen = {}\n"
        f"for p in {[p for p, _, _ in probes]!r}:\n"
        "    try: seen[p] = sorted(os.listdir(p))\n"
        "    except OSError as e: seen[p] = 'unreadable: ' + e.strerror\n"
        "print(json.dumps(seen))"
    )
    seen = _probe(kernel, code)
    if "error" in seen:
        return Finding("files hidden", False, seen["error"])
    bad: list[str] = []
    notes: list[str] = []
    for probed, host_count, expected in sorted(probes, key=lambda p: -p[1]):
        inside: Any = seen.get(probed)  # the probe's JSON: a list of names, or why not
        ok = isinstance(inside, str) or (isinstance(inside, list) and set(inside) <= set(expected))
        (notes if ok else bad).append(
            f"{probed}: host {host_count} entries, kernel {inside if isinstance(inside, str) else len(inside)}"
        )
    return Finding("files hidden", not bad and bool(probes), "; ".join(bad or notes[:4]) or "nothing to hide")


def _source_readonly(kernel: Kernel, policy: Policy, facts) -> Finding:
    targets = [str(facts.package_root), *(str(p) for p in policy.readonly if p.is_dir())]
    code = (
        "import json, os\nout = {}\n"
        f"for d in {targets!r}:\n"
        "    try:\n        open(os.path.join(d, '.sequester-probe'), 'w').close(); out[d] = 'WRITABLE'\n"
        "    except OSError as e: out[d] = e.strerror\n"
        "print(json.dumps(out))"
    )
    seen = _probe(kernel, code)
    if "error" in seen:
        return Finding("source read-only", False, seen["error"])
    writable = [d for d, v in seen.items() if v == "WRITABLE"]
    for d in writable:  # a failed probe must not leave its file behind on the host
        Path(d, ".sequester-probe").unlink(missing_ok=True)
    return Finding("source read-only", not writable, "; ".join(f"{d}: {v}" for d, v in seen.items()))


def _workspace_writable(kernel: Kernel) -> Finding:
    seen = _probe(
        kernel,
        "import json, os\nopen('probe.txt', 'w').write('ok')\n"
        "print(json.dumps({'cwd': os.getcwd(), 'read': open('probe.txt').read()}))",
    )
    ok = seen.get("read") == "ok"
    return Finding("workspace writable", ok, seen.get("error") or f"wrote and read back a file in {seen.get('cwd')}")


def _network(kernel: Kernel, allowed: int, other: int, mode: Isolation) -> Finding:
    code = f"""
import json, os, socket
def grab(host, port):
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            return s.recv(16).decode()
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
def via_proxy(port):
    proxy = os.environ.get("HTTP_PROXY")
    if not proxy:
        return "no proxy"
    host, _, pport = proxy.rpartition("/")[2].partition(":")
    try:
        with socket.create_connection((host, int(pport)), timeout=5) as s:
            s.sendall(f"CONNECT 127.0.0.1:{{port}} HTTP/1.1\\r\\n\\r\\n".encode())
            return s.recv(200).decode().splitlines()[0]
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
def resolve(name):
    try:
        socket.getaddrinfo(name, 443)
        return "resolved"
    except Exception as e:
        return type(e).__name__
print(json.dumps({{"allowed": grab("127.0.0.1", {allowed}), "other": grab("127.0.0.1", {other}),
                  "other_via_proxy": via_proxy({other}), "resolve": resolve("example.com")}}))
"""
    seen = _probe(kernel, code)
    if "error" in seen:
        return Finding("network allowlist", False, seen["error"])
    proxy_ok = seen["other_via_proxy"] in ("no proxy",) or " 403 " in seen["other_via_proxy"] + " "
    ok = seen["allowed"] == "allowed" and seen["other"] != "other" and proxy_ok and seen["resolve"] != "resolved"
    evidence = (
        f"allowed 127.0.0.1:{allowed} answered {seen['allowed']!r}; other 127.0.0.1:{other}: {seen['other']}; "
        f"through the proxy: {seen['other_via_proxy']}; example.com: {seen['resolve']}"
    )
    if mode is Isolation.GUARD:
        evidence += " (guard only: enforced by port (Landlock) and the audit hook, not by a namespace)"
    return Finding("network allowlist", ok, evidence)


def _processes_blocked(kernel: Kernel) -> Finding:
    seen = _probe(kernel, _PROCESS_ROUTES)
    if "error" in seen:
        return Finding("processes blocked", False, seen["error"])
    ran = [name for name, outcome in seen["routes"].items() if outcome == "ran"]
    ok = not ran and not seen["marker"]
    evidence = (
        f"ran: {ran}"
        if ran
        else f"{len(seen['routes'])} routes refused (e.g. {seen['routes']['_posixsubprocess.fork_exec']})"
    )
    if seen["marker"]:
        evidence += "; a child process wrote its marker file"
    return Finding("processes blocked", ok, evidence)


def _processes_invisible(kernel: Kernel) -> Finding:
    seen = _probe(
        kernel,
        "import json, os\nprint(json.dumps({'pids': sorted(int(p) for p in os.listdir('/proc') "
        "if p.isdigit()), 'me': os.getpid()}))",
    )
    if "error" in seen:
        return Finding("processes invisible", False, seen["error"])
    # The kernel is its namespace's only process (pid 1): an init of bwrap's beside it
    # would be a process of its uid without its filter.
    others = [p for p in seen["pids"] if p != seen["me"]]
    return Finding(
        "processes invisible",
        not others,
        f"/proc lists {seen['pids'][:8]}{'...' if len(seen['pids']) > 8 else ''} (the kernel is pid {seen['me']})",
    )


# The first kernel marks its workspace and /dev/shm and listens on loopback; the second
# looks for the marks, dials the port, and lists its processes.
_MARK = (
    "import os, socket\nfor d in ('/tmp', '/dev/shm'):\n    open(os.path.join(d, 'sequester-check-mark'), 'w').close()\n"
    "_check_listener = socket.create_server(('127.0.0.1', 0))\n_check_listener.getsockname()[1]"
)
_LOOK = """import json, os, socket
files = [d for d in ('/tmp', '/dev/shm') if os.path.exists(os.path.join(d, 'sequester-check-mark'))]
try:
    socket.create_connection(('127.0.0.1', @PORT@), timeout=2).close()
    reached = True
except OSError:
    reached = False
print(json.dumps({'files': files, 'reached': reached, 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}))
"""


def _kernels_apart(kernel: Kernel, another: Callable[[], Kernel], fork: bool) -> Finding:
    """A second kernel of the same policy (of the same view template, where kernels share
    one; or a second fork of the same warm kernel) sees nothing of the first: not its
    workspace files, not its loopback listener (its network namespace), not its process."""
    name = "forks apart" if fork else "kernels apart"
    marked = kernel.run(_MARK)
    if marked.error is not None or marked.value is None or not marked.value.isdigit():
        return Finding(name, False, f"the first kernel could not mark itself: {marked.error}")
    with another() as other:
        assert other.process is not None and kernel.process is not None  # both started; no cell failed
        if not fork and other.process.view_template is not kernel.process.view_template:
            return Finding(name, False, "the second kernel came from another view: nothing was compared")
        seen = _probe(other, _LOOK.replace("@PORT@", marked.value))
        view = other.report.get("view", "")
    if "error" in seen:
        return Finding("kernels apart", False, seen["error"])
    ok = not seen["files"] and not seen["reached"] and seen["pids"] == [1]
    return Finding(
        name,
        ok,
        f"a second kernel of the same {view} view saw the first's marks in "
        f"{seen['files'] or 'none'} of /tmp, /dev/shm, "
        f"{'reached' if seen['reached'] else 'could not reach'} its loopback listener; "
        f"its /proc lists {seen['pids'][:8]}",
    )


_OWN_MEMORY = r"""
import json, os, threading
code = next(int(l.split("-")[0], 16) for l in open("/proc/self/maps") if l.split()[1] == "r-xp")
out = {}
tids = []
done = threading.Event()
thread = threading.Thread(target=lambda: (tids.append(threading.get_native_id()), done.wait(10)))
thread.start()
while not tids:
    pass
paths = ["/proc/self/mem", "/proc/thread-self/mem", "/proc/%d/mem" % tids[0]]
for path in paths:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        out[path] = "refused: " + exc.strerror
        continue
    try:
        out[path] = "writable" if len(os.pread(fd, 16, code)) == 16 else "reads as /dev/null"
    except OSError as exc:
        out[path] = "refused: " + exc.strerror
    finally:
        os.close(fd)
done.set()
thread.join()
print(json.dumps(out))
"""


_INIT_STATE = r"""
import json, os
try:
    port = init_listener.getsockname()[1]
except OSError as exc:
    port = None
reached = False
if port:
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        reached = True
    except OSError:
        pass
print(json.dumps({"mark": init_mark, "file": os.path.exists("/tmp/init-file"), "reached": reached,
                  "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}))
"""


def _init_state(kernel: Kernel) -> Finding:
    """A fork has what its warm kernel's init left in memory (by design), and nothing
    of the warm kernel's own: not its workspace file, not its listener (the descriptor is
    /dev/null in the fork, its network namespace another), not its process."""
    seen = _probe(kernel, _INIT_STATE)
    if "error" in seen:
        return Finding("a fork has init's state, not its kernel", False, seen["error"])
    ok = seen["mark"] == "left by init" and not seen["file"] and not seen["reached"] and seen["pids"] == [1]
    return Finding(
        "a fork has init's state, not its kernel",
        ok,
        f"init's variable {'is' if seen['mark'] == 'left by init' else 'is NOT'} in the fork; the warm kernel's "
        f"workspace file is {'SEEN' if seen['file'] else 'not seen'}, its listener "
        f"{'REACHED' if seen['reached'] else 'not reachable'}; the fork's /proc lists {seen['pids'][:8]}",
    )


def _own_memory(kernel: Kernel) -> Finding:
    """A process may write its own code pages through its mem file (/proc/self/mem, and
    any thread's /proc/<tid>/mem): native code with no library. In a sandbox the mounts
    cover the first and the write lock (Landlock) refuses them all; in guard mode Landlock."""
    seen = _probe(kernel, _OWN_MEMORY)
    if "error" in seen:
        return Finding("own memory unwritable", False, seen["error"])
    open_ = {path: how for path, how in seen.items() if how == "writable"}
    return Finding("own memory unwritable", not open_, "; ".join(f"{p}: {how}" for p, how in seen.items()))


def _capabilities(kernel: Kernel) -> Finding:
    caps = kernel.report.get("caps", {})
    nonzero = {k: v for k, v in caps.items() if int(v or "0", 16)}
    seen = _probe(
        kernel,
        "import json\nprint(json.dumps({l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') "
        "if l.startswith('Cap')}))",
    )
    nonzero.update({k: v for k, v in seen.items() if k != "error" and int(v, 16)})
    return Finding(
        "capabilities zero",
        not nonzero and "error" not in seen,
        f"non-zero: {nonzero}" if nonzero else f"all five sets are 0 (uid {kernel.report.get('uid')})",
    )


_FILE_STATE = r"""
import errno, fcntl, json, os, socket
def attempt(call):
    try:
        call()
        return "allowed"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
own = os.path.join(os.getcwd(), "lease-probe")
open(own, "w").close()
fd = os.open(own, os.O_RDONLY)
folder = os.open(os.getcwd(), os.O_RDONLY)
out = {
    "lease": attempt(lambda: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)),
    "dnotify": attempt(lambda: fcntl.fcntl(folder, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)),
    "udp": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()),
    "raw": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()),
    "tcp": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()),
    "lock": attempt(lambda: fcntl.flock(fd, fcntl.LOCK_SH)),
}
os.close(fd)
os.close(folder)
os.unlink(own)
print(json.dumps(out))
"""


def _no_file_state(kernel: Kernel) -> Finding:
    """Nothing a kernel attaches to a file or folder reaches past it: a lease (a host
    process opening the file would wait for the kernel), a directory notification (every
    process's activity in the folder), a socket but TCP's (a datagram, in guard-only mode,
    could go anywhere). Tried on the kernel's own workspace file and folder, where nothing
    else would refuse them; an advisory lock there is allowed (sqlite needs them)."""
    seen = _probe(kernel, _FILE_STATE)
    if "error" in seen:
        return Finding("no leases, watches or datagrams", False, seen["error"])
    refused = ("lease", "dnotify", "udp", "raw")
    ok = all(seen[k] == "EPERM" for k in refused) and seen["tcp"] == "allowed" and seen["lock"] == "allowed"
    evidence = ", ".join(f"{k}: {seen[k]}" for k in (*refused, "tcp", "lock"))
    return Finding("no leases, watches or datagrams", ok, evidence + " (inotify: refused by the same filter)")


def _ctypes(kernel: Kernel) -> Finding:
    result = kernel.run("import ctypes\nctypes.CDLL(None)")
    ok = result.error is not None
    return Finding("ctypes blocked", ok, str(result.error) if result.error else "ctypes loaded a library")

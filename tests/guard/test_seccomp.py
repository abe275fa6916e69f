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

"""The kernel (:mod:`sequester.kernel.client`) as a code-cell runner, against real sandboxed processes."""

import time

import pytest

from sequester import Kernel, KernelClosedError, Limits, Policy
from sequester.errors import KernelError


@pytest.fixture(scope="module")
def kernel():
    with Kernel(Policy(limits=Limits(cell_timeout=10))) as k:
        yield k


def test_value_state_and_output(kernel):
    r = kernel.run("x = 1\nx + 1")
    assert (r.value, r.error, r.stdout) == ("2", None, "")
    r = kernel.run("print('out'); import sys; print('err', file=sys.stderr); x * 10")
    assert (r.stdout, r.stderr, r.value) == ("out\n", "err\n", "10")
    assert kernel.run("_").value == "10"  # the last value, as in a REPL


def test_no_value_for_statements_and_none(kernel):
    assert kernel.run("y = 5").value is None
    assert kernel.run("None").value is None


def test_error_has_type_message_and_traceback(kernel):
    r = kernel.run("def f():\n    return 1 / 0\nf()")
    assert r.error.type == "ZeroDivisionError" and r.error.message == "division by zero"
    assert 'File "<cell>", line 2, in f' in r.error.traceback
    assert "server.py" not in r.error.traceback  # the kernel's own frames are left out


def test_syntax_error_keeps_the_kernel_alive(kernel):
    kernel.run("keep = 42")
    r = kernel.run("def broken(:")
    assert r.error.type == "SyntaxError"
    # the program's line, nothing of the kernel's call into the compiler
    assert 'File "<cell>", line 1' in r.error.traceback and "def broken(:" in r.error.traceback
    assert "ast.py" not in r.error.traceback and "server.py" not in r.error.traceback
    assert kernel.run("keep").value == "42"


def test_output_written_below_python_arrives_in_order(kernel):
    r = kernel.run("import os\nprint('a', flush=True)\nos.write(1, b'b\\n')\nprint('c')")
    assert r.stdout == "a\nb\nc\n"


def test_large_output_is_not_lost(kernel):
    r = kernel.run("print('z' * 300_000)")
    assert r.stdout == "z" * 300_000 + "\n"


def test_cell_timeout_interrupts_and_keeps_state(kernel):
    kernel.run("survivor = 'still here'")
    started = time.monotonic()
    r = kernel.run("while True: pass", timeout=0.5)
    assert r.timed_out and r.error.type == "TimeoutError" and not r.restarted
    assert time.monotonic() - started < 3
    assert kernel.run("survivor").value == "'still here'"


def test_timeout_not_caught_by_except_exception(kernel):
    r = kernel.run("import time\ntry:\n    time.sleep(5)\nexcept Exception:\n    pass\n'caught'", timeout=0.3)
    assert r.timed_out and r.value is None


@pytest.mark.slow
def test_uninterruptible_cell_is_killed_and_the_kernel_restarted():
    with Kernel(Policy(limits=Limits(cell_timeout=10))) as k:
        k.run("lost = 1")
        started = time.monotonic()
        r = k.run("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(30)", timeout=0.5)
        assert r.timed_out and r.restarted and "restarted" in r.error.message
        assert time.monotonic() - started < 10
        assert k.run("lost").error.type == "NameError"  # fresh state
        assert k.run("1 + 1").value == "2"


def test_output_cap():
    with Kernel(Policy(limits=Limits(output_bytes=1000))) as k:
        r = k.run("for i in range(10_000): print(i)")
        assert r.error.type == "OutputLimitExceeded"
        assert len(r.stdout.encode()) <= 1000 and not r.restarted
        # Below Python's streams the host enforces it by killing the kernel.
        r = k.run("import os\nfor _ in range(100): os.write(1, b'x' * 10_000)")
        assert r.error.type == "OutputLimitExceeded" and r.restarted
        assert k.run("'alive'").value == "'alive'"


def test_memory_cap_gives_memory_error():
    with Kernel(Policy(limits=Limits(memory_mb=256))) as k:
        r = k.run("block = bytearray(512 * 1024 * 1024)")
        assert r.error.type == "MemoryError"
        assert k.run("len(bytearray(1024))").value == "1024"


@pytest.mark.slow
def test_thread_cap():
    with Kernel(Policy(limits=Limits(max_threads=4))) as k:
        r = k.run("import threading, time\nts = []\nfor i in range(20):\n"
                  "    t = threading.Thread(target=time.sleep, args=(2,)); t.start(); ts.append(t)")
        assert r.error is not None and "thread" in r.error.message
        # Once those end, threads work again.
        r = k.run("for t in ts: t.join()\nt = threading.Thread(target=print, args=('hi',)); t.start(); t.join()")
        assert r.stdout == "hi\n", r.error


def test_workspace_size_cap():
    with Kernel(Policy(limits=Limits(workspace_mb=2))) as k:
        r = k.run("open('big', 'wb').write(b'x' * 4 * 1024 * 1024)")
        assert r.error is not None and r.error.type in ("OSError", "MemoryError")
        assert "No space left" in r.error.message or "too large" in r.error.message.lower()


@pytest.mark.slow
def test_kernel_lifetime():
    with Kernel(Policy(limits=Limits(kernel_timeout=1.5, cell_timeout=10))) as k:
        assert k.run("1").value == "1"
        r = k.run("import time; time.sleep(5)")
        assert r.error.type == "KernelTimeout"
        with pytest.raises(KernelClosedError):
            k.run("1")


def test_kernel_death_is_reported_and_recovered():
    with Kernel() as k:
        # (Not a signal of its own: the kernel is its PID namespace's init, which the
        # kernel shields from its own namespace's SIGKILL.)
        r = k.run("import os; os._exit(3)")
        assert r.error.type == "KernelDied" and r.restarted and "status 3" in r.error.message, r.error
        assert k.run("2 * 21").value == "42"


def test_restart_and_close():
    k = Kernel().start()
    k.run("a = 1")
    k.restart()
    assert k.run("a").error.type == "NameError"
    k.close()
    k.close()  # idempotent
    with pytest.raises(KernelClosedError):
        k.run("1")
    with pytest.raises(KernelClosedError):
        k.start()


def test_unstarted_kernel():
    with pytest.raises(KernelClosedError):
        Kernel().run("1")
    with pytest.raises(KernelError):
        Kernel().mode


def test_streaming_callback(kernel):
    seen = []
    r = kernel.run("import sys\nprint('one')\nprint('two', file=sys.stderr)", on_output=lambda s, t: seen.append((s, t)))
    assert "".join(t for s, t in seen if s == "stdout") == "one\n"
    assert "".join(t for s, t in seen if s == "stderr") == "two\n"
    assert r.stdout == "one\n"


def test_bad_timeout(kernel):
    with pytest.raises(ValueError):
        kernel.run("1", timeout=0)


# -- frames are untrusted input too ---------------------------------------------------

HUGE_FRAME = (
    "import os, struct, sys\nfd = int(sys.argv[2])  # the kernel's protocol fd\n"
    "os.write(fd, struct.pack('!I', {size}))\nchunk = b'x' * (1 << 20)\n"
    "for _ in range({size} >> 20):\n    os.write(fd, chunk)\n"
)


def _peak_rss_growth(run) -> int:
    """Bytes the host's peak resident set grew by while ``run()`` ran."""
    def kib(key):
        return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = kib("VmRSS")
    run()
    return (kib("VmHWM") - before) * 1024


def test_an_oversized_frame_kills_the_kernel_and_host_memory_stays_bounded():
    size = 250_000_000  # also far over output_bytes: a way around the output cap
    with Kernel(Policy(limits=Limits(cell_timeout=30))) as k:
        k.run("lost = 1")
        results = []
        growth = _peak_rss_growth(lambda: results.append(k.run(HUGE_FRAME.format(size=size))))
        r = results[0]
        assert r.error.type == "KernelError" and r.restarted
        assert f"message of {size} bytes is over the" in r.error.message and "restarted" in r.error.message
        assert growth < 32 * 1024 * 1024, growth
        assert k.run("lost").error.type == "NameError" and k.run("1 + 1").value == "2"


def test_control_without_the_frame_cap_the_host_buffers_what_the_kernel_sends(monkeypatch):
    from sequester.kernel import client, protocol

    monkeypatch.setattr(client, "frame_limit", lambda output_bytes: protocol.MAX_MESSAGE)
    size = 100 * 1024 * 1024
    with Kernel(Policy(limits=Limits(cell_timeout=30))) as k:
        results = []
        growth = _peak_rss_growth(lambda: results.append(k.run(HUGE_FRAME.format(size=size))))
    assert results[0].error.type == "KernelError"  # not JSON, once all of it was read
    assert growth > size * 0.9, growth


def test_long_error_messages_are_clipped_not_fatal():
    with Kernel(Policy(limits=Limits(output_bytes=1000))) as k:
        r = k.run("raise ValueError('m' * 5_000_000)")
        assert r.error.type == "ValueError" and not r.restarted
        assert len(r.error.message) < 200_000 and r.error.message.endswith("more characters]")


def test_frame_limit_follows_output_bytes():
    from sequester.kernel.protocol import MAX_MESSAGE, TEXT_LIMIT, frame_limit

    assert frame_limit(1000) < 4 * 1024 * 1024
    assert frame_limit(10_000_000) - frame_limit(1000) == 10_000_000 - 1000
    assert frame_limit(10**12) == MAX_MESSAGE
    assert frame_limit(0) > 4 * 6 * TEXT_LIMIT  # room for every clipped field, fully escaped

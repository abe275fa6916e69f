"""The public API (:mod:`sequester`): the names it exports and its one tree of errors."""

import sequester


def test_exported_names():
    assert sorted(sequester.__all__) == [
        "Capabilities", "CellError", "CellResult", "Endpoint", "Environment", "Episode", "EpisodeSettings", "ExecResult", "Isolation", "Kernel",
        "KernelClosedError", "KernelError", "Limits", "Policy", "PolicyError", "SandboxError",
        "SandboxUnavailableError", "SequesterError", "Task", "TaskError", "VerifierError", "VerifierResult",
        "find_tasks", "load_agent", "load_policy", "load_task", "open_environment", "parse_endpoint",
    ]
    for name in sequester.__all__:
        assert getattr(sequester, name) is not None


def test_errors_form_one_tree():
    for name in ("PolicyError", "SandboxError", "SandboxUnavailableError", "KernelError", "KernelClosedError",
                 "TaskError", "VerifierError"):
        assert issubclass(getattr(sequester, name), sequester.SequesterError)
    assert issubclass(sequester.PolicyError, ValueError)


def test_kernel_process_imports_stay_light():
    """The kernel imports sequester.kernel.server; that must not pull in host machinery."""
    import subprocess
    import sys

    code = ("import sys, sequester.kernel.server\n"
            "heavy = [m for m in ('rich', 'asyncio', 'sequester.policy', 'sequester.kernel.client') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

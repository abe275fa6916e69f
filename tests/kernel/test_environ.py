"""A kernel's environment (:mod:`sequester.kernel.environ`, pure): an allowlist of the host's."""

from sequester.kernel.environ import kernel_environment


def test_environment_is_an_allowlist():
    host = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x", "HOME": "/root",
            "AWS_SECRET_ACCESS_KEY": "s", "OPENAI_API_KEY": "k", "HTTPS_PROXY": "http://corp:3128", "LD_PRELOAD": "/evil.so"}
    env = kernel_environment(host, passthrough=["OPENAI_API_KEY"], proxy=[("HTTPS_PROXY", "http://127.0.0.1:3128")],
                             tmpdir="/tmp")
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x", "OPENAI_API_KEY": "k",
                   "HTTPS_PROXY": "http://127.0.0.1:3128", "HOME": "", "TMPDIR": "/tmp"}
    guard = kernel_environment(host, passthrough=[], proxy=None, tmpdir="/w")
    assert guard["HTTPS_PROXY"] == "http://corp:3128" and "LD_PRELOAD" not in guard

"""The runner's environment variables. Pure.

Nothing of the agent's shell (``PYTHONPATH``, ``PYTEST_ADDOPTS``, ``LD_PRELOAD``,
``BASH_ENV``, ...): only the image's own variables (Dockerfile ``ENV``), the task's
``[verifier] env``, and the runner's. The tree's ``bin/`` comes first on ``PATH``; the
test script's shell gets a private ``HOME`` (the tree's wrappers give the agent's back
to the programs that run the tests); uv works offline from the pinned wheels, with the
tree's Pythons as its only ones and no configuration file of anyone's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sequester.verifier import layout
from sequester.verifier.pysite import PYTHONPATH_VAR, RUNNER_FD_VAR

__all__ = ["runner_env", "DEFAULT_PATH", "RUNNER_FD_VAR"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Variables by which the runner's own programs (the loader and C library, bash, Python and
# pytest, OpenSSL under curl and Python's ssl, curl, terminfo and readline) read code,
# configuration or trust from a path: the image's ENV points them into the view, which is
# the agent's to write (OPENSSL_CONF naming an agent's provider module; SSL_CERT_FILE a
# bundle the agent added its CA to, for an "astral.sh" it serves itself). The runner never
# takes them from the image; the task's own [verifier] env may still set them.
_RUNNER_INPUTS = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
    "GLIBC_TUNABLES",
    "GCONV_PATH",
    "LOCPATH",
    "NLSPATH",
    "BASH_ENV",
    "ENV",
    "INPUTRC",
    "TERMINFO",
    "TERMINFO_DIRS",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONPYCACHEPREFIX",
    "PYTEST_ADDOPTS",
    "PYTEST_PLUGINS",
    "OPENSSL_CONF",
    "OPENSSL_MODULES",
    "OPENSSL_ENGINES",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "SSLKEYLOGFILE",
    "CURL_CA_BUNDLE",
    "CURL_HOME",
    "XDG_CONFIG_HOME",
    "XDG_CONFIG_DIRS",
    "REQUESTS_CA_BUNDLE",
    "SEQUESTER_PIP_ENV",  # (the runner's own, for what it installs before the script runs)
    "MALLOC_CONF",  # jemalloc's (uv's allocator) options: abort_conf makes the runner's uv abort
    "_RJEM_MALLOC_CONF",
)


def runner_env(
    image_env: Mapping[str, str],
    task_env: Mapping[str, str],
    *,
    agent_home: str = "/root",
    runner_fd: int | None = None,
    find_links: Sequence[str] = (),
) -> dict[str, str]:
    """``find_links``: more wheel folders of the runner's for uv (a task's pinned wheels)."""
    env = {"HOME": agent_home, "LANG": "C.UTF-8", "TERM": "dumb"}
    env.update({k: v for k, v in image_env.items() if k not in _RUNNER_INPUTS})
    env.update(task_env)
    entries = [p for p in env.get("PATH", DEFAULT_PATH).split(":") if p and p != str(layout.BIN)]
    env["PATH"] = ":".join([str(layout.BIN), *entries])
    env["SEQUESTER_AGENT_HOME"] = env.pop("HOME")
    env["SHELL"] = str(layout.BIN / "bash")  # else bash looks the user up to find one
    env["HOME"] = str(layout.RUN_HOME)
    if "PYTHONPATH" in env:  # see pysite: the tree's Pythons put it back after start-up
        env[PYTHONPATH_VAR] = env.pop("PYTHONPATH")
    env.update(
        {
            "UV_OFFLINE": "1",
            "UV_NO_INDEX": "1",
            "UV_NO_CONFIG": "1",
            "UV_FIND_LINKS": ",".join([str(layout.WHEELS), *find_links]),  # uv's list is comma-separated
            "UV_CACHE_DIR": str(layout.SCRATCH_CACHE),  # (what is installed ahead: RUN_CACHE)
            "UV_TOOL_DIR": str(layout.SCRATCH_TOOLS),
            "UV_PYTHON_INSTALL_DIR": str(layout.PYTHONS),
            "UV_PYTHON_PREFERENCE": "only-managed",
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_NO_PROGRESS": "1",
        }
    )
    if runner_fd is not None:
        env[RUNNER_FD_VAR] = str(runner_fd)
        env["BASH_ENV"] = str(layout.ETC / "bash-env")  # (see shims: set-up failures told to the host)
    return env

"""The environment variables a kernel gets. Pure.

Only: ``PATH``, the locale (``LANG``, ``LANGUAGE``, ``LC_*``), ``PYTHONPATH``, the proxy
variables, the variables the policy names (API keys), ``HOME`` empty and ``TMPDIR``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["PROXY_VARIABLES", "kernel_environment"]

PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def kernel_environment(
    host: Mapping[str, str],
    *,
    passthrough: Sequence[str],
    proxy: Sequence[tuple[str, str]] | None,
    tmpdir: str,
) -> dict[str, str]:
    """Build the environment from the host's.

    ``proxy`` replaces the host's proxy variables (the sandbox's own proxy); ``None``
    keeps the host's (guard-only and off modes, where there is no in-sandbox proxy).
    """
    env: dict[str, str] = {"PATH": host.get("PATH", _DEFAULT_PATH)}
    for key, value in host.items():
        if key in ("LANG", "LANGUAGE", "PYTHONPATH") or key.startswith("LC_"):
            env[key] = value
    if proxy is None:
        env.update({k: host[k] for k in PROXY_VARIABLES if k in host})
    else:
        env.update(dict(proxy))
    for name in passthrough:
        if name in host:
            env[name] = host[name]
    env["HOME"] = ""
    env["TMPDIR"] = tmpdir
    return env

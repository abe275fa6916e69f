"""The user-mode network stack an episode's router is attached to: slirp4netns.

A field-standard stack (rootless Podman's and RootlessKit's; Debian's ``slirp4netns``
1.2.0) turns the router's outgoing packets into ordinary sockets of the host's, so the
agent's TCP, UDP and DNS reach the internet with no privilege on the host. Measured here
against pasta (Debian's ``passt``, 2023-03), the other field standard: slirp4netns is
ready in 9-12 ms, pasta in 40-57 ms (it sets up large tables before it returns), and a
reset may cost at most half again of one without network (about 45 ms here); both hold
their namespace, both are sandboxed by their own seccomp filter and mount namespace.
slirp4netns also dies with the host through ``--exit-fd``.

Its options: ``--disable-host-loopback`` (its gateway does not lead to the host's
loopback), ``--disable-dns`` (its DNS forwarder, which would reach the host's private
resolver, is off: the router's DNS responder answers), ``--enable-sandbox`` and
``--enable-seccomp`` (it confines itself), no ``--api-socket`` (nothing controls it once
started). It runs as :data:`STACK_HOST_ID` for a root caller (an id no other host process
has: not root, not ``nobody``), as the caller otherwise; it needs ``/dev/net/tun`` (an
ordinary user without access to it gets no network and a note).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

from sequester.net.episode.layout import MTU, STACK_CIDR, TAP_IFNAME

__all__ = ["STACK_HOST_ID", "TUN", "StackSupport", "stack_support", "slirp_argv", "tun_is_private"]

STACK_HOST_ID = 0x7FFF_0001  # a root caller's stack runs as this uid and gid (KERNEL_HOST_ID + 1)
TUN = "/dev/net/tun"


@dataclass(frozen=True)
class StackSupport:
    """Whether this machine can give an episode a network, and what with (or why not)."""

    binary: str | None
    version: str = ""
    reason: str | None = None  # why there is no network here

    @property
    def available(self) -> bool:
        return self.reason is None


def tun_is_private(path: str = TUN) -> bool:
    """The host's tun device is not open to everyone (Debian's is ``0666``; some hosts
    make it root's alone)."""
    try:
        return os.stat(path).st_mode & 0o006 != 0o006
    except OSError:
        return True


@functools.lru_cache(maxsize=1)
def stack_support() -> StackSupport:
    """Checked once per process: slirp4netns, its version, and the tun device for this caller."""
    binary = shutil.which("slirp4netns") or ("/usr/bin/slirp4netns" if os.path.exists("/usr/bin/slirp4netns") else None)
    if binary is None:
        return StackSupport(None, reason="slirp4netns is not installed (Debian: apt-get install slirp4netns)")
    try:
        said = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        version = said.splitlines()[0].strip() if said else "slirp4netns"
    except (OSError, subprocess.SubprocessError) as exc:
        return StackSupport(binary, reason=f"{binary} does not run: {exc}")
    if not os.path.exists(TUN):
        return StackSupport(binary, version, f"{TUN} does not exist (the tun module is not loaded)")
    if os.geteuid() != 0 and not os.access(TUN, os.R_OK | os.W_OK):
        return StackSupport(
            binary,
            version,
            f"{TUN} is not open to this user (mode {os.stat(TUN).st_mode & 0o777:04o}; Debian's is 0666: "
            f"'chmod 0666 {TUN}' as root)",
        )
    return StackSupport(binary, version)


def slirp_argv(binary: str, *, holder: int, ready: int, exit: int) -> list[str]:
    """slirp4netns for the router held by the process ``holder`` (in the router's user and
    network namespaces, the stack's own uid); it writes to its descriptor ``ready`` once
    configured and exits when ``exit`` reaches its end (the host closed it, or died)."""
    return [
        binary,
        "--configure",
        f"--mtu={MTU}",
        f"--cidr={STACK_CIDR}",
        "--disable-host-loopback",
        "--disable-dns",
        "--enable-sandbox",
        "--enable-seccomp",
        f"--ready-fd={ready}",
        f"--exit-fd={exit}",
        f"--userns-path=/proc/{holder}/ns/user",
        str(holder),
        TAP_IFNAME,
    ]

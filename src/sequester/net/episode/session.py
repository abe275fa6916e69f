"""An episode's network while it runs: the router namespace and its rules, the user-mode
stack attached to it, the link into the agent's namespace, the DNS responder and the
loopback relays; its phases (the agent's, the verifier's) and its record.

    net = EpisodeNetwork.start(nsexec, init_pid, policy)   # after the sandbox is up
    net.verifier_phase(); ...; net.agent_phase()            # around the verifier
    net.record()                                             # for the trial's result.json
    net.close()

Only made for a policy that has a network (:attr:`EpisodePolicy.has_network`): an episode
without one pays nothing. Everything privileged is done by the namespace helper
(:mod:`sequester.sandbox.nsexec.router`); this module holds descriptors and threads.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from sequester.errors import SandboxError
from sequester.net.addresses import LocalAddresses
from sequester.net.episode.answers import Answers
from sequester.net.episode.hostnet import read_host_networks
from sequester.net.episode.layout import (
    AGENT_ADDRESS,
    AGENT_IFNAME,
    DNS_ADDRESS,
    GATEWAY,
    LINK,
    MTU,
    ROUTER_IFNAME,
    resolv_conf,
)
from sequester.net.episode.policy import EpisodePolicy
from sequester.net.episode.records import traffic_record
from sequester.net.episode.relay import LoopbackRelay
from sequester.net.episode.responder import DnsResponder
from sequester.net.episode.ruleset import (
    Grant,
    agent_phase_commands,
    grant_commands,
    list_records_command,
    ruleset,
    verifier_phase_commands,
)
from sequester.net.episode.stack import STACK_HOST_ID, slirp_argv, stack_support, tun_is_private
from sequester.net.episode.upstream import Upstream
from sequester.sandbox.nsexec.client import NsExec, Router
from sequester.sandbox.readiness import readable

__all__ = ["EpisodeNetwork", "Preparing", "network_unavailable", "stack_host_id"]

log = logging.getLogger("sequester.net.episode")

_STACK_READY_SECONDS = 10.0
_STDERR_LIMIT = 4096


def network_unavailable() -> str | None:
    """Why this machine can give no episode a network, or None."""
    return stack_support().reason


class EpisodeNetwork:
    """One episode's network (see the module's doc)."""

    def __init__(self, nsexec: NsExec, policy: EpisodePolicy, router: Router, stack: tuple[int, int, int]):
        self.nsexec, self.policy, self.router = nsexec, policy, router
        self.stack_pid, self._exit_w, self._stack_err = stack
        self.responder: DnsResponder | None = None
        self.relay: LoopbackRelay | None = None
        self.in_agent_phase = True
        self._closed = False
        self._last_record: dict[str, Any] | None = None
        self._refused: list[ipaddress.IPv4Network] = []

    @classmethod
    def prepare(cls, nsexec: NsExec, policy: EpisodePolicy, *, target: int | None = None) -> EpisodeNetwork:
        """The router namespace with its rules, and the stack attached to it; not linked to
        any episode yet. ``target`` (the episode's init) is needed only when the router is
        made in the episode's user namespace (:func:`stack_host_id` is None); else this can
        run while the sandbox starts."""
        support = stack_support()
        if not support.available:
            raise SandboxError(f"the episode's network cannot be made here: {support.reason}")
        assert support.binary is not None
        stack_id = stack_host_id()
        if stack_id is None and target is None:
            raise ValueError("an ordinary user's router needs the episode's init")
        refused = read_host_networks().refused()
        router = nsexec.net_router(
            {"ruleset": ruleset(policy, refused), "dns": str(DNS_ADDRESS), "stack_id": stack_id},
            target=target,
        )
        try:
            net = cls(nsexec, policy, router, _start_stack(nsexec, support.binary, router, stack_id=stack_id))
        except BaseException:
            router.close()
            raise
        # The stack has joined the router's namespaces (it joins them through the holder's
        # pid, and only while it starts): the holder may go.
        router.release_holder()
        net._refused = refused
        return net

    def link(self, target: int, *, upstream: Upstream | None = None, write_resolv_conf: bool = True) -> None:
        """Link the prepared router to the episode whose init is ``target`` (its sandbox up,
        its network namespace holding only ``lo``), and serve its DNS and relays. On failure
        everything of the network is closed."""
        policy, router = self.policy, self.router
        try:
            relays = [("127.0.0.1", int(r.port or 0)) for r in policy.relayed]
            self.nsexec.net_link(
                target,
                router,
                {
                    "router": {
                        "ifname": ROUTER_IFNAME,
                        "addresses": [f"{GATEWAY}/{LINK.prefixlen}", f"{DNS_ADDRESS}/{LINK.prefixlen}"],
                        "mtu": MTU,
                    },
                    "agent": {
                        "ifname": AGENT_IFNAME,
                        "address": f"{AGENT_ADDRESS}/{LINK.prefixlen}",
                        "mtu": MTU,
                        "gateway": str(GATEWAY),
                    },
                    "relays": relays,
                    "resolv_conf": resolv_conf() if write_resolv_conf else None,
                },
            )
            answers = Answers(policy, local=LocalAddresses(), host_networks=self._refused)
            self.responder = DnsResponder(
                router.dns[0], router.dns[1], answers, upstream or Upstream(), self._grant
            ).start()
            router.dns = []  # the responder owns them now
            self.relay = LoopbackRelay(
                [(sock, address, port) for sock, (address, port) in zip(router.relays, relays, strict=True)]
            ).start()
            router.relays = []
        except BaseException:
            self.close()
            raise

    @classmethod
    def start(
        cls,
        nsexec: NsExec,
        target: int,
        policy: EpisodePolicy,
        *,
        upstream: Upstream | None = None,
        write_resolv_conf: bool = True,
    ) -> EpisodeNetwork:
        """:meth:`prepare` and :meth:`link` for the episode whose init is ``target``."""
        net = cls.prepare(nsexec, policy, target=target)
        net.link(target, upstream=upstream, write_resolv_conf=write_resolv_conf)
        return net

    # -- while it runs -------------------------------------------------------------------

    def _grant(self, grants: Sequence[Grant]) -> None:
        commands = grant_commands(grants)
        self.nsexec.net_nft(self.router, [c for c, _ in commands], tolerate=[t for _, t in commands])

    def verifier_phase(self) -> None:
        """The operator's hosts withdrawn (the verifier never gets them): rules, DNS, relays."""
        if not self.in_agent_phase or self._closed:
            return
        self.in_agent_phase = False
        if self.responder is not None:
            self.responder.answers.agent_phase = False
        if self.relay is not None:
            self.relay.set_agent_phase(False)
        commands = verifier_phase_commands(self.policy)
        if commands:
            self.nsexec.net_nft(self.router, commands)

    def agent_phase(self) -> None:
        """Back to the agent's phase (the agent goes on after an evaluation)."""
        if self.in_agent_phase or self._closed:
            return
        commands = agent_phase_commands(self.policy)
        if commands:
            self.nsexec.net_nft(self.router, commands)
        if self.responder is not None:
            self.responder.answers.agent_phase = True
        if self.relay is not None:
            self.relay.set_agent_phase(True)
        self.in_agent_phase = True

    def record(self) -> dict[str, Any]:
        """What the network was and did, for the trial's record (bounded)."""
        if self._closed:
            return self._last_record or {**self.policy.to_record()}
        try:
            listing = self.nsexec.net_nft(self.router, [list_records_command()], json=True)[0]
        except SandboxError as exc:
            listing = ""
            log.warning("the episode's network counters could not be read: %s", exc)
        names = self.responder.names if self.responder is not None else {}
        found: dict[str, Any] = {**self.policy.to_record(), "traffic": traffic_record(listing, dict(names))}
        if self.responder is not None:
            found["dns"] = self.responder.record()
        if self.relay is not None and self.relay.listeners:
            found["relays"] = self.relay.record()
        self._last_record = found
        return found

    def close(self) -> None:
        """Stop everything of it (idempotent): the stack, the router's namespaces, the threads."""
        if self._closed:
            return
        try:
            self.record()
        except Exception:  # noqa: BLE001 - the record is for information
            pass
        self._closed = True
        for part in (self.responder, self.relay):
            if part is not None:
                part.close()
        for fd in (self._exit_w, self._stack_err):  # slirp4netns exits when its exit-fd ends
            if fd >= 0:
                os.close(fd)
        self._exit_w = self._stack_err = -1
        try:
            os.kill(self.stack_pid, signal.SIGKILL)
        except OSError:
            pass
        self.router.close()  # the namespaces go with their last descriptor (and the stack)


class Preparing:
    """:meth:`EpisodeNetwork.prepare` in a thread of its own, while the sandbox starts (a
    root caller's router needs nothing of the episode): :meth:`result` or :meth:`discard`."""

    def __init__(self, nsexec: NsExec, policy: EpisodePolicy):
        self._net: EpisodeNetwork | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(nsexec, policy), name="sequester-net", daemon=True)
        self._thread.start()

    def _run(self, nsexec: NsExec, policy: EpisodePolicy) -> None:
        try:
            self._net = EpisodeNetwork.prepare(nsexec, policy)
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            self._error = exc

    def result(self) -> EpisodeNetwork:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._net is not None
        return self._net

    def discard(self) -> None:
        self._thread.join()
        if self._net is not None:
            self._net.close()


def stack_host_id() -> int | None:
    """The host id the stack runs as: :data:`STACK_HOST_ID` for a root caller of the host
    (the id is mapped in this process's user namespace), else None (the caller itself; the
    router is then made in the episode's user namespace)."""
    if os.geteuid() != 0:
        return None
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _outside, count = (int(x) for x in line.split())
                if inside <= STACK_HOST_ID < inside + count:
                    return STACK_HOST_ID
    except (OSError, ValueError):
        pass
    return None


def _start_stack(nsexec: NsExec, binary: str, router: Router, *, stack_id: int | None) -> tuple[int, int, int]:
    """slirp4netns attached to ``router``, configured (its ready descriptor said so): its
    pid, the write end of its exit descriptor and the read end of its standard error (a
    pipe it writes without blocking: what does not fit is lost, never waited for)."""
    ready_r, ready_w = os.pipe()
    exit_r, exit_w = os.pipe()
    err_r, err_w = os.pipe()
    for fd in (ready_r, exit_w, err_r):
        os.set_inheritable(fd, False)
    os.set_blocking(err_w, False)
    try:
        argv = slirp_argv(binary, holder=router.holder, ready=3, exit=4)
        pid = nsexec.net_stack(
            argv,
            uid=stack_id,
            private_tun=stack_id is not None and tun_is_private(),
            stderr=err_w,
            fds=[ready_w, exit_r],
        )
        os.close(ready_w)
        os.close(exit_r)
        os.close(err_w)
        ready_w = exit_r = err_w = -1
        if not readable(ready_r, _STACK_READY_SECONDS) or os.read(ready_r, 1) != b"1":
            said = b""
            if readable(err_r, 0.2):
                said = os.read(err_r, _STDERR_LIMIT)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            raise SandboxError(
                "the episode's network stack (slirp4netns) did not come up"
                + (f": {said.decode(errors='replace').strip()}" if said else "")
            )
        return pid, exit_w, err_r
    except BaseException:
        for fd in (exit_w, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (ready_r, ready_w, exit_r, err_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

"""The namespace helper's network operations (see :mod:`.server`): an episode's router
namespace, linked to the agent's network namespace, its rules, and the user-mode stack
attached to it.

* ``net_router``: make the router namespace, owned by a user namespace the agent has no
  capability in: for a root caller, a user namespace of the stack's own host id (so the
  stack, which runs as that id, can join it; no other process has that id), made before
  the episode's sandbox is; for an ordinary user, the episode's outer user namespace
  (bwrap's, whose child the agent is in). A process of the stack's uid holds it while the
  stack starts (slirp4netns joins the namespaces of a pid), until the host closes its
  lifeline once the stack is up (the host's descriptors then keep the namespaces; the
  holder no longer costs a process per episode). In it: forwarding, the nftables
  ruleset (through libnftables), the DNS responder's sockets. Its user and network
  namespaces and the sockets go back to the host over a socket (``SCM_RIGHTS``): the host
  holds the router; nothing of it is in the agent's reach.
* ``net_link``: a veth pair from the router to the agent's namespace, addresses and the
  agent's route, the relays' listening sockets in the agent's namespace, and its
  ``/etc/resolv.conf``.
* ``net_nft``: nftables commands in the router (grants from DNS answers, phase changes,
  the counters at the end).
* ``net_stack``: exec the user-mode stack (argv from the host) as the stack's id, with a
  private ``/dev/net/tun`` node it may open when the host's is root's alone (a root caller
  may make one; an ordinary user gets no network and a note instead).
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import stat
from typing import Any

from sequester.sandbox.nsexec.nftables import run_commands
from sequester.sandbox.nsexec.ns import (
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWUSER,
    MS_PRIVATE,
    MS_REC,
    PR_SET_PDEATHSIG,
    check,
    enter,
    libc,
    report,
)
from sequester.sandbox.nsexec.rtnetlink import Rtnetlink

__all__ = ["op_net_router", "op_net_link", "op_net_nft", "op_net_stack"]

_NS_GET_USERNS = 0xB701
_PR_SET_DUMPABLE = 4
_MS_NOSUID, _MS_NOEXEC = 2, 8
_TUN = os.makedev(10, 200)
_IP_FREEBIND = 15


def _setns(fd: int, flag: int, what: str) -> None:
    check(libc.setns(fd, flag), f"setns({what})")


def _hold(lifeline: int) -> None:  # pragma: no cover - a forked child's last act
    """The rest of a holder's life: nothing but its lifeline open, readable through
    ``/proc/PID/ns`` by its own uid (the stack attaches to it), until the host closes or
    loses the lifeline's other end."""
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid or namespace change made it root's to read
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd > 2 and fd != lifeline:
                try:
                    os.close(fd)
                except OSError:
                    pass
        while os.read(lifeline, 64):
            pass
    finally:
        os._exit(0)


def _stack_namespaces(stack_id: int, lifeline: int) -> tuple[int, int, int]:
    """A user namespace owned by ``stack_id`` (which maps it to 0) and a network namespace
    it owns, made and held by a child that becomes ``stack_id`` (see :func:`_hold`):
    the namespaces as open descriptors, and the holder's pid."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipes
        try:
            os.close(ready_r)
            os.close(go_w)
            os.setgroups([])
            os.setresgid(stack_id, stack_id, stack_id)
            os.setresuid(stack_id, stack_id, stack_id)
            libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # so that its parent may write its maps
            check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(user, net)")
            os.write(ready_w, b"r")
            if os.read(go_r, 1) != b"g":
                os._exit(1)
        except BaseException:  # noqa: BLE001 - the parent sees no "r"
            os._exit(1)
        _hold(lifeline)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) != b"r":
            raise OSError(errno.ECHILD, "the router's namespaces could not be made")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child}/{name}", "w") as f:
                f.write(f"0 {stack_id} 1\n")
        user = os.open(f"/proc/{child}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        net = os.open(f"/proc/{child}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        os.write(go_w, b"g")
        return user, net, child
    except BaseException:
        os.kill(child, signal.SIGKILL)
        raise
    finally:
        os.close(go_w)
        os.close(ready_r)


def _resolv_conf_writer(target: int, text: str) -> int:
    """A child that writes ``/etc/resolv.conf`` in the agent's view, as the agent's root,
    replacing a link or whatever else is there (an image's link into ``/run``); its pid
    (see :func:`_reap`)."""
    child = os.fork()
    if child == 0:  # pragma: no cover - its status is the report
        code = 1
        try:
            enter(target, user="agent", pid=False, cgroup=None)
            path = "/etc/resolv.conf"
            if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
            os.makedirs("/etc", exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, text.encode())
                os.fchmod(fd, 0o644)
            finally:
                os.close(fd)
            code = 0
        finally:
            os._exit(code)
    return child


def _reap(child: int, what: str) -> None:
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(errno.EIO, f"could not {what}")


def _listen(address: str, port: int, kind: int, *, freebind: bool = False) -> socket.socket:
    """``freebind``: the address need not be on a link yet (the router's DNS address comes
    with the link, after the sockets)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, kind | socket.SOCK_CLOEXEC)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if freebind:
        sock.setsockopt(socket.SOL_IP, _IP_FREEBIND, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((address, port))
    if kind == socket.SOCK_STREAM:
        sock.listen(64)
    return sock


def op_net_router(req: dict[str, Any], fds: list[int]) -> None:
    """The router namespace, its rules and the DNS responder's sockets (no link yet):
    ``fds[1]`` the socket the descriptors go back on, ``fds[2]`` the holder's lifeline."""
    result, channel, lifeline = fds[0], fds[1], fds[2]
    if req.get("stack_id") is not None:  # a root caller: the router's own user namespace
        user, net, holder = _stack_namespaces(int(req["stack_id"]), lifeline)
        _setns(net, CLONE_NEWNET, "router net")
    else:  # an ordinary user: the user namespace that owns the agent's network namespace
        agent_net = os.open(f"/proc/{req['target']}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        user = fcntl.ioctl(agent_net, _NS_GET_USERNS)
        _setns(user, CLONE_NEWUSER, "episode user")
        check(libc.unshare(CLONE_NEWNET), "unshare(net)")
        net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        holder = os.fork()
        if holder == 0:  # pragma: no cover
            _hold(lifeline)
    os.close(lifeline)
    with Rtnetlink() as rt:
        rt.set_up("lo")
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:  # this namespace's (procfs shows the caller's)
        f.write("1")
    run_commands([req["ruleset"]])
    dns = [_listen(req["dns"], 53, kind, freebind=True) for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM)]
    socket.send_fds(socket.socket(fileno=channel), [b"+"], [user, net, *(s.fileno() for s in dns)])
    report(result, {"holder": holder})


def op_net_link(req: dict[str, Any], fds: list[int]) -> None:
    """The router (``fds[2]`` its user namespace, ``fds[3]`` its network one) linked to the
    agent's network namespace (of ``target``): the veth pair, addresses, the agent's
    route, the relays' sockets (back on ``fds[1]``), and the agent's resolv.conf."""
    result, channel, user, net = fds[:4]
    target = req["target"]
    writer = _resolv_conf_writer(target, req["resolv_conf"]) if req.get("resolv_conf") is not None else None
    agent_net = os.open(f"/proc/{target}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    router, agent = req["router"], req["agent"]
    if os.geteuid() != 0:
        _setns(user, CLONE_NEWUSER, "router user")  # the episode's: it owns both namespaces
    _setns(net, CLONE_NEWNET, "router net")
    with Rtnetlink() as rt:
        rt.add_veth(router["ifname"], agent["ifname"], agent_net, mtu=router["mtu"])
        for address in router["addresses"]:
            rt.add_address(router["ifname"], address)
        rt.set_up(router["ifname"])
    _setns(agent_net, CLONE_NEWNET, "agent net")
    with Rtnetlink() as rt:
        rt.add_address(agent["ifname"], agent["address"])
        rt.set_up(agent["ifname"], mtu=agent["mtu"])
        rt.add_default_route(agent["gateway"], agent["ifname"])
    relays = [_listen(address, int(port), socket.SOCK_STREAM) for address, port in req.get("relays", [])]
    if writer is not None:
        _reap(writer, "write the agent's /etc/resolv.conf")
    socket.send_fds(socket.socket(fileno=channel), [b"+"], [s.fileno() for s in relays])
    report(result, {"relays": len(relays)})


def op_net_nft(req: dict[str, Any], fds: list[int]) -> None:
    """Commands in the router: ``fds[1]`` its user namespace, ``fds[2]`` its network one."""
    result, user, net = fds[:3]
    if os.geteuid() != 0:
        _setns(user, CLONE_NEWUSER, "router user")
    _setns(net, CLONE_NEWNET, "router net")
    tolerate = req.get("tolerate", False)
    outputs = run_commands(
        list(req["commands"]),
        json=bool(req.get("json")),
        tolerate=[bool(x) for x in tolerate] if isinstance(tolerate, list) else bool(tolerate),
    )
    report(result, {"outputs": outputs})


def op_net_stack(req: dict[str, Any], fds: list[int]) -> None:
    """Become the stack: ``fds[1]`` its standard error, ``fds[2:]`` its descriptors 3, 4,
    ...; ``uid`` (a root caller's stack id) to drop to, with a private tun node when the
    host's is root's alone (``private_tun``)."""
    result = fcntl.fcntl(fds[0], fcntl.F_DUPFD_CLOEXEC, 100)  # out of the way of 0, 1, 2, 3, ...
    os.close(fds[0])
    stderr, passed = fds[1], fds[2:]
    uid = req.get("uid")
    if req.get("private_tun") and uid is not None:
        check(libc.unshare(CLONE_NEWNS), "unshare(mount)")
        check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        check(libc.mount(b"tmpfs", b"/dev/net", b"tmpfs", _MS_NOSUID | _MS_NOEXEC, b"mode=0755"), "mount /dev/net")
        os.mknod("/dev/net/tun", 0o600 | stat.S_IFCHR, _TUN)
        os.chown("/dev/net/tun", int(uid), int(uid))
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (stderr, *passed)]
    for fd in (stderr, *passed):
        os.close(fd)
    opened = os.open("/dev/null", os.O_RDWR)
    null = fcntl.fcntl(opened, fcntl.F_DUPFD, 100)  # (a low number would be a target below)
    os.close(opened)
    for number, fd in [(0, null), (1, null), (2, moved[0]), *enumerate(moved[1:], start=3)]:
        os.dup2(fd, number)  # inheritable: the stack's own descriptors
    for fd in (null, *moved):
        os.close(fd)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")  # a uid change clears it
    report(result, {"pid": os.getpid()})
    os.close(result)
    os.execv(req["argv"][0], req["argv"])

"""The few rtnetlink requests an episode's network needs, sent by the namespace helper in
the network namespace it is in: a veth pair (one end in another namespace), addresses,
links up, a default route. No ``ip`` command is run (a fork and exec each, and a program
the host may lack); each request waits for the kernel's acknowledgement and raises its
error (:class:`OSError` with the errno)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct

__all__ = ["Rtnetlink"]

_RTM_NEWLINK, _RTM_NEWADDR, _RTM_NEWROUTE = 16, 20, 24
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_NLMSG_ERROR = 2
_IFLA_IFNAME, _IFLA_MTU, _IFLA_LINKINFO, _IFLA_NET_NS_FD = 3, 4, 18, 28
_IFLA_INFO_KIND, _IFLA_INFO_DATA, _VETH_INFO_PEER = 1, 2, 1
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_RTA_OIF, _RTA_GATEWAY = 4, 5
_NLA_F_NESTED = 0x8000
_IFF_UP = 0x1
_RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE, _RTN_UNICAST = 254, 3, 0, 1
_IFINFOMSG = struct.Struct("=BxHiII")


def _attr(kind: int, data: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(data), kind) + data
    return raw + b"\0" * (-len(raw) % 4)


def _name(text: str) -> bytes:
    return text.encode() + b"\0"


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, flags, change)


class Rtnetlink:
    """A NETLINK_ROUTE socket of the current network namespace (closed with ``with``)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        self._sock.bind((0, 0))
        self._seq = 0

    def __enter__(self) -> Rtnetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def _request(self, kind: int, flags: int, payload: bytes, what: str) -> None:
        self._seq += 1
        header = struct.pack("=IHHII", 16 + len(payload), kind, flags | _NLM_F_REQUEST | _NLM_F_ACK, self._seq, 0)
        self._sock.send(header + payload)
        while True:
            data = self._sock.recv(65536)
            offset = 0
            while offset + 16 <= len(data):
                length, mtype, _flags, seq, _pid = struct.unpack_from("=IHHII", data, offset)
                if length < 16:
                    raise OSError(errno.EPROTO, f"{what}: a malformed netlink answer")
                if mtype == _NLMSG_ERROR and seq == self._seq:
                    code = struct.unpack_from("=i", data, offset + 16)[0]
                    if code:
                        raise OSError(-code, f"{what}: {os.strerror(-code)}")
                    return
                offset += (length + 3) & ~3

    def add_veth(self, name: str, peer: str, peer_netns: int, *, mtu: int) -> None:
        """``name`` here and ``peer`` in the network namespace of the descriptor ``peer_netns``."""
        peer_info = _ifinfo() + _attr(_IFLA_IFNAME, _name(peer)) + _attr(_IFLA_MTU, struct.pack("=I", mtu))
        peer_info += _attr(_IFLA_NET_NS_FD, struct.pack("=I", peer_netns))
        info = _attr(_IFLA_INFO_KIND, b"veth\0")
        info += _attr(_IFLA_INFO_DATA | _NLA_F_NESTED, _attr(_VETH_INFO_PEER | _NLA_F_NESTED, peer_info))
        payload = _ifinfo() + _attr(_IFLA_IFNAME, _name(name)) + _attr(_IFLA_MTU, struct.pack("=I", mtu))
        payload += _attr(_IFLA_LINKINFO | _NLA_F_NESTED, info)
        self._request(_RTM_NEWLINK, _NLM_F_CREATE | _NLM_F_EXCL, payload, f"add veth {name}/{peer}")

    def set_up(self, name: str, *, mtu: int | None = None) -> None:
        payload = _ifinfo(socket.if_nametoindex(name), _IFF_UP, _IFF_UP)
        if mtu is not None:
            payload += _attr(_IFLA_MTU, struct.pack("=I", mtu))
        self._request(_RTM_NEWLINK, 0, payload, f"bring {name} up")

    def add_address(self, name: str, interface: str) -> None:
        """``interface`` (``10.0.2.2/24``) on the link ``name``."""
        iface = ipaddress.ip_interface(interface)
        family = socket.AF_INET if iface.version == 4 else socket.AF_INET6
        payload = struct.pack(
            "=BBBBI", family, iface.network.prefixlen, 0, _RT_SCOPE_UNIVERSE, socket.if_nametoindex(name)
        )
        payload += _attr(_IFA_LOCAL, iface.ip.packed) + _attr(_IFA_ADDRESS, iface.ip.packed)
        self._request(_RTM_NEWADDR, _NLM_F_CREATE | _NLM_F_EXCL, payload, f"add {interface} to {name}")

    def add_default_route(self, gateway: str, name: str) -> None:
        address = ipaddress.ip_address(gateway)
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        payload = struct.pack(
            "=BBBBBBBBI", family, 0, 0, 0, _RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE, _RTN_UNICAST, 0
        )
        payload += _attr(_RTA_GATEWAY, address.packed) + _attr(_RTA_OIF, struct.pack("=I", socket.if_nametoindex(name)))
        self._request(_RTM_NEWROUTE, _NLM_F_CREATE | _NLM_F_EXCL, payload, f"default route via {gateway}")

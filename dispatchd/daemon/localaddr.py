"""Whether an address is this machine's own, as the kernel routes it.

Guarantee: ``is_local`` is True for every address a connect from the
daemon would deliver to this machine itself: an address of any of its
interfaces (eth0's, a bridge's such as docker0's or virbr0's, a VPN's), and
any address of a range routed to it (``ip route add local 10.0.0.0/8 dev
lo``), besides loopback; and True too when the kernel cannot be asked (fail
closed). The services there are the ones listening on 127.0.0.1's neighbour,
0.0.0.0: the domains proxy treats them as it treats loopback
(daemon/proxy.py).

One route lookup (``RTM_GETROUTE``, as ``ip route get ADDRESS``) on a
netlink socket of its own, rather than a ``bind`` to the address (which
``net.ipv4.ip_nonlocal_bind`` lets succeed for any address) or a list of the
interfaces' addresses (which misses a range routed locally): the kernel's own
answer for the address, about 30 µs.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

RTM_GETROUTE = 26
RTM_NEWROUTE = 24
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
RTA_DST = 1
RTN_LOCAL = 2
RTN_BROADCAST = 3
RTN_ANYCAST = 4
_NO_ROUTE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EACCES, errno.EINVAL})
_NLMSGHDR = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")


def is_local(address: str) -> bool:
    """Whether the kernel routes ``address`` (an IPv4 or IPv6 address in any
    form ``ipaddress`` reads; an IPv4-mapped one as its IPv4 address) to
    this machine itself. An address the kernel has no route to (a connect
    fails: ENETUNREACH, a prohibit route) is not; one that is not an
    address, or a lookup that cannot be made, is (nothing relayed on a
    guess)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    dst = ip.packed
    attr = struct.pack("=HH", 4 + len(dst), RTA_DST) + dst
    body = _RTMSG.pack(family, ip.max_prefixlen, 0, 0, 0, 0, 0, 0, 0) + attr
    seq = 1
    request = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_GETROUTE, NLM_F_REQUEST, seq, 0) + body
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE) as nl:
            nl.settimeout(1.0)
            nl.sendto(request, (0, 0))
            while True:
                reply = nl.recv(65536)
                if len(reply) < _NLMSGHDR.size + _RTMSG.size:
                    return True
                _, kind, _, got_seq, _ = _NLMSGHDR.unpack_from(reply)
                if got_seq == seq:
                    break
    except OSError:
        return True
    if kind == NLMSG_ERROR:
        return _verdict(kind, -struct.unpack_from("=i", reply, _NLMSGHDR.size)[0], 0)
    return _verdict(kind, 0, _RTMSG.unpack_from(reply, _NLMSGHDR.size)[7])


def _verdict(kind: int, error: int, route_type: int) -> bool:
    """``is_local``'s answer from the kernel's reply: an error (``error``,
    an errno) is not local only where no route leads anywhere (unreachable,
    prohibited, a blackhole: a connect fails the same way), any other is;
    a route is local when the kernel delivers it here (local, and an
    anycast address the host joined, as a router of its prefix does)."""
    if kind == NLMSG_ERROR:
        return error not in _NO_ROUTE
    return kind != RTM_NEWROUTE or route_type in (RTN_LOCAL, RTN_BROADCAST, RTN_ANYCAST)

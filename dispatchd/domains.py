"""Network ``domains``: the rules a session's filtering proxy applies, as data.

Everything here is pure (tested by equality in ``tests/unit/test_domains.py``):
- ``parse_domains`` turns the list a caller or a policy gives (``pypi.org``,
  ``*.pythonhosted.org``, ``registry.example:8443``, ``203.0.113.7``) into
  ``Rule``s, refusing what would be ambiguous or unsafe with a message;
- ``normalise_host`` is the one spelling of a host name both a rule and a
  request are compared in (lower case, no trailing dot, punycode, canonical IP);
  what it returns is only ever a name of ``[a-z0-9_.-]`` or an address in
  its canonical form (hex digits, ``:`` and ``.``): the proxy's log lines,
  ``status``'s ``denied`` and the command it suggests quote nothing else. An
  IPv6 zone (``fe80::1%eth0``, where ``ipaddress`` keeps whatever follows
  the ``%``) is refused;
- ``allowed`` decides a request (host, port) against the rules;
- ``relayable`` decides whether the proxy may connect to a resolved address
  (never the host's loopback, link-local, unspecified or multicast; the
  machine's own other addresses are the proxy's to refuse, at each connect:
  ``daemon/localaddr.py``);
- ``parse_port`` reads a port as written in a list or a request: 1-65535 in
  ASCII digits, never what ``str.isdigit`` also takes;
- ``proxy_env`` is what every command of a ``domains`` session gets, so pip,
  npm, git and curl use the proxy without being told.

The proxy itself runs in the daemon (``dispatchd.daemon.proxy``); the session's
own network namespace has only loopback, so the proxy is its only way out.
"""

from __future__ import annotations

import ipaddress
import re

import msgspec


PROXY_HOST = "127.0.0.1"  # inside the session's namespace: its own loopback
PROXY_PORT = 3128  # the listener the worker makes there and hands to the daemon
DEFAULT_PORTS = (80, 443)  # a rule without ":port" allows these
MAX_RULES = 256
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


class Rule(msgspec.Struct, frozen=True):
    """One allowed destination. ``host`` is normalised; with ``wildcard`` it
    matches subdomains of ``host`` only, never ``host`` itself."""

    host: str
    wildcard: bool = False
    ports: tuple[int, ...] = DEFAULT_PORTS
    ip: bool = False  # an IP literal: matches exactly that address, written in any form

    def spelled(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        text = ("*." if self.wildcard else "") + host
        return text if self.ports == DEFAULT_PORTS else f"{text}:{self.ports[0]}"


class BadHost(ValueError):
    """A host name or rule that is not one: the message says which and why."""


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_ip_literal(host: str) -> bool:
    return _ip(host) is not None


def normalise_host(host: str) -> str:
    """The comparable spelling of ``host``: lower case, without a trailing dot,
    IDNA (punycode) for non-ASCII names, an IP literal in its canonical form
    (brackets removed). Raises ``BadHost`` for anything that is not a DNS name
    or an IP address, including numeric forms ``inet_aton`` would read as an
    address (``127.1``, ``0x7f.1``, ``2130706433``): a name is never an address
    in disguise; and an IPv6 address with a zone (``%`` and an interface)."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
        ip = _ip(h)
        if ip is None or ip.version != 6:
            raise BadHost(f"{host!r} is not an IPv6 address")
        return _unzoned(ip)
    ip = _ip(h)
    if ip is not None:
        canonical = _unzoned(ip)
        return str(ip.ipv4_mapped) if ip.version == 6 and ip.ipv4_mapped else canonical
    h = h.rstrip(".") if h.endswith(".") and not h.endswith("..") else h
    try:
        h = h.encode("ascii").decode().lower() if h.isascii() else h.encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise BadHost(f"{host!r} is not a valid international domain name ({exc})") from None
    labels = h.split(".")
    if not h or len(h) > 253 or not all(_LABEL.match(label) for label in labels):
        raise BadHost(f"{host!r} is not a host name (letters, digits, '-' between dots; at most 253 characters)")
    if labels[-1].isdigit() or re.fullmatch(r"0x[0-9a-f]*", labels[-1]):
        # No top-level domain is numeric; libc would read "127.1" as 127.0.0.1.
        raise BadHost(f"{host!r} looks like a numeric address, not a name: write the address in dotted quads")
    return h


def _unzoned(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """``ip`` canonical, refused with a zone: the zone names an interface of
    the machine the address is read on, which means nothing to a proxy, and
    ``ipaddress`` keeps any characters after the ``%`` (a newline, ESC,
    ``$(...)``). The message names the address without its zone."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        raise BadHost(f"{ipaddress.IPv6Address(ip.packed)}%<zone>: an IPv6 address with a zone is refused "
                      "(write the address alone)")
    return str(ip)


# Cloud metadata services outside link-local: AWS's over IPv6 (its IPv4 one is
# 169.254.169.254, link-local) and Alibaba Cloud's, in the shared 100.64/10.
CLOUD_METADATA = frozenset(("fd00:ec2::254", "100.100.100.200"))


def relayable(address: str) -> bool:
    """May the proxy connect to this resolved address? Never the host's own
    loopback (its services, the daemon's neighbours), the unspecified address
    (which reaches loopback), link-local (cloud metadata at 169.254.169.254),
    the cloud metadata addresses outside it (``CLOUD_METADATA``) or
    multicast/broadcast. Private ranges stay allowed: an internal package
    mirror is a normal thing to list."""
    ip = _ip(address.split("%", 1)[0])
    if ip is None:
        return False
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip) not in CLOUD_METADATA and not (
        ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast or ip.is_reserved
        or (ip.version == 4 and ip.packed[0] == 0))  # 0.0.0.0/8: "this host"


def _parse_one(entry: str) -> Rule:
    text = entry.strip()
    if not text:
        raise BadHost("an empty entry")
    port: int | None = None
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        if end < 0:
            raise BadHost(f"{entry!r}: unclosed '['")
        host, rest = text[: end + 1], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise BadHost(f"{entry!r}: expected ':PORT' after the address")
            port = _port(entry, rest[1:])
    elif text.count(":") == 1:
        host, p = text.split(":")
        port = _port(entry, p)
    else:
        host = text  # a name, or a bare IPv6 address
    wildcard = host.startswith("*.")
    if wildcard:
        host = host[2:]
    if "*" in host:
        raise BadHost(f"{entry!r}: a wildcard is only allowed as the whole first label ('*.example.org')")
    try:
        norm = normalise_host(host)
    except BadHost as exc:
        raise BadHost(f"{entry!r}: {exc}") from None
    is_ip = _ip(norm) is not None
    if is_ip and wildcard:
        raise BadHost(f"{entry!r}: a wildcard cannot apply to an IP address")
    if is_ip and not relayable(norm):
        raise BadHost(f"{entry!r}: the host's loopback, link-local, cloud metadata and unspecified addresses are "
                      "never relayed (a session reaches the host's own services with network 'on' or 'ports')")
    if wildcard and "." not in norm:
        raise BadHost(f"{entry!r}: a wildcard over a whole top-level domain is too broad")
    return Rule(host=norm, wildcard=wildcard, ports=DEFAULT_PORTS if port is None else (port,), ip=is_ip)


def _port(entry: str, text: str) -> int:
    port = parse_port(text)
    if port is None:
        raise BadHost(f"{entry!r}: {text!r} is not a TCP port (1-65535)")
    return port


_PORT = re.compile(r"[0-9]{1,5}")


def parse_port(text: str) -> int | None:
    """``text`` as a port, 1-65535, written in at most 5 ASCII digits; None
    for anything else. Not ``str.isdigit``: it also takes digits ``int``
    cannot read ('\u00b9', superscripts) and any number of them."""
    if _PORT.fullmatch(text) is None:
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def parse_domains(entries: list[str] | tuple[str, ...]) -> tuple[Rule, ...]:
    """The rules for a list of entries, in order, duplicates dropped. Raises
    ``BadHost`` naming the first bad entry."""
    if len(entries) > MAX_RULES:
        raise BadHost(f"{len(entries)} entries: at most {MAX_RULES}")
    rules: list[Rule] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise BadHost(f"{entry!r} is not a string")
        rule = _parse_one(entry)
        if rule not in rules:
            rules.append(rule)
    return tuple(rules)


def allowed(rules: tuple[Rule, ...], host: str, port: int) -> bool:
    """Does a request for ``host`` (normalised) on ``port`` match a rule?
    ``*.example.org`` matches ``a.example.org`` and ``a.b.example.org``, not
    ``example.org`` nor ``badexample.org``; an IP literal matches only a rule
    naming that address."""
    is_ip = _ip(host) is not None
    for rule in rules:
        if port not in rule.ports or rule.ip != is_ip:
            continue
        if rule.wildcard:
            if host.endswith("." + rule.host):
                return True
        elif host == rule.host:
            return True
    return False


def proxy_env(host: str = PROXY_HOST, port: int = PROXY_PORT) -> dict[str, str]:
    """The variables every command of a ``domains`` session runs with, in both
    cases (curl and git read the lower-case ones, pip and npm either)."""
    url = f"http://{host}:{port}"
    env: dict[str, str] = {}
    for name, value in (("HTTP_PROXY", url), ("HTTPS_PROXY", url), ("ALL_PROXY", url),
                        ("NO_PROXY", "localhost,127.0.0.1,::1")):
        env[name] = env[name.lower()] = value
    return env


def describe(rules: tuple[Rule, ...]) -> list[str]:
    return [r.spelled() for r in rules]

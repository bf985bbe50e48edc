"""The filtering proxy's HTTP (network ``domains``, daemon/proxy.py): a
request head parsed, an error answered.

Guarantees:
- ``parse_head`` takes a request line and headers as a well-behaved client
  sends them (CONNECT ``host:port``; a plain request's absolute
  ``http://`` URL), its host normalised (``domains.normalise_host``) and its
  port 1-65535 in ASCII digits (``domains.parse_port``); anything else is an
  ``HttpError`` 400 saying why, never another exception;
- what it quotes of the request in a reply is printable ASCII, at most 100
  characters (``shown``);
- ``Request.upstream_head`` sends a plain request on in origin form, with the
  URL's host as ``Host``, hop-by-hop headers dropped and ``Connection: close``.
"""

from __future__ import annotations

from dispatchd.domains import BadHost, normalise_host, parse_port

_HOP_BY_HOP = {"connection", "proxy-connection", "keep-alive", "proxy-authorization", "proxy-authenticate",
               "te", "trailer", "upgrade", "host"}


class HttpError(Exception):
    def __init__(self, status: int, reason: str, body: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.body, self.headers = status, reason, body, headers or {}


def response(status: int, reason: str, body: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection."""
    data = body.encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(data)}", "Connection: close", "Proxy-Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii", "replace") + data


def shown(raw: str) -> str:
    """Untrusted text fit for a status line or log: printable ASCII, short."""
    text = raw.encode("ascii", "backslashreplace").decode()
    text = "".join(c if 32 <= ord(c) < 127 else "?" for c in text)
    return text[:100] + ("..." if len(text) > 100 else "")


def split_authority(text: str, default_port: int | None) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or (with a default port) ``host`` -> (host, port).
    Raises ``HttpError`` 400 for anything else (user info, empty host, bad port)."""
    def bad(why: str) -> HttpError:
        return HttpError(400, "Bad Request", f"dispatchd proxy: {why}: {shown(text)!r}\n")

    if "@" in text or not text:
        raise bad("not a host[:port]")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise bad("unclosed '['")
        host, rest = text[: end + 1], text[end + 1 :]
    elif text.count(":") > 1:
        raise bad("an IPv6 address must be in brackets")
    else:
        host, sep, port_text = text.partition(":")
        rest = sep + port_text
    if rest:
        port = parse_port(rest[1:]) if rest.startswith(":") else None
        if port is None:
            raise bad("not a TCP port")
    elif default_port is None:
        raise bad("CONNECT needs host:port")
    else:
        port = default_port
    if not host or host == "[]":
        raise bad("no host")
    return host, port


class Request:
    """The head of one request to the proxy, parsed (``parse_head``)."""

    def __init__(self, method: str, host: str, port: int, path: str, version: str,
                 headers: list[tuple[str, str]]) -> None:
        self.method, self.host, self.port, self.path, self.version, self.headers = (
            method, host, port, path, version, headers)

    @property
    def tunnel(self) -> bool:
        return self.method == "CONNECT"

    def upstream_head(self) -> bytes:
        """The plain-HTTP request as the upstream gets it: origin form, the
        URL's host as ``Host``, hop-by-hop headers dropped, one request only."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        authority = host if self.port == 80 else f"{host}:{self.port}"
        lines = [f"{self.method} {self.path} {self.version}", f"Host: {authority}"]
        lines += [f"{k}: {v}" for k, v in self.headers if k.lower() not in _HOP_BY_HOP]
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> Request:
    """Parse a request head (without its final blank line). Raises ``HttpError``
    (400) for anything a well-behaved client does not send: the host is
    normalised here (``BadHost`` becomes a 400 naming it)."""
    def bad(why: str) -> HttpError:
        return HttpError(400, "Bad Request", f"dispatchd proxy: {why}\n")

    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # latin-1 decodes every byte; kept for clarity
        raise bad("undecodable request") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper() or len(parts[0]) > 20:
        raise bad(f"not an HTTP request line: {shown(lines[0])!r}")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise bad(f"unsupported version {shown(version)!r} (HTTP/1.0 and 1.1)")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t") or "\n" in line:
            raise bad(f"malformed header line {shown(line)!r}")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        host, port = split_authority(target, None)
        path = ""
    else:
        if not target.lower().startswith("http://"):
            if target.lower().startswith("https://"):
                raise bad("https:// goes through CONNECT (set HTTPS_PROXY to this proxy); this session's "
                          "commands have it set already")
            raise bad(f"{shown(target)!r}: a proxy request names its URL in full (http://host/path)")
        rest = target[7:]
        cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        host, port = split_authority(rest[:cut], 80)
        path = rest[cut:].split("#", 1)[0] or "/"
        if not path.startswith("/"):
            path = "/" + path
    try:
        host = normalise_host(host)
    except BadHost as exc:
        raise bad(shown(str(exc))) from None
    return Request(method, host, port, path, version, headers)

"""A fake package registry on the host's loopback, for the network "domains" tests.

``FakeRegistry`` is a plain HTTP server on 127.0.0.1 (a random port) that
serves a PEP 503 simple index with one tiny wheel, and echoes every other
path; it records each request's path and ``Host`` header. The daemon of these
tests is started with ``--proxy-hosts-for-testing NAME=127.0.0.1`` for the
names in ``HOSTS``: its proxy resolves them there and may relay to the host's
loopback (which it never does otherwise), so nothing needs DNS or the internet.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading
import zipfile
from pathlib import Path

from tests.conftest import Daemon

# Names the test daemon resolves to 127.0.0.1; only those a session lists are allowed.
HOSTS = ("registry.test", "files.registry.test", "other.test")
WHEEL = "demo_pkg-1.0-py3-none-any.whl"


def _wheel() -> bytes:
    files = {
        "demo_pkg/__init__.py": b"VALUE = 42\n",
        "demo_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        "demo_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        record.append("demo_pkg-1.0.dist-info/RECORD,,")
        z.writestr("demo_pkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return buf.getvalue()


class FakeRegistry:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []  # (path, Host header)
        wheel = _wheel()
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
                registry.requests.append((self.path, self.headers.get("Host", "")))
                if self.path.rstrip("/") == "/simple/demo-pkg":
                    body = f'<html><body><a href="/files/{WHEEL}">{WHEEL}</a></body></html>'.encode()
                    kind = "text/html"
                elif self.path == f"/files/{WHEEL}":
                    body, kind = wheel, "application/octet-stream"
                elif self.path.startswith("/big/"):
                    body, kind = b"x" * int(self.path.split("/")[2]), "application/octet-stream"
                else:
                    body, kind = f"registry says hello: {self.path}\n".encode(), "text/plain"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def domains_daemon(base: Path, *extra: str) -> Daemon:
    """A daemon whose proxy resolves ``HOSTS`` to the host's loopback (testing only)."""
    base.mkdir(parents=True, exist_ok=True)
    flags = [a for h in HOSTS for a in ("--proxy-hosts-for-testing", f"{h}=127.0.0.1")]
    return Daemon(base, *flags, *extra)

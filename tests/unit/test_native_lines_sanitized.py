"""The C line loops built with AddressSanitizer and UBSan and driven with
random bytes and edge-of-range numbers: an out-of-bounds read or write, an
overflow or a use after free stops the run with the sanitizer's report.
The helper reads the worktree's (hostile) bytes; this is the test that it
stays within them. Needs gcc and its libasan/libubsan (the set-up installs
gcc, which brings both)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import dispatchd.tools

pytestmark = pytest.mark.process  # builds the C helper with a compiler, runs it in a child

_SOURCES = [Path(dispatchd.tools.__file__).parent / name
            for name in ("_lines.c", "_fastread.c", "_spawn.c", "_confined.c", "_ctimes.c")]

_DRIVE = r"""
import os, random, sys
sys.path.insert(0, sys.argv[1])
import _lines as L
M = 2**63 - 1
rng = random.Random(int(sys.argv[2]))
paths = [sys.argv[1] + "/" + n for n in ("text", "empty", "nul", "missing", ".")] + ["/dev/null", "/proc/self/stat"]
root = os.open(sys.argv[1], os.O_PATH | os.O_DIRECTORY)
parts = ["text", "empty", "nul", "/", ".", "..", "", "a", "\udcff", "\x00", "a" * 300]
units = [b"a", b"\n", b"\r", b"\xff", b"\xc3", b"ab", b"\x00", b"\n\n", b"\xe2\x82", b"aa" * 40]
for _ in range(40000):
    d = b"".join(rng.choice(units) for _ in range(rng.randint(0, 40)))
    L.numbered(d, rng.choice([0, 1, 5, M, M - 1, rng.randint(0, 12)]), rng.choice([-1, M, M - 1, rng.randint(0, 14)]))
    needle = rng.choice([b"a", b"\r", b"ab", b"\xc3", b"aa", b"a" * 9])
    L.search_literal(d, needle, rng.choice([0, M, rng.randint(0, 5)]), rng.choice(["n", "\u00e9", "a\nb"]),
                     rng.choice([0, M, rng.randint(0, 6)]), rng.randint(-1, len(needle) - 1), rng.choice([0, 2, M]))
    L.read_text(rng.choice(paths), rng.choice([0, 3, 100, M]), rng.choice([0, 1, 8192, M]))
    name = "".join(rng.choice(parts) for _ in range(rng.randint(0, 6)))
    L.read_beneath(rng.choice([root, -1, -100]), name, rng.choice([0, 3, 100, M]), rng.choice([0, 1, 8192, M]))
# The fast lane (_fastread.c) on requests cut, grown and flipped from the
# usual read_file call, over a socketpair: whatever it answers is read back.
import socket, struct, threading
sys.path.insert(0, sys.argv[3])
from mutate import mutated
ours, lane = socket.socketpair()
ours.setblocking(False)
lock = threading.Lock()
server = type("S", (), {"draining": False})()
def call(params, rid=7, **extra):
    body = {"op": "call_tool", "id": rid, "tool": "read_file", "params": params, "stream": False, **extra}
    return msgpack(body)
def msgpack(v):  # a small encoder of its own: the drive runs without msgspec
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        return struct.pack(">Bq", 0xd3, v) if v < 0 else (bytes([v]) if v < 128 else struct.pack(">BQ", 0xcf, v))
    if isinstance(v, str):
        b = v.encode("utf-8", "surrogateescape")
        return (bytes([0xa0 | len(b)]) if len(b) < 32 else struct.pack(">BI", 0xdb, len(b))) + b
    return bytes([0x80 | len(v)]) + b"".join(msgpack(k) + msgpack(x) for k, x in v.items())
bodies = [call({"path": p}, s_rid) for p in ("text", "empty", "nul", "missing", "a/../text", "x" * 300)
          for s_rid in (0, 1, -1, 2**62, -2**63)]
bodies += [call({"path": "text", "start_line": a, "end_line": b}) for a in (0, 3, 99, 2**62 - 1, 2**62)
           for b in (-1, 0, 5, 99, 2**62 - 1)]
served = several = 0
for i in range(20000):
    usual = i % 2 == 0  # every other request as a client sends it, to a server that answers it
    body = mutated(rng, rng.choice(bodies), 0 if usual else rng.randint(1, 3))
    length = len(body) if usual or rng.random() < 0.9 else rng.randrange(1 << 32)
    # Every fourth, usual calls sent ahead of it in the same send (threads
    # sharing a session), and at times the next frame's first bytes after it.
    ahead = b"".join(struct.pack(">I", len(b)) + b for b in rng.sample(bodies, rng.randint(1, 3))) \
        if i % 4 == 0 else b""
    cut = rng.choice(bodies)[:rng.randint(0, 6)] if i % 8 == 0 else b""
    ours.send(ahead + struct.pack(">I", length) + body + cut)
    server.draining = not usual and rng.random() < 0.05
    pick = (lambda *xs: xs[0]) if usual else (lambda *xs: rng.choice(xs))
    took = L.serve_read(lane.fileno(), pick(root, -1), pick(M, 0, 100), pick(8192, 0), pick(1 << 26, 0, 64),
                        lock.acquire, lock.release, server)
    served += isinstance(took, float)
    several += isinstance(took, tuple)
    try:
        while ours.recv(1 << 20):
            pass
    except BlockingIOError:
        pass
print("clean" if served > 1000 and several > 500 else
      f"the lane answered {served} lone calls and {several} batches: the drive missed its serving paths")
"""


def _runtime(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_line_loops_stay_within_their_buffers(tmp_path: Path) -> None:
    built = tmp_path / ("_lines" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer",
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                    f"-I{sysconfig.get_paths()['include']}", *map(str, _SOURCES), "-o", str(built)], check=True)
    (tmp_path / "text").write_bytes(b"a\nb\n" * 50)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "nul").write_bytes(b"a" * 10 + b"\0")
    env = dict(os.environ, LD_PRELOAD=f"{_runtime('libasan.so')}:{_runtime('libubsan.so')}",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    # argv: the built module's folder, the seed, and this folder (mutate.py)
    out = subprocess.run([sys.executable, "-c", _DRIVE, str(tmp_path), "11", str(Path(__file__).parent)],
                         capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr[-3000:]
    assert "runtime error" not in out.stderr and "AddressSanitizer" not in out.stderr, out.stderr[-3000:]

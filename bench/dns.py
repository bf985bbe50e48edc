"""What the DNS relay adds to a query, inside a session with network on.

    .venv/bin/python bench/dns.py [N]      (as an ordinary user)

Starts its own daemon pointed at a DNS responder of its own on the host's
loopback (tests/dnsresponder.py, through the daemon's testing option) and
opens one session with network on. Inside it, N rounds (default 2,000), each
of them timing one UDP query per path, interleaved:
- ``relay``: to the relay's door, 127.0.0.53:53 (session -> its loopback ->
  the daemon -> the host's loopback -> the responder);
- ``pasta``: the same responder straight at the gateway, 10.0.2.2:PORT
  (session -> tap -> pasta -> the host's loopback -> the responder), the
  path a query took before the relay when the host's resolver was reachable;
- ``host``: outside any session, the same query from this process to the
  responder (the floor: the responder's own cost and one loopback round trip).
Then ``getent hosts`` as a whole process through the relay, 50 times.
Prints p50 and p99 of each and the ratios to ``pasta``. The machine is shared:
read the ratios, not the figures.
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import fmt, pct, run_small, start_daemon, stop_daemon  # noqa: E402  (and the repository on the path)

import dispatch  # noqa: E402
from tests.dnsresponder import NAME, Responder  # noqa: E402

_INSIDE = """
import json, socket, struct, sys, time
n, port, q = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
def one(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.connect(addr)
    t = time.perf_counter()
    s.send(q)
    r = s.recv(4096)
    took = time.perf_counter() - t
    s.close()
    assert r[:2] == q[:2] and r[3] & 15 == 0, r
    return took
out = {"relay": [], "pasta": []}
for i in range(n):
    out["relay"].append(one(("127.0.0.53", 53)))
    out["pasta"].append(one(("10.0.2.2", port)))
print(json.dumps(out))
"""


def query() -> bytes:
    return struct.pack("!HHHHHH", 0x5151, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in NAME.split(".")) + b"\x00" + struct.pack("!HH", 1, 1)


def host_floor(port: int, n: int) -> list[float]:
    q, out = query(), []
    for _ in range(n):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            t = time.perf_counter()
            s.send(q)
            s.recv(4096)
            out.append(time.perf_counter() - t)
    return out


def main(rounds: int, tmp: str) -> int:
    responder = Responder()
    conf = Path(tmp, "resolv.conf")
    conf.write_text(f"nameserver 127.0.0.1:{responder.port}\n")
    daemon, sock = start_daemon(tmp, "--dns-resolv-conf-for-testing", str(conf), "--pool", "0")
    wt = Path(tmp, "wt")
    wt.mkdir()
    try:
        with dispatch.connect(sock) as client:
            with client.open_session(str(wt), network="on") as s:
                shell = s.registry.get("shell_exec")
                Path(wt, "inside.py").write_text(_INSIDE)
                r = shell.call({"command": f"/usr/bin/python3 inside.py {rounds} {responder.port} "
                                           f"{query().hex()}", "timeout": 600})
                if not r.is_success:
                    print(r.error, file=sys.stderr)
                    return 1
                inside = json.loads(r.metadata["stdout"])
                r = shell.call({"command": "for i in $(seq 50); do s=$(date +%s%N); getent hosts " + NAME
                                + " >/dev/null || exit 1; e=$(date +%s%N); echo $((e - s)); done"})
                getent = [int(x) / 1e9 for x in r.metadata["stdout"].split()]
                r = shell.call({"command": "for i in $(seq 50); do s=$(date +%s%N); getent hosts 10.0.2.2"
                                " >/dev/null; e=$(date +%s%N); echo $((e - s)); done"})
                getent_no_dns = [int(x) / 1e9 for x in r.metadata["stdout"].split()]
        floor = host_floor(responder.port, rounds)
    finally:
        stop_daemon(daemon, 30)
        responder.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(inside["pasta"])
    print(f"UDP query for {NAME}, {rounds} rounds, interleaved (p50 / p99, ratio of p50 to pasta's):")
    for label, xs in (("relay (127.0.0.53:53)", inside["relay"]), ("pasta (10.0.2.2:PORT)", inside["pasta"]),
                      ("host, no session", floor)):
        print(f"  {label:24} {fmt(statistics.median(xs))} / {fmt(pct(xs, 0.99))}   "
              f"{statistics.median(xs) / base:5.2f}x")
    print(f"  relay - pasta (p50):     {fmt(statistics.median(inside['relay']) - base)}")
    print("getent hosts, 50 processes (p50 / p99):")
    print(f"  {NAME} through the relay {fmt(statistics.median(getent))} / {fmt(pct(getent, 0.99))}")
    print(f"  an address (no query)    {fmt(statistics.median(getent_no_dns))} / {fmt(pct(getent_no_dns, 0.99))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_small("dns", __doc__, 2000, main))

"""How long the kernel takes to end a process built as a sandbox is: from
SIGKILL to its pidfd readable (the close's "exit" step, docs/performance.md,
"The sandbox's exit"). Run as an ordinary user (it makes a user namespace).

    python bench/exit_cost.py [--rounds 30] [--mounts 20] [--mem-mib 20] [--threads 4] [--no-net]
                              [--beside hold|mrelease]

Each round forks a process into new user, mount, pid, IPC and (unless
--no-net) network namespaces, bind-mounts --mounts system directories,
writes --mem-mib MiB of its own pages and starts --threads - 1 threads,
then kills it. ``--beside``: every other round, in alternating order, the
same with the parent holding the process's mount namespace open until
after the exit (``hold``: the close of that descriptor is timed too) or
calling ``process_mrelease`` on it right after the kill (``mrelease``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import statistics
import threading
import time

libc = ctypes.CDLL(None, use_errno=True)
NEWUSER, NEWNS, NEWPID, NEWIPC, NEWNET = 0x10000000, 0x00020000, 0x20000000, 0x08000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYS_PROCESS_MRELEASE = 448  # x86_64 and the generic table
DIRS = ["/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin", "/var", "/opt", "/srv", "/home", "/root", "/run",
        "/tmp", "/boot", "/dev", "/sys"]


def _mount(src: str, flags: int) -> bool:
    return libc.mount(src.encode(), src.encode(), None, flags, None) == 0


def _sandbox(w: int, args: argparse.Namespace) -> None:
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(NEWUSER | NEWNS | NEWPID | NEWIPC | (0 if args.no_net else NEWNET)) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    pid = os.fork()
    if pid:
        os.write(w, f"{pid}\n".encode())
        return
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)  # our mounts stay ours
    made = sum(_mount(DIRS[i % len(DIRS)], MS_BIND | MS_REC) for i in range(args.mounts)
               if os.path.isdir(DIRS[i % len(DIRS)]))
    mem = bytearray(args.mem_mib << 20)
    for i in range(0, len(mem), 4096):
        mem[i] = 1
    for _ in range(args.threads - 1):
        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
    os.write(w, f"{made}\n".encode())
    time.sleep(1000)


def _round(args: argparse.Namespace, beside: str) -> tuple[float, float, int]:
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            _sandbox(w, args)
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    with os.fdopen(r, "rb", buffering=0) as f:
        pid = int(f.readline())
        made = int(f.readline() or -1)
    if made < 0:
        raise SystemExit("the sandbox could not be made")
    pidfd = os.pidfd_open(pid)
    held = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY) if beside == "hold" else -1
    began = time.perf_counter()
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if beside == "mrelease":
        libc.syscall(SYS_PROCESS_MRELEASE, pidfd, 0)
    select.select([pidfd], [], [])
    exited = time.perf_counter()
    if held >= 0:
        os.close(held)
    os.close(pidfd)
    return (exited - began) * 1e3, (time.perf_counter() - exited) * 1e3, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--mounts", type=int, default=20)
    parser.add_argument("--mem-mib", type=int, default=20)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--no-net", action="store_true")
    parser.add_argument("--beside", choices=["hold", "mrelease"], default="")
    args = parser.parse_args()
    kinds = ["plain"] + ([args.beside] if args.beside else [])
    got: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        for kind in (kinds if i % 2 else kinds[::-1]):
            got[kind].append(_round(args, "" if kind == "plain" else kind))
            time.sleep(0.02)
    for kind in kinds:
        exits = sorted(e for e, _, _ in got[kind])
        after = statistics.median(a for _, a, _ in got[kind])
        print(f"{kind}: {got[kind][0][2]} mounts, {args.mem_mib} MiB, {args.threads} threads: SIGKILL -> exited "
              f"p50 {statistics.median(exits):.3f} ms, p90 {exits[int(0.9 * len(exits))]:.3f} ms; after {after:.3f} ms")


if __name__ == "__main__":
    main()

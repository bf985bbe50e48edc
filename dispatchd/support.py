"""``dispatchd check``: which row of docs/support.md this machine is in.

The row follows from the kernel probe alone (``kernel.probe``, the same the
daemon makes at start): Landlock's ABI and whether user namespaces are
available decide the mode and what it leaves open; the network stack and
nftables decide the network modes. The distribution and the container are
named beside it, for the reader (they are how a row is usually reached, not
what decides it). ``classify`` is pure, tested by equality.
"""

from __future__ import annotations

import sys

import msgspec

from dispatchd.protocol.reports import KernelFeatures

COMMANDS = ("check",)
DOC = "docs/support.md"


class Row(msgspec.Struct, frozen=True):
    name: str  # "A" ... "E", "X": the row of docs/support.md's kernel table
    mode: str  # in words: full, degraded, or none
    leaves_open: str  # the row's gaps, in short (status' leaves_open says them whole)
    full_mode: str  # how to get full mode from here ("" when there already)


def classify(k: KernelFeatures) -> Row:
    """Pure: the kernel table's row for what ``k`` found."""
    abi = k.landlock_abi
    if abi < 1:
        return Row("X", "none: the daemon refuses to start (no Landlock)", "everything: no session is opened",
                   "a kernel of 5.13 or later with landlock in its LSM list (cat /sys/kernel/security/lsm; "
                   "boot with lsm=landlock,... where it is missing)")
    if k.user_namespaces:
        if abi >= 6:
            return Row("A", "full", "nothing beyond the list every mode shares", "")
        return Row("B", "full sandbox, reported degraded (Landlock ABI < 6: no scopes)",
                   "signals and abstract Unix sockets held by the namespaces alone"
                   + ("; renames into another directory fail (EXDEV) under ABI 1" if abi == 1 else ""),
                   "a kernel of 6.12 or later (Landlock ABI 6)")
    base = "the host's /proc, file metadata, chmod/utime/xattr on the user's files, git metadata writable"
    if abi >= 6:
        return Row("C", "degraded", base, _userns_fix(k))
    if abi >= 3:
        return Row("D", "degraded", base + "; signals to every process of the user's (the daemon included)",
                   _userns_fix(k))
    return Row("E", "degraded", base + "; signals to every process of the user's; truncate() on read-only paths"
               + ("; network off held by seccomp alone" if abi < 4 else "")
               + ("; renames into another directory fail (EXDEV)" if abi == 1 else ""),
               _userns_fix(k))


def _userns_fix(k: KernelFeatures) -> str:
    if k.user_namespaces_note.startswith("not used"):
        return "start the daemon without --no-user-namespaces"
    return ("allow unprivileged user namespaces (Ubuntu: the AppArmor profile in packaging/apparmor, or "
            "sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0; elsewhere: "
            "sudo sysctl user.max_user_namespaces=15000 / kernel.unprivileged_userns_clone=1; a container: "
            "see docs/support.md)")


def os_name(path: str = "/etc/os-release") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            fields = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    except OSError:
        return "unknown distribution"
    return fields.get("PRETTY_NAME", fields.get("NAME", "unknown distribution")).strip('"')


def describe(k: KernelFeatures, row: Row, system: str) -> list[str]:
    """The lines ``dispatchd check`` prints. Pure."""
    unavailable = k.network_unavailable
    modes = ", ".join(m for m in ("off", "on", "ports", "domains") if m not in unavailable)
    lines = [f"support row {row.name} ({DOC}): {row.mode}; Landlock ABI {k.landlock_abi or 'absent'}, "
             f"user namespaces {'yes' if k.user_namespaces else 'no (' + k.user_namespaces_note + ')'}; network modes: {modes or 'none'}; "
             f"{system}, kernel {k.release}",
             f"  leaves open: {row.leaves_open}"]
    if row.full_mode:
        lines.append(f"  for full mode: {row.full_mode}")
    if k.network_stack and k.user_namespaces:
        lines.append(f"  network stack: {k.network_stack} (dispatchd --network-stack; docs/network.md)")
    lines += [f"  network {mode} unavailable: {why}" for mode, why in unavailable.items()]
    return lines


def main(argv: list[str]) -> int:
    """``dispatchd check``: probe as the daemon would, print the row."""
    if argv[1:] not in ([], ["--no-user-namespaces"]):
        print("usage: dispatchd check [--no-user-namespaces]", file=sys.stderr)
        return 2
    from dispatchd import kernel
    from dispatchd.confine.mounts import probe_host_tree

    k = kernel.probe(forbid_user_namespaces=argv[1:] == ["--no-user-namespaces"])
    k = msgspec.structs.replace(k, host_tree_missing=probe_host_tree() if k.user_namespaces else "no user namespaces")
    system = os_name() + (f" (container hint: {k.container})" if k.container else "")
    for line in describe(k, classify(k), system):
        print(line)
    return 0 if k.landlock_abi >= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["check"]))

"""What this kernel offers, probed once when the daemon starts.

The probe is reported by ``dispatch status`` and logged at start; the session
planner reads it instead of guessing, and refuses what a policy requires but
the kernel lacks.
"""

from __future__ import annotations

import os

import msgspec

from dispatchd.confine.landlock import landlock_abi
from dispatchd.confine.namespaces import probe_user_namespaces
from dispatchd.confine.netstack import probe_nft, probe_stack


class KernelFeatures(msgspec.Struct, frozen=True):
    release: str
    landlock_abi: int  # 0: Landlock absent or disabled
    user_namespaces: bool
    user_namespaces_note: str
    seccomp: bool
    seccomp_actions: list[str]
    cgroup2: str  # where cgroup v2 is mounted, "" if nowhere
    # Whether sessions get cgroups of their own, and why not: filled in by the
    # daemon once it has tried to take its cgroup (confine/cgroups.py).
    cgroup_delegation: str = "not looked for"
    # The user-mode stack sessions reach out through, and nftables for
    # "ports": "" when usable, else why not (confine/netstack.py). Missing,
    # "on" and "ports" fall back to the host's network, and say so.
    network_stack_missing: str = "not looked for"
    nftables_missing: str = "not looked for"

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = msgspec.to_builtins(self)
        return d


def _seccomp_actions() -> list[str]:
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail", encoding="ascii") as f:
            return f.read().split()
    except OSError:
        return []


def _cgroup2_mount() -> str:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if fields[2] == "cgroup2":
                    return fields[1]
    except OSError:
        pass
    return ""


def probe(*, forbid_user_namespaces: bool = False) -> KernelFeatures:
    """Call before any thread exists (the user-namespace probe forks)."""
    if forbid_user_namespaces:
        userns, note = False, "not used: the daemon was started with --no-user-namespaces"
    else:
        userns, note = probe_user_namespaces()
    actions = _seccomp_actions()
    cgroup2 = _cgroup2_mount()
    return KernelFeatures(
        release=os.uname().release,
        landlock_abi=landlock_abi(),
        user_namespaces=userns,
        user_namespaces_note=note,
        seccomp="errno" in actions,
        seccomp_actions=actions,
        cgroup2=cgroup2,
        network_stack_missing=probe_stack(),
        nftables_missing=probe_nft(),
    )

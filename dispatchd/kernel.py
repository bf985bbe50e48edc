"""What this kernel offers, probed once when the daemon starts.

The probe is reported by ``dispatch status`` and logged at start; the session
planner reads it instead of guessing, and refuses what a policy requires but
the kernel lacks.
"""

from __future__ import annotations

import os

from dispatchd.confine.landlock import landlock_abi
from dispatchd.confine.namespaces import probe_user_namespaces
from dispatchd.confine.netstack import probe_nft, probe_stack
from dispatchd.protocol.reports import KernelFeatures

__all__ = ["KernelFeatures", "probe"]  # the struct is defined with the other reports


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

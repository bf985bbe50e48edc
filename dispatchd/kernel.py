"""What this kernel offers, probed once when the daemon starts.

The probe is reported by ``dispatch status`` and logged at start; the session
planner reads it instead of guessing, and refuses what a policy requires but
the kernel lacks.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from dispatchd.confine.landlock import landlock_abi
from dispatchd.confine.namespaces import probe_user_namespaces
from dispatchd.confine.netstack import probe_nft, unavailable
from dispatchd.confine.stacks import TUN, probe_stack
from dispatchd.netmodes import NETWORK_MODES
from dispatchd.protocol.reports import KernelFeatures

# KernelFeatures is defined with the other reports.
__all__ = ["APPARMOR_FIX", "TUN", "KernelFeatures", "container_hint", "force_for_testing", "probe", "userns_note",
           "with_network_modes"]


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


# Ubuntu (23.10+) lets a program make a user namespace with capabilities in it
# only where an AppArmor profile allows it ("userns,"), when this is 1.
APPARMOR_RESTRICT = "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"
APPARMOR_FIX = ("sudo packaging/apparmor/install (from dispatchd's source: a profile allowing user namespaces "
                "to its launcher; docs/support.md)")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def userns_note(available: bool, note: str, restricted: str, label: str) -> str:
    """The user-namespace probe's note, with what Ubuntu's AppArmor
    restriction does here: ``restricted`` is the sysctl's value ("" where
    there is none), ``label`` this process's AppArmor label. Pure."""
    if restricted != "1":
        return note
    if available:
        return f"{note} (AppArmor restricts them on this machine; this process's profile allows them: {label})"
    return (f"{note}: AppArmor restricts them on this machine (kernel.apparmor_restrict_unprivileged_userns = 1) "
            f"and no profile allows dispatchd to make them (this process: {label or 'unconfined'}); "
            f"fix: {APPARMOR_FIX}")


def container_hint(exists: Callable[[str], bool], cgroup: str, uid_map: str) -> str:
    """Which container the daemon seems to run in ("" for none seen), from
    the engines' marker files, PID 1's cgroup and our uid map. Pure: a hint
    for status and docs/support.md's rows, never a decision."""
    if exists("/run/.containerenv"):
        kind = "podman (/run/.containerenv)"
    elif exists("/.dockerenv"):
        kind = "docker (/.dockerenv)"
    else:
        found = [w for w in ("kubepods", "docker", "libpod", "containerd", "lxc") if w in cgroup]
        kind = f"a container (cgroup names {found[0]})" if found else ""
    fields = uid_map.split()
    if kind and len(fields) >= 3 and fields[:3] != ["0", "0", "4294967295"]:
        kind += ", in a user namespace (rootless)"
    return kind


def probe(*, forbid_user_namespaces: bool = False, tun: str = TUN, network_stack: str = "auto") -> KernelFeatures:
    """Call before any thread exists (the user-namespace probe forks).
    ``tun``: the device the network stack needs (another path only for the
    daemon's testing option, which can only make it unusable);
    ``network_stack``: ``dispatchd --network-stack``'s choice."""
    if forbid_user_namespaces:
        userns, note = False, "not used: the daemon was started with --no-user-namespaces"
    else:
        userns, note = probe_user_namespaces()
        # AppArmor's own label file where several LSMs are stacked, else the shared one.
        label = _read("/proc/self/attr/apparmor/current") or _read("/proc/self/attr/current")
        note = userns_note(userns, note, _read(APPARMOR_RESTRICT), label)
    actions = _seccomp_actions()
    cgroup2 = _cgroup2_mount()
    abi = landlock_abi()
    stack, stack_missing = probe_stack(network_stack, tun, landlock_abi=abi)
    return with_network_modes(KernelFeatures(
        release=os.uname().release,
        landlock_abi=abi,
        user_namespaces=userns,
        user_namespaces_note=note,
        seccomp="errno" in actions,
        seccomp_actions=actions,
        cgroup2=cgroup2,
        network_stack_missing=stack_missing,
        network_stack=stack,
        nftables_missing=probe_nft(),
        container=container_hint(os.path.exists, _read("/proc/1/cgroup"), _read("/proc/self/uid_map")),
    ))


def with_network_modes(k: KernelFeatures) -> KernelFeatures:
    """``k`` with ``network_unavailable`` filled in from what it found. Pure."""
    why = {mode: unavailable(mode, k.network_stack_missing, k.nftables_missing, use_userns=k.user_namespaces)
           for mode in NETWORK_MODES}
    return msgspec.structs.replace(k, network_unavailable={m: w for m, w in why.items() if w})


def force_for_testing(k: KernelFeatures, spec: str,
                      restack: Callable[[int], tuple[str, str]] | None = None) -> KernelFeatures:
    """Testing only (the daemon's ``--force-kernel-for-testing SPEC``): ``k``
    as an older or more restricted kernel would have probed, so that the
    tests run every mode's planning *and* its enforcement here (the session's
    ruleset is built for the forced ABI: its handled rights, scopes and
    struct size, as that kernel would take it). ``SPEC``: comma-separated
    ``landlock=N`` (0 to this kernel's ABI), ``user_namespaces=no``,
    ``detached_mounts=no``. It only takes away: asking for more than this
    kernel has, or anything else, raises ``ValueError``. ``restack(abi)``:
    the network stack that kernel's probe would choose, and why none
    (``probe_stack`` for the forced ABI: slirp4netns needs Landlock); without
    it the probed stack stays. Pure but for what ``restack`` looks at."""
    changes: dict[str, object] = {}
    abi = k.landlock_abi
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if key == "landlock" and sep and value.isdigit():
            if int(value) > k.landlock_abi:
                raise ValueError(f"landlock={value}: this kernel offers ABI {k.landlock_abi}; forcing only takes away")
            changes["landlock_abi"] = abi = int(value)
        elif key == "user_namespaces" and value == "no":
            changes["user_namespaces"] = False
            changes["user_namespaces_note"] = "forced off for testing"
            changes["host_tree_missing"] = "no user namespaces"
        elif key == "detached_mounts" and value == "no":
            if "host_tree_missing" not in changes:
                changes["host_tree_missing"] = ("binding from a detached copy of the mount tree: forced off for "
                                                "testing (as before Linux 6.15); the host's root is kept below")
        else:
            raise ValueError(f"{item!r}: expected landlock=N, user_namespaces=no or detached_mounts=no")
    if restack is not None and abi != k.landlock_abi:
        # Chosen as that kernel's probe would (slirp4netns is confined by Landlock).
        changes["network_stack"], changes["network_stack_missing"] = restack(abi)
    return with_network_modes(msgspec.structs.replace(k, **changes, forced_for_testing=spec))

"""dispatchd.protocol.reports: the typed status reports encode byte for byte
as the dicts they replaced, so clients that read them as dicts (older ones,
``dispatch status --json``, ``session.status()``) see no change."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dispatchd import protocol as p

_LIMITS = p.LimitsReport(
    mechanism="cgroup v2 and rlimits", cgroup="/sys/fs/cgroup/d/session-ab", cgroups="in use at /sys/fs/cgroup/d",
    max_processes="256 (pids.max over the session)", memory="8589934592 bytes over the session (memory.max, no swap)",
    cpu_weight=100, max_data_bytes_per_process=4294967296, max_file_bytes=1073741824, max_open_files_per_process=1024,
    kernel_budgets="in its user namespace: inotify 128 instances", leaves_open=["epoll watches"])
_OLD_LIMITS = {
    "mechanism": "cgroup v2 and rlimits", "cgroup": "/sys/fs/cgroup/d/session-ab", "cgroups": "in use at /sys/fs/cgroup/d",
    "max_processes": "256 (pids.max over the session)",
    "memory": "8589934592 bytes over the session (memory.max, no swap)", "cpu_weight": 100,
    "max_data_bytes_per_process": 4294967296, "max_file_bytes": 1073741824, "max_open_files_per_process": 1024,
    "kernel_budgets": "in its user namespace: inotify 128 instances", "leaves_open": ["epoll watches"]}


def _protections(**kw: Any) -> p.Protections:
    fields: dict[str, Any] = dict(
        mode="full",
        landlock=p.LandlockReport(abi=6, filesystem="enforced", scopes=["abstract_unix_socket", "signal"], tcp="denied"),
        seccomp="enforced",
        namespaces=p.NamespacesReport(user=True, mount=True, pid=True, net=False),
        network=p.NetworkReport(mode="off", mechanism="seccomp"),
        worktree="read-write",
        root=[p.RootEntry(path="/usr", how="read-only (system)"), p.RootEntry(path="/wt", how="read-write")],
        unix_sockets="allowed",
        git=p.GitReport(kind="repository", read_only=["/wt/.git/config"], granted=["/wt/.git/objects"]),
        hygiene=["no_new_privs", "no capabilities"],
        leaves_open=[],
        limits=_LIMITS)
    fields.update(kw)
    return p.Protections(**fields)


def _old(**kw: Any) -> dict[str, Any]:
    """The dict ``confine/plan.py`` built before the reports were typed, in its key order."""
    d: dict[str, Any] = {
        "mode": "full",
        "landlock": {"abi": 6, "filesystem": "enforced", "scopes": ["abstract_unix_socket", "signal"], "tcp": "denied"},
        "seccomp": "enforced",
        "namespaces": {"user": True, "mount": True, "pid": True, "net": False},
        "network": {"mode": "off", "mechanism": "seccomp"},
        "worktree": "read-write",
        "root": [{"path": "/usr", "how": "read-only (system)"}, {"path": "/wt", "how": "read-write"}],
        "unix_sockets": "allowed",
        "git": {"kind": "repository", "read_only": ["/wt/.git/config"], "granted": ["/wt/.git/objects"]},
        "hygiene": ["no_new_privs", "no capabilities"],
        "leaves_open": [],
        "limits": _OLD_LIMITS,
    }
    d.update(kw)
    return d


WATCHDOG = {"mechanism": "watchdog", "limit_bytes": 8589934592, "interval_s": 0.2,
            "detail": "the daemon sums the PSS of the session's processes every 0.2 s and ends the session over the limit"}
CGROUP = {"mechanism": "cgroup", "limit_bytes": 8589934592, "detail": "memory.max over the session's cgroup"}

CASES: dict[str, tuple[p.Protections, dict[str, Any]]] = {
    # as planned: no absent_paths, no lifetime yet
    "planned": (_protections(), _old()),
    # as listed: the worker's absent_paths (even empty), then the daemon's lifetime
    "listed, watchdog": (
        _protections(absent_paths=[], lifetime=p.LifetimeReport(
            detached=False, orphan_grace_s=30.0, memory=p.MemoryHold(**WATCHDOG))),
        _old(absent_paths=[], lifetime={"detached": False, "orphan_grace_s": 30.0, "memory": WATCHDOG})),
    "listed, cgroup": (
        _protections(absent_paths=["/opt"], lifetime=p.LifetimeReport(
            detached=True, orphan_grace_s=1.0, memory=p.MemoryHold(**CGROUP))),
        _old(absent_paths=["/opt"], lifetime={"detached": True, "orphan_grace_s": 1.0, "memory": CGROUP})),
    # "ports" through pasta: stack and both port lists, even empty ones
    "ports": (
        _protections(network=p.NetworkReport(mode="ports", mechanism="nftables", stack="pasta",
                                              connect_ports=[443], bind_ports=[])),
        _old(network={"mode": "ports", "mechanism": "nftables", "stack": "pasta", "connect_ports": [443],
                      "bind_ports": []})),
    "on, through pasta": (
        _protections(network=p.NetworkReport(mode="on", mechanism="pasta", stack="pasta")),
        _old(network={"mode": "on", "mechanism": "pasta", "stack": "pasta"})),
    "git note, degraded": (
        _protections(mode="degraded", leaves_open=["no Landlock scopes"],
                     git=p.GitReport(kind="linked", read_only=[], granted=[], note="a linked worktree"),
                     limits=msgspec.structs.replace(_LIMITS, max_processes=256, cpu_weight="not enforced")),
        _old(mode="degraded", leaves_open=["no Landlock scopes"],
             git={"kind": "linked", "read_only": [], "granted": [], "note": "a linked worktree"},
             limits={**_OLD_LIMITS, "max_processes": 256, "cpu_weight": "not enforced"})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_protections_encode_as_the_old_dict(case: str) -> None:
    typed, old = CASES[case]
    assert msgspec.msgpack.encode(typed) == msgspec.msgpack.encode(old)
    assert msgspec.json.encode(typed) == msgspec.json.encode(old)


@pytest.mark.parametrize("case", list(CASES))
def test_protections_decode_from_the_old_dict_and_read_back_the_same(case: str) -> None:
    typed, old = CASES[case]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=p.Protections)
    assert back == typed
    assert msgspec.to_builtins(back) == old  # what Client.status() hands to programs


def test_a_session_info_encodes_its_protections_in_place() -> None:
    typed, old = CASES["listed, watchdog"]
    info = p.SessionInfo(id="ab", worktree="/wt", policy="default", network="off", created=1.5, protections=typed)
    old_info = {"id": "ab", "worktree": "/wt", "policy": "default", "network": "off", "created": 1.5,
                "protections": old, "limits": {}, "note": "", "domains": [], "denied": [], "writes": False,
                "asleep": False, "protected": [], "warnings": [],
                "usage": {"calls": 0, "cpu_s": 0.0, "peak_mib": 0.0}, "sandbox": 0, "replaced": ""}
    assert msgspec.msgpack.encode(info) == msgspec.msgpack.encode(old_info)


def test_kernel_features_and_daemon_report_encode_as_the_old_dicts() -> None:
    kernel = p.KernelFeatures(release="6.8.0", landlock_abi=0, user_namespaces=False,
                              user_namespaces_note="refused by AppArmor", seccomp=True,
                              seccomp_actions=["kill_process", "errno"], cgroup2="")
    old_kernel = {"release": "6.8.0", "landlock_abi": 0, "user_namespaces": False,
                  "user_namespaces_note": "refused by AppArmor", "seccomp": True,
                  "seccomp_actions": ["kill_process", "errno"], "cgroup2": "",
                  "cgroup_delegation": "not looked for", "network_stack_missing": "not looked for", "network_stack": "",
                  "nftables_missing": "not looked for", "network_unavailable": {},
                  "host_tree_missing": "not looked for", "shared_budgets": "",
                  "shared_budgets_missing": "not looked for", "shared_processes": 0, "forced_for_testing": "", "container": ""}
    assert msgspec.msgpack.encode(kernel) == msgspec.msgpack.encode(old_kernel)
    daemon = p.DaemonReport(open_files=4096, open_files_note="raised", connections=1, max_connections=2016)
    old_daemon = {"open_files": 4096, "open_files_note": "raised", "connections": 1, "max_connections": 2016}
    assert msgspec.msgpack.encode(daemon) == msgspec.msgpack.encode(old_daemon)


def test_namespaces_held_in_order() -> None:
    assert p.NamespacesReport(user=True, mount=False, pid=True, net=True).held() == ["user", "pid", "net"]
    assert p.NamespacesReport(user=False, mount=False, pid=False, net=False).held() == []


def test_a_newer_daemons_extra_key_is_read_not_refused() -> None:
    _, old = CASES["planned"]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode({**old, "something_new": 1}), type=p.Protections)
    assert back == CASES["planned"][0]


def test_a_client_that_knows_no_before_restore_reads_the_status_of_a_daemon_that_sends_it() -> None:
    class OlderDaemonReport(msgspec.Struct, frozen=True, omit_defaults=True):  # as released before the field
        open_files: int
        open_files_note: str
        connections: int
        max_connections: int

    sent = p.DaemonReport(open_files=4096, open_files_note="raised", connections=1, max_connections=2016,
                          before_restore=p.BeforeRestoreReport(path="/s/before-restore", count=3, bytes=1 << 20,
                                                               budget=8 << 30, budget_why="dispatchd's fixed bound"))
    read = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=OlderDaemonReport)
    assert read == OlderDaemonReport(open_files=4096, open_files_note="raised", connections=1, max_connections=2016)
    # ... and a newer client, an older daemon's (no such key): None.
    old = msgspec.msgpack.encode(read)
    assert msgspec.msgpack.decode(old, type=p.DaemonReport).before_restore is None

"""Network "domains": the proxy is the way out, for the hosts listed only.

A fake registry listens on the host's loopback (tests/fake_registry.py); the
daemon of this module resolves registry.test, files.registry.test and
other.test to it (a testing option). curl, Python's urllib and pip in the
session reach it through the proxy when its name is listed, and get a 403
naming the host when it is not. The escape attempts (direct TCP, UDP, DNS,
a tunnel kept across a switch) are in tests/escape/test_domains.py.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, probe, shell
from tests.fake_registry import WHEEL, FakeRegistry, domains_daemon
from tests.integration.test_cli import run


@pytest.fixture(scope="module")
def ddaemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = domains_daemon(tmp_path_factory.mktemp("domains"))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def dclient(ddaemon: Daemon) -> Iterator[dispatch.Client]:
    with ddaemon.connect() as c:
        yield c


@pytest.fixture(scope="module")
def registry() -> Iterator[FakeRegistry]:
    with FakeRegistry() as r:
        yield r


def curl(session: dispatch.Session, url: str, *flags: str) -> tuple[str, str]:
    """(HTTP status, body) of a curl run inside the session with its environment as given."""
    r = shell(session, f"curl -sS -o body.out -w '%{{http_code}}' {' '.join(flags)} {shlex.quote(url)}; "
                       "echo; cat body.out 2>/dev/null; rm -f body.out")
    code, _, body = r.metadata["stdout"].partition("\n")
    return code, body


def test_curl_urllib_and_pip_reach_a_listed_host(dclient: dispatch.Client, worktree: Path,
                                                 registry: FakeRegistry) -> None:
    host = f"registry.test:{registry.port}"
    with dclient.open_session(str(worktree), network="domains", domains=[host]) as s:
        assert s.network_mode == "domains" and s.network is True
        # Plain HTTP through the proxy, and the same through a CONNECT tunnel (-p),
        # the way https:// goes: curl only follows the variables the session has.
        assert curl(s, f"http://{host}/simple/") == ("200", "registry says hello: /simple/\n")
        assert curl(s, f"http://{host}/tunnel", "-p") == ("200", "registry says hello: /tunnel\n")
        code = f"import urllib.request; print(urllib.request.urlopen('http://{host}/urllib').read().decode(), end='')"
        assert probe(s, code) == "registry says hello: /urllib"
        r = shell(s, f"python3 -m pip download --no-deps --disable-pip-version-check -q -d dl "
                     f"--index-url http://{host}/simple/ --trusted-host registry.test demo-pkg")
        assert r.is_success, r.metadata
        assert (worktree / "dl" / WHEEL).is_file()
    # The upstream saw the URL's host, whatever the client put in Host.
    assert ("/simple/", host) in registry.requests and ("/tunnel", host) in registry.requests


def test_every_command_gets_the_proxy_variables(dclient: dispatch.Client, worktree: Path) -> None:
    with dclient.open_session(str(worktree), network="domains", domains=["pypi.org"]) as s:
        out = shell(s, "env | grep -i _proxy= | sort").metadata["stdout"].split()
    url = "http://127.0.0.1:3128"
    assert out == sorted([f"{n}={url}" for n in ("ALL_PROXY", "HTTPS_PROXY", "HTTP_PROXY", "all_proxy",
                                                  "https_proxy", "http_proxy")]
                         + [f"{n}=localhost,127.0.0.1,::1" for n in ("NO_PROXY", "no_proxy")])


def test_an_unlisted_host_gets_a_403_naming_it(dclient: dispatch.Client, worktree: Path,
                                               registry: FakeRegistry) -> None:
    listed, other = f"registry.test:{registry.port}", f"other.test:{registry.port}"
    before = len(registry.requests)
    with dclient.open_session(str(worktree), network="domains", domains=[listed]) as s:
        code, body = curl(s, f"http://{other}/nope")
        assert code == "403"
        assert f"other.test (port {registry.port}) is not in its list" in body
        assert f"Allowed: {listed}" in body
        assert f"dispatch network {s.id} domains --domains {listed},{other}" in body
        # Through a tunnel, as pip would ask for an https:// URL: the status line names it.
        tunnel = ("import http.client\nc = http.client.HTTPConnection('127.0.0.1', 3128, timeout=5)\n"
                  f"c.set_tunnel('other.test', {registry.port})\n"
                  "try:\n    c.request('GET', '/')\nexcept OSError as e:\n    print(e)\n")
        assert probe(s, tunnel) == ("Tunnel connection failed: 403 Forbidden by dispatchd: "
                                    "other.test is not in this session's domains")
        # The allowed twin: the same tunnel to the listed host.
        assert probe(s, tunnel.replace("other.test", "registry.test")
                     .replace("    c.request('GET', '/')", "    c.request('GET', '/'); print(c.getresponse().status)")
                     ) == "200"
        net = s.status()["network"]
        assert net["mode"] == "domains" and net["domains"] == [listed]
        assert [(d["host"], d["port"], d["count"]) for d in net["denied"]] == [("other.test", registry.port, 2)]
    assert [p for p, _ in registry.requests[before:]] == ["/"]  # only the twin's


# A request line through the session's proxy, and the whole answer back:
# its status line, then its body (the proxy closes after an error).
_ASK = """
import socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(("CONNECT " + TARGET + " HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n").encode("latin-1"))
got = b""
while chunk := s.recv(4096):
    got += chunk
head, _, body = got.decode().partition("\\r\\n\\r\\n")
print(head.split("\\r\\n")[0])
print(body, end="")
"""


def _ask(s: dispatch.Session, target: str) -> dispatch.Result:
    return shell(s, "/usr/bin/python3 -c " + shlex.quote(f"TARGET = {target!r}\n{_ASK}"))


# After the %: erase and move up, a forged log line (tabs: a space would end
# the request line), and a command substitution for whoever pastes a suggestion.
_ZONE = "\x1b[2K\x1b[1A\rFAKE\n2026-12-01\t04:20:00,000\tINFO\tdispatchd\tevent=session_close$(id)"


def test_an_address_with_a_zone_is_refused_and_reaches_no_log_status_or_command(
        ddaemon: Daemon, dclient: dispatch.Client, worktree: Path, registry: FakeRegistry) -> None:
    """``[fe80::1%ZONE]``: a 400 naming the address without its zone, not
    counted as a refused host, so nothing of it in ``status``, ``dispatch
    status``, a call's note or the log. The twins: ``[::1]`` is refused by
    the list as before, with a command quoted for a shell; the listed host
    is reached."""
    listed = f"registry.test:{registry.port}"
    seen = len(ddaemon.log())
    with dclient.open_session(str(worktree), network="domains", domains=[listed]) as s:
        zoned = _ask(s, f"[fe80::1%{_ZONE}]:443")
        assert zoned.metadata["stdout"] == ("HTTP/1.1 400 Bad Request\ndispatchd proxy: fe80::1%<zone>: an IPv6 "
                                            "address with a zone is refused (write the address alone)\n"), zoned
        assert "network_denied" not in zoned.metadata and zoned.output == zoned.metadata["stdout"]
        assert s.status()["network"]["denied"] == []

        loopback = _ask(s, "[::1]:443")
        head, body = loopback.metadata["stdout"].split("\n", 1)
        assert head == "HTTP/1.1 403 Forbidden by dispatchd: ::1 is not in this session's domains"
        allow = f"dispatch network {s.id} domains --domains '{listed},[::1]'"
        assert f"To allow it: {allow}\n" in body
        assert loopback.metadata["network_denied"] == ["::1:443"]
        assert loopback.output.splitlines()[-1] == (
            f"[network: dispatchd refused ::1:443 (not in this session's domains); to allow: {allow}]")
        assert [(d["host"], d["port"], d["count"]) for d in s.status()["network"]["denied"]] == [("::1", 443, 1)]
        assert curl(s, f"http://{listed}/ok")[0] == "200"

        out = run(ddaemon, "status")
        assert "denied: ::1:443 (1)" in out.stdout and "FAKE" not in out.stdout
    log = ddaemon.log()[seen:]
    assert f"event=proxy_denied session={s.id} host=::1 port=443" in log
    assert "FAKE" not in log and "\x1b" not in log


def test_wildcards_match_subdomains_only(dclient: dispatch.Client, worktree: Path, registry: FakeRegistry) -> None:
    with dclient.open_session(str(worktree), network="domains", domains=[f"*.registry.test:{registry.port}"]) as s:
        assert curl(s, f"http://files.registry.test:{registry.port}/w")[0] == "200"
        assert curl(s, f"http://registry.test:{registry.port}/w")[0] == "403"
        # The listed port only: the same host on 80 is refused.
        assert curl(s, "http://files.registry.test/w")[0] == "403"


def test_domains_from_the_policy(worktree: Path, tmp_path: Path, registry: FakeRegistry) -> None:
    import shutil

    policies = tmp_path / "policies"
    shutil.copytree(Path(__file__).resolve().parents[2] / "policies", policies)
    (policies / "registry.toml").write_text(f'[network]\ndefault = "domains"\ndomains = ["registry.test:{registry.port}"]\n')
    d = domains_daemon(tmp_path / "d", "--policies", str(policies))
    try:
        with d.connect() as c, c.open_session(str(worktree), policy="registry") as s:
            assert s.network_mode == "domains"
            assert s.status()["network"]["domains"] == [f"registry.test:{registry.port}"]
            assert curl(s, f"http://registry.test:{registry.port}/p")[0] == "200"
    finally:
        assert d.stop() == 0, d.log()


def test_bad_domains_are_refused_and_change_nothing(dclient: dispatch.Client, worktree: Path) -> None:
    with pytest.raises(dispatch.RequestFailed, match=r"domains: '127.0.0.1': the host's loopback"):
        dclient.open_session(str(worktree), network="domains", domains=["127.0.0.1"])
    with pytest.raises(dispatch.RequestFailed, match="domains are only for network 'domains', not 'on'"):
        dclient.open_session(str(worktree), network="on", domains=["pypi.org"])
    with pytest.raises(ValueError, match="domains must be a list"):
        dclient.open_session(str(worktree), network="domains", domains="pypi.org")  # type: ignore[arg-type]
    with dclient.open_session(str(worktree), network="domains", domains=["pypi.org"]) as s:
        with pytest.raises(dispatch.RequestFailed, match=r"domains: '\*\.org': a wildcard over a whole top-level"):
            s.set_network("domains", domains=["*.org"])
        assert s.status()["network"]["domains"] == ["pypi.org"]


def test_a_port_int_cannot_read_is_refused_at_open_and_switch_naming_it(dclient: dispatch.Client,
                                                                        worktree: Path) -> None:
    """'\u00b9' is a digit to ``str.isdigit``, not to ``int``: before, the open
    and the switch were answered "internal error: ValueError: ..."."""
    entry = "registry.test:\u00b9"
    why = "domains: 'registry.test:\u00b9': '\u00b9' is not a TCP port (1-65535)"
    with pytest.raises(dispatch.RequestFailed) as exc:
        dclient.open_session(str(worktree), network="domains", domains=[entry])
    assert exc.value.message == why
    # The twin: a plain port opens; the switch to the odd one is refused, the list unchanged.
    with dclient.open_session(str(worktree), network="domains", domains=["registry.test:8443"]) as s:
        with pytest.raises(dispatch.RequestFailed) as exc:
            s.set_network("domains", domains=[entry])
        assert exc.value.message == why
        assert s.status()["network"]["domains"] == ["registry.test:8443"]


def test_switching_into_within_and_out_of_domains(dclient: dispatch.Client, worktree: Path,
                                                  registry: FakeRegistry) -> None:
    a, b = f"registry.test:{registry.port}", f"files.registry.test:{registry.port}"
    with dclient.open_session(str(worktree), network=False) as s:
        assert shell(s, "env | grep -ci _proxy=").metadata["stdout"].strip() == "0"
        assert s.set_network("domains", domains=[a]) is True
        assert curl(s, f"http://{a}/1")[0] == "200" and curl(s, f"http://{b}/1")[0] == "403"
        # Within domains, only the list changes: a process started before keeps running.
        first = shell(s, "sleep 60 >/dev/null 2>&1 & echo $! > sleeper.pid", background=True)
        assert first.is_success and first.metadata["job"] == "job_1"
        assert shell(s, "while [ ! -s sleeper.pid ]; do sleep 0.02; done", timeout=5).is_success
        s.set_network("domains", domains=[b])
        assert "changed in place (no process ended)" in s.status()["note"]
        assert shell(s, "kill -0 $(cat sleeper.pid) && echo alive").metadata["stdout"].strip() == "alive"
        assert curl(s, f"http://{a}/2")[0] == "403" and curl(s, f"http://{b}/2")[0] == "200"
        # Out of domains: the sandbox is replaced, the variables are gone.
        assert s.set_network(True) is True
        assert shell(s, "env | grep -ci _proxy=").metadata["stdout"].strip() == "0"
        # The new sandbox's jobs take ids its first never gave: a job_stop of
        # the old job_1 stops no new job (before: ids started again at job_1).
        after = shell(s, "true", background=True)
        assert after.is_success and after.metadata["job"] == "job_2", after.metadata
        stopped = s.registry.get("job_stop").call({"job": "job_1"})
        assert stopped.is_failure and "no background job 'job_1'" in (stopped.error or ""), stopped
        net = s.status()["network"]
        assert net["mode"] == "on" and net["domains"] == []
        assert [d["host"] for d in net["denied"]] == ["registry.test", "files.registry.test"]  # the history stays
        s.set_network("domains", domains=[a])
        assert curl(s, f"http://{a}/3")[0] == "200"
        assert s.set_network(False) is False
        assert s.status()["network"]["mode"] == "off"


def test_cli_spellings(ddaemon: Daemon, dclient: dispatch.Client, worktree: Path, registry: FakeRegistry) -> None:
    a, b = f"registry.test:{registry.port}", f"files.registry.test:{registry.port}"
    out = run(ddaemon, "session", "open", "--worktree", str(worktree), "--network", "domains", "--domains", a)
    assert out.returncode == 0, out.stderr
    sid = out.stdout.strip()
    try:
        out = run(ddaemon, "exec", "--session", sid, "--", "curl", "-sS", f"http://{a}/cli")
        assert (out.returncode, out.stdout) == (0, "registry says hello: /cli\n"), out.stderr
        out = run(ddaemon, "network", sid, "domains", "--domains", f"{a},{b}")
        assert out.returncode == 0 and out.stdout == "domains\n", out.stderr
        assert "changed in place" in out.stderr
        out = run(ddaemon, "exec", "--session", sid, "--", "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                  f"http://other.test:{registry.port}/")
        assert out.stdout == "403"
        out = run(ddaemon, "status")
        assert f"domains: {a}, {b}" in out.stdout and f"denied: other.test:{registry.port} (1)" in out.stdout
        out = run(ddaemon, "session", "list", "--json")
        mine = [x for x in json.loads(out.stdout) if x["id"] == sid][0]
        assert (mine["network"], mine["domains"]) == ("domains", [a, b])
    finally:
        with contextlib.suppress(dispatch.RequestFailed):
            dclient.close_session(sid)
    # One-off sessions: exec and call with --worktree.
    out = run(ddaemon, "exec", "--worktree", str(worktree), "--network", "domains", "--domains", a, "--",
              "curl", "-sS", f"http://{a}/oneoff")
    assert (out.returncode, out.stdout) == (0, "registry says hello: /oneoff\n"), out.stderr
    out = run(ddaemon, "call", "--worktree", str(worktree), "--network", "domains", "--domains", a, "shell_exec",
              json.dumps({"command": f"curl -sS http://{a}/call"}))
    assert out.returncode == 0 and json.loads(out.stdout)["metadata"]["stdout"] == "registry says hello: /call\n"
    out = run(ddaemon, "exec", "--worktree", str(worktree), "--network", "on", "--domains", a, "--", "true")
    assert out.returncode == 2 and "domains are only for network 'domains'" in out.stderr


def test_mcp_takes_the_domains_options() -> None:
    from dispatch.cli import _parser

    args = _parser().parse_args(["mcp", "--worktree", "/w", "--network", "domains", "--domains", "a.org, *.b.org"])
    assert (args.network, args.domains) == ("domains", ["a.org", "*.b.org"])


def test_degraded_mode_refuses_domains(tmp_path: Path, worktree: Path) -> None:
    """Without a network namespace of its own, a session would reach the host's
    network directly: "domains" is refused, at open and at a switch, saying why."""
    d = domains_daemon(tmp_path / "degraded", "--no-user-namespaces")
    try:
        with d.connect() as c:
            with pytest.raises(dispatch.RequestFailed) as exc:
                c.open_session(str(worktree), network="domains", domains=["pypi.org"])
            assert exc.value.code == "confinement_failed"
            assert "network 'domains' needs a network namespace of its own" in exc.value.message
            with c.open_session(str(worktree), network=True) as s:  # the allowed twin
                with pytest.raises(dispatch.RequestFailed, match="needs a network namespace of its own"):
                    s.set_network("domains", domains=["pypi.org"])
                assert s.network_mode == "on" and shell(s, "true").is_success  # unchanged, still open
    finally:
        assert d.stop() == 0, d.log()

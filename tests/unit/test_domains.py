"""dispatchd.domains: rules, host spellings and matching, by equality."""

from __future__ import annotations

import pytest

from dispatchd.domains import (
    BadHost, Rule, allowed, describe, normalise_host, parse_domains, parse_port, proxy_env, relayable,
)


def test_parse_domains_spellings():
    rules = parse_domains(["PyPI.org.", "*.pythonhosted.org", "Bücher.example", "[2001:db8::1]:8443",
                           "203.0.113.7", "registry.test:8080", "pypi.org"])
    assert rules == (
        Rule("pypi.org"),
        Rule("pythonhosted.org", wildcard=True),
        Rule("xn--bcher-kva.example"),
        Rule("2001:db8::1", ports=(8443,), ip=True),
        Rule("203.0.113.7", ip=True),
        Rule("registry.test", ports=(8080,)),
    )  # the repeated pypi.org once
    assert describe(rules) == ["pypi.org", "*.pythonhosted.org", "xn--bcher-kva.example", "[2001:db8::1]:8443",
                               "203.0.113.7", "registry.test:8080"]


@pytest.mark.parametrize("entry, why", [
    ("", "an empty entry"),
    ("127.1", "'127.1' looks like a numeric address, not a name"),
    ("0x7f.1", "looks like a numeric address"),
    ("2130706433", "looks like a numeric address"),
    ("*.org", "a wildcard over a whole top-level domain is too broad"),
    ("a*.b.org", "a wildcard is only allowed as the whole first label"),
    ("*.*.b.org", "a wildcard is only allowed as the whole first label"),
    ("*.203.0.113.7", "a wildcard cannot apply to an IP address"),
    ("127.0.0.1", "the host's loopback, link-local, cloud metadata and unspecified addresses are never relayed"),
    ("[::1]", "never relayed"),
    ("::ffff:127.0.0.1", "never relayed"),
    ("169.254.169.254", "never relayed"),
    ("[fd00:ec2::254]", "never relayed"),
    ("100.100.100.200", "never relayed"),
    ("0.0.0.0", "never relayed"),
    ("foo..bar", "is not a host name"),
    ("foo bar.org", "is not a host name"),
    ("a.org:0", "'0' is not a TCP port"),
    ("a.org:http", "'http' is not a TCP port"),
    ("[2001:db8::1", "unclosed '['"),
    ("x" * 64 + ".org", "is not a host name"),
])
def test_bad_entries_are_refused_with_the_reason(entry: str, why: str):
    with pytest.raises(BadHost, match=None) as exc:
        parse_domains([entry])
    assert why in str(exc.value)


def test_too_many_entries():
    with pytest.raises(BadHost, match="at most 256"):
        parse_domains([f"h{i}.org" for i in range(257)])


RULES = parse_domains(["pypi.org", "*.pythonhosted.org", "203.0.113.7", "registry.test:8080"])


@pytest.mark.parametrize("host, port, expected", [
    ("pypi.org", 443, True),
    ("pypi.org", 80, True),
    ("pypi.org", 22, False),  # 80 and 443 only, unless a port is named
    ("www.pypi.org", 443, False),  # no wildcard: the name itself only
    ("files.pythonhosted.org", 443, True),
    ("a.b.pythonhosted.org", 443, True),
    ("pythonhosted.org", 443, False),  # a wildcard is for subdomains only
    ("evilpythonhosted.org", 443, False),
    ("pythonhosted.org.evil.com", 443, False),
    ("203.0.113.7", 443, True),
    ("203.0.113.8", 443, False),
    ("registry.test", 8080, True),
    ("registry.test", 443, False),
])
def test_allowed(host: str, port: int, expected: bool):
    assert allowed(RULES, normalise_host(host), port) is expected


def test_a_wildcard_never_matches_an_ip_literal():
    assert allowed(parse_domains(["*.0.113.7.example"]), "203.0.113.7", 443) is False


@pytest.mark.parametrize("host, norm", [
    ("PyPI.ORG.", "pypi.org"),
    ("bücher.example", "xn--bcher-kva.example"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("[2001:DB8:0::1]", "2001:db8::1"),
    ("::ffff:203.0.113.7", "203.0.113.7"),  # a mapped address is the IPv4 one
])
def test_normalise_host(host: str, norm: str):
    assert normalise_host(host) == norm


@pytest.mark.parametrize("address, ok", [
    ("93.184.216.34", True), ("10.1.2.3", True), ("2001:db8::1", True),
    ("127.0.0.1", False), ("127.9.9.9", False), ("::1", False), ("::ffff:127.0.0.1", False),
    ("0.0.0.0", False), ("0.1.2.3", False), ("::", False), ("169.254.169.254", False), ("fe80::1%eth0", False),
    ("224.0.0.1", False), ("255.255.255.255", False), ("not-an-address", False),
    # Cloud metadata outside link-local (AWS over IPv6, Alibaba Cloud); their neighbours are ordinary addresses.
    ("fd00:ec2::254", False), ("::ffff:100.100.100.200", False), ("100.100.100.200", False),
    ("fd00:ec2::253", True), ("100.100.100.100", True),
])
def test_relayable(address: str, ok: bool):
    assert relayable(address) is ok


def test_proxy_env_sets_both_cases():
    env = proxy_env()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        assert env[name] == env[name.lower()] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    assert len(env) == 8


@pytest.mark.parametrize("host", [
    "[fe80::1%eth0]", "fe80::1%eth0", "[fe80::1%$(id)]", "[fe80::1%\x1b[2K\nFAKE]", "[::ffff:1.2.3.4%x]",
    "[2001:db8::1%" + "a" * 16000 + "]",
])
def test_an_ipv6_address_with_a_zone_is_refused_without_echoing_the_zone(host: str) -> None:
    """``ipaddress`` keeps anything after the ``%`` (a newline, ESC,
    ``$(...)``): refused, and the message names the address alone."""
    with pytest.raises(BadHost) as exc:
        normalise_host(host)
    address = host.strip("[]").split("%")[0]
    address = "::ffff:102:304" if address == "::ffff:1.2.3.4" else address
    assert str(exc.value) == f"{address}%<zone>: an IPv6 address with a zone is refused (write the address alone)"


def test_a_zone_in_a_domains_entry_is_refused_naming_the_entry() -> None:
    with pytest.raises(BadHost) as exc:
        parse_domains(["[fe80::1%eth0]:8443"])
    assert str(exc.value) == ("'[fe80::1%eth0]:8443': fe80::1%<zone>: an IPv6 address with a zone is refused "
                              "(write the address alone)")


@pytest.mark.parametrize("host, norm", [
    ("[::1]", "::1"), ("::1", "::1"), ("[2001:DB8::1]", "2001:db8::1"), ("fe80::1", "fe80::1"), ("203.0.113.7", "203.0.113.7"),
])
def test_an_address_without_a_zone_is_accepted_as_before(host: str, norm: str) -> None:
    assert normalise_host(host) == norm


@pytest.mark.parametrize("host", [
    "example.com", "Bücher.example", "[2001:db8::1]", "::ffff:203.0.113.7", "a_b.example.", "xn--bcher-kva.example",
])
def test_a_normalised_host_is_only_ever_name_or_address_characters(host: str) -> None:
    """What the proxy logs, counts in ``denied`` and puts in the command it
    suggests: nothing a shell or a terminal reads as more than a word."""
    import re

    assert re.fullmatch(r"[a-z0-9_.-]+|[0-9a-f:.]+", normalise_host(host))


# str.isdigit() is True for each, int() reads none (the last is past Python's
# 4,300 digits): an entry with one was a ValueError, which the daemon
# answered "internal error: ValueError: ..." at an open or a switch.
ODD_PORTS = {"superscript-one": "\u00b9", "superscript-two-three": "4\u00b2\u00b3", "5000-digits": "4" * 5000}


@pytest.mark.parametrize("port", ODD_PORTS.values(), ids=ODD_PORTS.keys())
def test_an_entry_whose_port_int_cannot_read_is_a_bad_host_naming_it(port: str) -> None:
    with pytest.raises(BadHost) as exc:
        parse_domains([f"registry.test:{port}"])
    assert str(exc.value) == f"{f'registry.test:{port}'!r}: {port!r} is not a TCP port (1-65535)"
    with pytest.raises(BadHost) as exc:
        parse_domains([f"[2001:db8::1]:{port}"])
    assert str(exc.value) == f"{f'[2001:db8::1]:{port}'!r}: {port!r} is not a TCP port (1-65535)"


def test_the_twin_entries_with_plain_ports_parse() -> None:
    assert [r.ports for r in parse_domains(["registry.test:8443", "[2001:db8::1]:1", "a.test:65535"])] == [
        (8443,), (1,), (65535,)]


@pytest.mark.parametrize(("text", "port"), [
    ("1", 1), ("443", 443), ("65535", 65535), ("08443", 8443),
    ("0", None), ("65536", None), ("000443", None), ("", None), ("+443", None), ("-1", None), (" 443", None),
    ("443\n", None), ("\u0664\u0664\u0663", None), ("\uff14\uff14\uff13", None), ("\u00b9", None), ("4" * 5000, None),
])
def test_parse_port_reads_ascii_digits_in_range_only(text: str, port: int | None) -> None:
    # Arabic-Indic and fullwidth digits: int() reads them, a port is not written so.
    assert parse_port(text) == port

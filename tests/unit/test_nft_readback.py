"""The rules read back after libnftables committed them
(``netstack.rules_hold``): its return code alone is not taken as the rules
holding. Pure; the escape suite commits real rules in a session's namespace."""

from __future__ import annotations

from dispatchd.confine import netstack
from dispatchd.confine.netstack import NetworkPorts

INPUT = """\tchain input {
\t\ttype filter hook input priority filter; policy drop;
\t\tiif "lo" accept
\t\tct state established,related accept
\t}

\tchain untracked_out {
\t\ttype filter hook output priority raw; policy accept;
\t\toif "lo" notrack
\t}

\tchain untracked_in {
\t\ttype filter hook prerouting priority raw; policy accept;
\t\tiif "lo" notrack
\t}

"""
LISTED = """table inet dispatchd {
""" + INPUT + """\tchain output {
\t\ttype filter hook output priority filter; policy accept;
\t\toif "lo" accept
\t\tmeta l4proto { tcp, udp } th dport { 80, 443 } accept
\t\treject with icmpx admin-prohibited
\t}
}
"""


MOVED = """
\tchain postrouting {
\t\ttype nat hook postrouting priority srcnat; policy accept;
\t\toifname "eth0" meta l4proto udp masquerade to :32768-60999 random
\t}
}
"""
ON = "table inet dispatchd {\n" + INPUT.rstrip("\n") + "\n}\n"


def test_the_ports_table_as_nft_lists_it_holds() -> None:
    rules = netstack.nft_rules("ports", NetworkPorts(connect=[443, 80]))
    assert netstack.rules_hold(rules, LISTED) == ""


def test_the_on_table_and_pasta_s_as_nft_lists_them_hold() -> None:
    assert netstack.rules_hold(netstack.nft_rules("on", NetworkPorts(connect=[]), "slirp4netns"), ON) == ""
    assert netstack.rules_hold(netstack.nft_rules("on", NetworkPorts(connect=[]), "pasta"),
                               ON[:-2] + MOVED) == ""
    assert netstack.rules_hold(netstack.nft_rules("ports", NetworkPorts(connect=[443]), "pasta"),
                               LISTED[:-2] + MOVED) == ""


def test_an_input_chain_that_lets_more_in_does_not_hold() -> None:
    rules = netstack.nft_rules("on", NetworkPorts(connect=[]), "slirp4netns")
    assert netstack.rules_hold(rules, ON.replace("policy drop", "policy accept")) == (
        "nft: the rules were committed, but the table inet dispatchd has no 'policy drop'")
    assert netstack.rules_hold(rules, ON.replace("hook input", "hook forward")) == (
        "nft: the rules were committed, but the table inet dispatchd has no 'hook input'")
    assert netstack.rules_hold(rules, ON.replace("\t\tct state established,related accept\n", "")) == (
        "nft: the rules were committed, but the table inet dispatchd has no 'ct state established,related accept'")


def test_loopback_tracked_again_does_not_hold() -> None:
    rules = netstack.nft_rules("on", NetworkPorts(connect=[]), "slirp4netns")
    assert netstack.rules_hold(rules, ON.replace('\t\toif "lo" notrack\n', "")) == (
        "nft: the rules were committed, but the table inet dispatchd has no 'oif \"lo\" notrack'")


def test_pasta_s_source_ports_not_moved_do_not_hold() -> None:
    rules = netstack.nft_rules("on", NetworkPorts(connect=[]), "pasta")
    assert netstack.rules_hold(rules, ON) == ("nft: the rules were committed, but the table inet dispatchd has no "
                                              "'hook postrouting'")
    assert netstack.rules_hold(rules, ON[:-2] + MOVED.replace(" random", "")) == (
        "nft: the rules were committed, but the table inet dispatchd has no 'masquerade to :32768-60999 random'")


def test_a_ports_table_missing_or_without_its_reject_does_not_hold() -> None:
    rules = netstack.nft_rules("ports", NetworkPorts(connect=[443]))
    assert netstack.rules_hold(rules, None) == ("nft: the rules were committed, but the table inet dispatchd "
                                                "is not there")
    without = LISTED.replace("\t\treject with icmpx admin-prohibited\n", "")
    assert netstack.rules_hold(rules, without) == ("nft: the rules were committed, but the table inet dispatchd "
                                                   "has no 'reject with icmpx admin-prohibited'")


def test_a_removed_table_holds_only_when_it_is_gone() -> None:
    assert netstack.rules_hold(netstack.reset_rules(), None) == ""
    assert netstack.rules_hold(netstack.reset_rules(), LISTED) == ("nft: the table inet dispatchd is still there "
                                                                   "after its removal")
    assert netstack.nft_rules("off", NetworkPorts(connect=[])) == netstack.reset_rules()

"""The rules read back after libnftables committed them
(``netstack.rules_hold``): its return code alone is not taken as the rules
holding. Pure; the escape suite commits real rules in a session's namespace."""

from __future__ import annotations

from dispatchd.confine import netstack
from dispatchd.confine.netstack import NetworkPorts

LISTED = """table inet dispatchd {
\tchain output {
\t\ttype filter hook output priority filter; policy accept;
\t\toif "lo" accept
\t\tmeta l4proto { tcp, udp } th dport { 80, 443 } accept
\t\treject with icmpx admin-prohibited
\t}
}
"""


def test_the_ports_table_as_nft_lists_it_holds() -> None:
    rules = netstack.nft_rules("ports", NetworkPorts(connect=[443, 80]))
    assert netstack.rules_hold(rules, LISTED) == ""


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
    assert netstack.nft_rules("on", NetworkPorts(connect=[])) == netstack.reset_rules()

"""The network arguments of ``open_session`` and ``set_network``, in the words
the daemon takes: ``True``/``False`` or a mode's name; a list of host names.
A wrong one raises ``ValueError`` before anything is sent."""

from __future__ import annotations

from typing import overload

from dispatchd.netmodes import NETWORK_MODES, NetworkMode

__all__ = ["domain_list", "network_word"]


@overload
def network_word(network: bool | str) -> NetworkMode: ...
@overload
def network_word(network: None) -> None: ...
def network_word(network: bool | str | None) -> NetworkMode | None:
    if network is None:
        return None
    if isinstance(network, bool):
        return "on" if network else "off"
    for mode in NETWORK_MODES:
        if network == mode:
            return mode
    raise ValueError(f"network must be True, False or one of {', '.join(map(repr, NETWORK_MODES))}, not {network!r}")


def domain_list(domains: list[str] | None) -> list[str] | None:
    if domains is None:
        return None
    if isinstance(domains, str):  # "pypi.org" would otherwise be eight one-letter hosts
        raise ValueError(f"domains must be a list of host names, not the string {domains!r}")
    return list(domains)

"""The network modes a session can have, spelled once.

Guarantees:
- ``NetworkMode`` is the one type of a session's network setting, used by
  the wire protocol, the policy, the confinement plan and the CLI; a value
  outside it is refused where it comes in (msgspec decodes the Literal).
- ``NETWORK_MODES`` lists the same values, in the order messages give them.

What each mode means: "off" (no network), "on" (the host's network, through
the session's own stack where there is one), "ports" (TCP only to and on the
policy's ports) and "domains" (only the named hosts, through the daemon's
filtering proxy); see confine/netstack.py and domains.py.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["NETWORK_MODES", "NetworkMode"]

NetworkMode = Literal["off", "on", "ports", "domains"]
NETWORK_MODES: tuple[NetworkMode, ...] = get_args(NetworkMode)

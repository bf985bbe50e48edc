"""dispatchd: a sandboxed execution daemon for AI coding agents.

Kept import-light on purpose: the client imports ``dispatchd.protocol`` and
``dispatchd.paths`` and should not pay for the daemon.
"""

__version__ = "0.1.0"

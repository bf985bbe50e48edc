"""Run a command where new user namespaces are refused, as a container
engine's default seccomp profile refuses them (and as Ubuntu's AppArmor
restriction leaves the daemon's probe): ``unshare``/``clone`` with
``CLONE_NEWUSER`` and ``setns`` answer EPERM, ``clone3`` ENOSYS (so that libc
falls back to ``clone``, as under Docker's profile).

    python tests/deny_user_namespaces.py COMMAND [ARG...]

A filter installed here holds for the command and everything it starts; it
only takes away (no_new_privs is set first).
"""

from __future__ import annotations

import errno
import os
import sys

import pyseccomp as sc

CLONE_NEWUSER = 0x10000000


def main(argv: list[str]) -> None:
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in ("unshare", "clone"):
        filt.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    filt.add_rule(sc.ERRNO(errno.EPERM), "setns")
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    filt.load()
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])

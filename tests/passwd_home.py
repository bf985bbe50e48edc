"""Run dispatchd as if the passwd entry of the uid named another home: a
daemon whose table of worktrees in use (``dispatchd/daemon/inusedir.py``) is
elsewhere than every other test daemon's, for tests that break that table.

    python tests/passwd_home.py HOME PYTHON -m dispatchd [ARG...]

Only ``pwd.getpwuid``'s answer changes, in this process and those it forks;
``$HOME`` and ``XDG_*`` are left as they are (the daemon reads neither for
the table).
"""

from __future__ import annotations

import os
import pwd
import runpy
import sys


def main(argv: list[str]) -> None:
    home, rest = argv[0], argv[1:]
    if rest[1:3] != ["-m", "dispatchd"]:
        raise SystemExit("usage: passwd_home.py HOME PYTHON -m dispatchd [ARG...]")
    real = pwd.getpwuid

    def getpwuid(uid: int) -> pwd.struct_passwd:
        e = real(uid)
        return pwd.struct_passwd((e.pw_name, e.pw_passwd, e.pw_uid, e.pw_gid, e.pw_gecos, home, e.pw_shell))

    pwd.getpwuid = getpwuid
    sys.path[0] = os.getcwd()  # as ``-m`` has it, not this script's directory (tests/)
    sys.argv = ["dispatchd", *rest[3:]]
    runpy.run_module("dispatchd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Run dispatchd as if its disk had no room left while the file FLAG holds
a word: the end's rename of a plant to its longer aside name fails with
ENOSPC (what a full ext4 directory does: the new name needs a block), and
so do the copies of a checkpoint.

    python tests/no_room.py FLAG PYTHON -m dispatchd [ARG...]

FLAG's word: ``always`` (no room at all), or ``until-ballast`` (room once
the daemon's ballast, ``$XDG_STATE_HOME/dispatchd/ballast``, is freed: what
removing it does on a real disk). No file, or an empty one: room. Only the
renames of ``fs._rename`` (the move aside's one rename) and the copies of
``checkpoints.store._clone_fd`` change; everything else is the daemon's
own: no unprivileged test can fill a real directory's blocks (tmpfs needs
none for a rename), so the kernel's answer is stood in for here.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
from typing import Any


def main(argv: list[str]) -> None:
    flag, rest = argv[0], argv[1:]
    if rest[1:3] != ["-m", "dispatchd"]:
        raise SystemExit("usage: no_room.py FLAG PYTHON -m dispatchd [ARG...]")
    sys.path[0] = os.getcwd()  # as ``-m`` has it, not this script's directory (tests/)
    from dispatchd import paths
    from dispatchd.daemon.checkpoints import store
    from dispatchd.daemon.gitguard import fs

    ballast = os.path.join(paths.state_dir(), "ballast")

    def full() -> bool:
        try:
            with open(flag, encoding="ascii") as f:
                word = f.read().strip()
        except FileNotFoundError:
            return False
        return word == "always" or (word == "until-ballast" and os.path.exists(ballast))

    real_rename, real_clone = fs._rename, store._clone_fd

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        if full():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_rename(src, dst, **kw)

    def clone(*args: Any) -> Any:
        if full():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_clone(*args)

    fs._rename = rename
    store._clone_fd = clone
    sys.argv = ["dispatchd", *rest[3:]]
    runpy.run_module("dispatchd", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])

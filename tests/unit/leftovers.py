"""What a killed daemon leaves beside git's files, made by hand in a test:
its temporaries are the daemon's only once written down in its journal
(``gitguard/ournames.py``), as the daemon writes down each one it makes."""

from __future__ import annotations

import os
from pathlib import Path

from dispatchd.daemon.gitguard import ournames


def adopt(*dirs: Path) -> None:
    """Each regular file of a temporary's shape in ``dirs`` written down as the daemon's."""
    for d in dirs:
        for name in os.listdir(d):
            st = os.lstat(d / name)
            if ournames.shaped(name) is not None and os.path.isfile(d / name) and not os.path.islink(d / name):
                ournames.note(str(d / name), st)

"""The files a dynamically linked program opens to start: its ELF
interpreter and the shared libraries the system's dynamic loader finds for
it, found without running the program.

Why: a program dispatchd confines with Landlock before its exec
(slirp4netns, ``stacks.py``) may read and execute only what its rules name.
The system's directories cover a packaged program; one built into /opt,
a home directory or a Nix store finds its libraries there, through its
RUNPATH or the loader's cache, and could not load them: every network-on
open failed with the loader's "Permission denied".

Guarantees:
- nothing of the program runs: its interpreter is read from its ELF header
  (``PT_INTERP``), and its libraries are listed by this process's own
  loader (``ld.so --list``), which maps them and exits before running any
  code of theirs or of the program's, with the environment the program is
  started with (no ``LD_LIBRARY_PATH``: the same search);
- each file is given by its real path (a rule binds to the inode; a
  symlink's target is what the loader opens);
- what cannot be listed (not an ELF file, a static program, a loader that
  refuses, a timeout) gives what could be read, and says why: the caller's
  rules stay as they were, and the program's own start names what it lacks.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
from collections.abc import Callable, Mapping

LIST_TIMEOUT_S = 10.0
PT_INTERP = 3
_ELF_MAGIC = b"\x7fELF"
# "libslirp.so.0 => /opt/lib/libslirp.so.0 (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)";
# "linux-vdso.so.1 (0x...)" is in no file, and "libx.so => not found" names none.
_LISTED = re.compile(r"^\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)\s*$")

Run = Callable[..., "subprocess.CompletedProcess[str]"]


def interpreter(path: str) -> str:
    """The program's ELF interpreter (``PT_INTERP``), or "" (not an ELF
    file, or a static one). Raises ``OSError`` when it cannot be read."""
    with open(path, "rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != _ELF_MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            return ""
        wide, order = ident[4] == 2, "<" if ident[5] == 1 else ">"
        header = f.read(48 if wide else 36)
        if len(header) < (48 if wide else 36):
            return ""
        if wide:
            phoff, = struct.unpack_from(order + "Q", header, 16)
            phentsize, phnum = struct.unpack_from(order + "HH", header, 38)
        else:
            phoff, = struct.unpack_from(order + "I", header, 12)
            phentsize, phnum = struct.unpack_from(order + "HH", header, 26)
        for i in range(min(phnum, 256)):
            f.seek(phoff + i * phentsize)
            entry = f.read(phentsize)
            if len(entry) < (56 if wide else 32):
                return ""
            kind, = struct.unpack_from(order + "I", entry, 0)
            if kind != PT_INTERP:
                continue
            if wide:
                offset, = struct.unpack_from(order + "Q", entry, 8)
                size, = struct.unpack_from(order + "Q", entry, 32)
            else:
                offset, = struct.unpack_from(order + "I", entry, 4)
                size, = struct.unpack_from(order + "I", entry, 16)
            f.seek(offset)
            return f.read(min(size, 4096)).split(b"\0", 1)[0].decode(errors="replace")
    return ""


def parse_list(output: str) -> list[str]:
    """The files a loader's ``--list`` names, in its order, each once. Pure."""
    found: list[str] = []
    for line in output.splitlines():
        m = _LISTED.match(line)
        if m and m.group(1) not in found:
            found.append(m.group(1))
    return found


def loaded_files(program: str, env: Mapping[str, str], *, run: Run = subprocess.run,
                 loader: str | None = None) -> tuple[list[str], str]:
    """The real paths of ``program``'s interpreter and of the libraries the
    loader finds for it started with ``env``, and "" ; or what could be
    found and why the rest could not. ``loader``: the one that lists them
    (default: this process's own, from ``/proc/self/exe``)."""
    try:
        own = interpreter(program)
    except OSError as exc:
        return [], f"cannot read {program}: {exc.strerror}"
    if not own:
        return [], ""  # not dynamically linked (or not ELF): it loads nothing
    files = [os.path.realpath(own)]
    try:
        lister = loader if loader is not None else interpreter("/proc/self/exe")
    except OSError as exc:
        return files, f"cannot find this process's loader: {exc.strerror}"
    if not lister:
        return files, "this process has no dynamic loader to list the libraries with"
    try:
        done = run([lister, "--list", program], env=dict(env), capture_output=True, text=True,
                   timeout=LIST_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return files, f"{lister} --list {program}: {exc}"
    for path in parse_list(done.stdout):
        real = os.path.realpath(path)
        if real not in files:
            files.append(real)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return files, f"{lister} --list {program}: " + (lines[-1] if lines else f"exit status {done.returncode}")
    return files, ""

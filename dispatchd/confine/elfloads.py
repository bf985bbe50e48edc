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
  loader (``ld.so --list``), which maps them and exits before relocating
  or running any code of theirs or of the program's, with the environment
  the program is started with (no ``LD_LIBRARY_PATH``: the same search).
  Audit libraries are the exception (a loader runs them even to list): a
  program that names one (``DT_AUDIT``, ``DT_DEPAUDIT``) is not listed;
- each file is given by its real path (a rule binds to the inode; a
  symlink's target is what the loader opens), and only if it is a regular
  ELF file (a ``DT_NEEDED`` name with a newline can make up a line of the
  list); the stack's rules then grant each file alone, and its start fails
  if one is no longer that file (``landlock.PathRule.file_only``);
- what cannot be listed (not an ELF file, a static program, a loader that
  refuses, a timeout) gives what could be read, and says why: the caller's
  rules stay as they were, and the program's own start names what it lacks.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import subprocess
from collections.abc import Callable, Mapping
from typing import BinaryIO

LIST_TIMEOUT_S = 10.0
PT_INTERP = 3
PT_DYNAMIC = 2
DT_AUDIT = 0x6FFFFEFC
DT_DEPAUDIT = 0x6FFFFEFB
_ELF_MAGIC = b"\x7fELF"
# "libslirp.so.0 => /opt/lib/libslirp.so.0 (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)";
# "linux-vdso.so.1 (0x...)" is in no file, and "libx.so => not found" names none.
_LISTED = re.compile(rb"^\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)\s*$")

Run = Callable[..., "subprocess.CompletedProcess[bytes]"]


class _Elf:
    """An ELF file's header and program headers, read, never run."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.headers: list[tuple[int, int, int]] = []  # (type, offset, size in the file)
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != _ELF_MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            return
        self.wide, self.order = ident[4] == 2, "<" if ident[5] == 1 else ">"
        header = f.read(48 if self.wide else 36)
        if len(header) < (48 if self.wide else 36):
            return
        if self.wide:
            phoff, = struct.unpack_from(self.order + "Q", header, 16)
            phentsize, phnum = struct.unpack_from(self.order + "HH", header, 38)
        else:
            phoff, = struct.unpack_from(self.order + "I", header, 12)
            phentsize, phnum = struct.unpack_from(self.order + "HH", header, 26)
        for i in range(min(phnum, 256)):
            f.seek(phoff + i * phentsize)
            entry = f.read(phentsize)
            if len(entry) < (56 if self.wide else 32):
                return
            kind, = struct.unpack_from(self.order + "I", entry, 0)
            if self.wide:
                offset, = struct.unpack_from(self.order + "Q", entry, 8)
                size, = struct.unpack_from(self.order + "Q", entry, 32)
            else:
                offset, = struct.unpack_from(self.order + "I", entry, 4)
                size, = struct.unpack_from(self.order + "I", entry, 16)
            self.headers.append((kind, offset, size))

    def segment(self, kind: int, limit: int) -> bytes | None:
        for k, offset, size in self.headers:
            if k == kind:
                self.f.seek(offset)
                return self.f.read(min(size, limit))
        return None

    def dynamic_tags(self) -> set[int]:
        """The tags of the dynamic section (``PT_DYNAMIC``), up to ``DT_NULL``."""
        data = self.segment(PT_DYNAMIC, 1 << 20) or b""
        step, fmt = (16, self.order + "q") if self.wide else (8, self.order + "i")
        tags = set()
        for at in range(0, len(data) - step + 1, step):
            tag, = struct.unpack_from(fmt, data, at)
            if tag == 0:
                break
            tags.add(tag)
        return tags


def interpreter(path: str) -> str:
    """The program's ELF interpreter (``PT_INTERP``), or "" (not an ELF
    file, or a static one). Raises ``OSError`` when it cannot be read."""
    with open(path, "rb") as f:
        found = _Elf(f).segment(PT_INTERP, 4096)
    return "" if found is None else os.fsdecode(found.split(b"\0", 1)[0])


def audit_libraries(path: str) -> bool:
    """Whether the program names audit libraries (``DT_AUDIT``,
    ``DT_DEPAUDIT``): a loader loads and runs them even when it only lists
    what the program loads. Raises ``OSError`` when it cannot be read."""
    with open(path, "rb") as f:
        elf = _Elf(f)
        return bool(elf.headers) and bool(elf.dynamic_tags() & {DT_AUDIT, DT_DEPAUDIT})


def _library(path: str) -> bool:
    """A regular file that is an ELF object: what a loader's list may name
    (a name with a newline in a program's DT_NEEDED can make up a line)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 4) == _ELF_MAGIC
    finally:
        os.close(fd)


def parse_list(output: bytes) -> list[str]:
    """The files a loader's ``--list`` names, in its order, each once (names
    as the file system has them: bytes, decoded as ``os.fsdecode``). Pure."""
    found: list[str] = []
    for line in output.split(b"\n"):
        m = _LISTED.match(line)
        if m:
            path = os.fsdecode(m.group(1))
            if path not in found:
                found.append(path)
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
    try:
        if audit_libraries(program):
            return [], f"{program} names audit libraries (DT_AUDIT), which a loader runs even to list: not listed"
    except OSError as exc:
        return [], f"cannot read {program}: {exc.strerror}"
    files = [os.path.realpath(own)]
    try:
        lister = loader if loader is not None else interpreter("/proc/self/exe")
    except OSError as exc:
        return files, f"cannot find this process's loader: {exc.strerror}"
    if not lister:
        return files, "this process has no dynamic loader to list the libraries with"
    try:
        done = run([lister, "--list", program], env=dict(env), capture_output=True,
                   timeout=LIST_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return files, f"{lister} --list {program}: {exc}"
    odd: list[str] = []
    for path in parse_list(done.stdout):
        real = os.path.realpath(path)
        if not _library(real):
            odd.append(real)  # not an ELF file: no rule for it
        elif real not in files:
            files.append(real)
    if done.returncode != 0:
        lines = os.fsdecode(done.stderr or done.stdout).strip().splitlines()
        return files, f"{lister} --list {program}: " + (lines[-1] if lines else f"exit status {done.returncode}")
    if odd:
        return files, f"{lister} --list {program} named files that are not ELF objects, left out: {', '.join(odd)}"
    return files, ""

"""dispatchd.confine.elfloads: a program's interpreter read from its ELF
header, the loader's list parsed, and the files found, with a stand-in
loader and the real one. A stack that loads its libraries from outside the
system's directories, run confined, is in
tests/integration/test_stack_choice.py."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dispatchd.confine import elfloads


def _elf(path: Path, interp: bytes | None, *, wide: bool = True, dynamic: list[int] | None = None) -> None:
    """A minimal ELF file: its header, a program header (PT_INTERP naming
    ``interp``, or PT_LOAD without), with ``dynamic`` a PT_DYNAMIC one whose
    section holds those tags (each with value 0, then DT_NULL); then their
    contents."""
    ehsize, phentsize = (64, 56) if wide else (52, 32)
    count = 1 + (dynamic is not None)
    name_at = ehsize + phentsize * count
    name = (interp or b"") + b"\0"
    entry = "<qQ" if wide else "<iI"
    tags = b"".join(struct.pack(entry, t, 0) for t in [*(dynamic or []), 0])
    tags_at = name_at + len(name)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1, 1]) + bytes(9)
    kind = elfloads.PT_INTERP if interp is not None else 1
    if wide:
        header = struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, ehsize, 0, 0, ehsize, phentsize, count, 64, 0, 0)
        phdrs = struct.pack("<IIQQQQQQ", kind, 4, name_at, 0, 0, len(name), len(name), 1)
        if dynamic is not None:
            phdrs += struct.pack("<IIQQQQQQ", elfloads.PT_DYNAMIC, 4, tags_at, 0, 0, len(tags), len(tags), 8)
    else:
        header = struct.pack("<HHIIIIIHHHHHH", 2, 3, 1, 0, ehsize, 0, 0, ehsize, phentsize, count, 40, 0, 0)
        phdrs = struct.pack("<IIIIIIII", kind, name_at, 0, 0, len(name), len(name), 4, 1)
        if dynamic is not None:
            phdrs += struct.pack("<IIIIIIII", elfloads.PT_DYNAMIC, tags_at, 0, 0, len(tags), len(tags), 4, 4)
    path.write_bytes(ident + header + phdrs + name + (tags if dynamic is not None else b""))


@pytest.mark.parametrize("wide", [True, False], ids=["64-bit", "32-bit"])
def test_the_interpreter_is_read_from_the_header(tmp_path: Path, wide: bool) -> None:
    _elf(tmp_path / "dynamic", b"/opt/glibc/lib/ld-linux.so.2", wide=wide)
    assert elfloads.interpreter(str(tmp_path / "dynamic")) == "/opt/glibc/lib/ld-linux.so.2"
    # The twin: no PT_INTERP, a static program, which loads nothing.
    _elf(tmp_path / "static", None, wide=wide)
    assert elfloads.interpreter(str(tmp_path / "static")) == ""


def test_what_is_not_elf_has_no_interpreter(tmp_path: Path) -> None:
    (tmp_path / "script").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "short").write_bytes(b"\x7fELF\x02")
    assert elfloads.interpreter(str(tmp_path / "script")) == ""
    assert elfloads.interpreter(str(tmp_path / "short")) == ""
    with pytest.raises(FileNotFoundError):
        elfloads.interpreter(str(tmp_path / "absent"))


def test_this_interpreters_loader_is_found() -> None:
    loader = elfloads.interpreter(os.path.realpath(sys.executable))
    assert loader.startswith("/") and os.path.exists(loader), loader
    assert elfloads.interpreter("/proc/self/exe") == loader


LISTED = b"""\tlinux-vdso.so.1 (0x00007ffd5c3f2000)
\tlibslirp.so.0 => /opt/libslirp/lib/libslirp.so.0 (0x00007f2a4c000000)
\tlibglib-2.0.so.0 => /lib/x86_64-linux-gnu/libglib-2.0.so.0 (0x00007f2a4be00000)
\tlibgone.so.1 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2a4bc00000)
\t/lib64/ld-linux-x86-64.so.2 => /usr/lib64/ld-linux-x86-64.so.2 (0x00007f2a4c200000)
\tlibslirp.so.0 => /opt/libslirp/lib/libslirp.so.0 (0x00007f2a4c000000)
"""


def test_the_list_names_files_only_each_once() -> None:
    assert elfloads.parse_list(LISTED) == [
        "/opt/libslirp/lib/libslirp.so.0", "/lib/x86_64-linux-gnu/libglib-2.0.so.0",
        "/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/ld-linux-x86-64.so.2"]
    assert elfloads.parse_list(b"\tnot a dynamic executable\n") == []
    # A name the file system has that is not UTF-8: kept as os.fsdecode has it (it stopped the daemon's start).
    assert elfloads.parse_list(b"\tlibx.so => /opt/l\xe9b/libx.so (0x1000)\n") == ["/opt/l\udce9b/libx.so"]


def _run(stdout: bytes, code: int = 0, stderr: bytes = b""):
    seen: list[list[str]] = []

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        seen.append(argv)
        assert kwargs["env"] == {"PATH": "/usr/bin"} and kwargs["timeout"] == elfloads.LIST_TIMEOUT_S
        return subprocess.CompletedProcess(argv, code, stdout, stderr)
    return run, seen


def test_the_files_found_are_the_interpreter_and_the_listed_libraries(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libslirp.so.0.4").write_bytes(b"\x7fELF and the rest")
    (lib / "libslirp.so.0").symlink_to("libslirp.so.0.4")  # the rule binds to what the loader opens
    _elf(tmp_path / "stack", b"/lib64/ld-linux-x86-64.so.2")
    run, seen = _run(f"\tlibslirp.so.0 => {lib}/libslirp.so.0 (0x1000)\n\tlinux-vdso.so.1 (0x2000)\n".encode())
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=run, loader="/my/ld.so")
    assert why == ""
    assert files == [os.path.realpath("/lib64/ld-linux-x86-64.so.2"), str(lib / "libslirp.so.0.4")]
    assert seen == [["/my/ld.so", "--list", str(tmp_path / "stack")]]  # our loader, not the program's


def test_a_loader_that_fails_gives_what_it_listed_and_says_why(tmp_path: Path) -> None:
    _elf(tmp_path / "stack", b"/lib64/ld-linux-x86-64.so.2")
    run, _ = _run(b"", 127, b"ld.so: error while loading shared libraries: libx.so: bad ELF header\n")
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=run, loader="/my/ld.so")
    assert files == [os.path.realpath("/lib64/ld-linux-x86-64.so.2")]
    assert why == (f"/my/ld.so --list {tmp_path / 'stack'}: ld.so: error while loading shared libraries: "
                   "libx.so: bad ELF header")

    def slow(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        raise subprocess.TimeoutExpired(argv, elfloads.LIST_TIMEOUT_S)
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=slow, loader="/my/ld.so")
    assert len(files) == 1 and "timed out after 10.0 seconds" in why


def test_a_static_program_or_a_script_loads_nothing_and_runs_no_loader(tmp_path: Path) -> None:
    _elf(tmp_path / "static", None)
    (tmp_path / "script").write_text("#!/bin/sh\n")
    run, seen = _run(b"")
    for name in ("static", "script"):
        assert elfloads.loaded_files(str(tmp_path / name), {"PATH": "/usr/bin"}, run=run) == ([], "")
    assert seen == []
    assert elfloads.loaded_files(str(tmp_path / "absent"), {}, run=run) == (
        [], f"cannot read {tmp_path / 'absent'}: No such file or directory")


@pytest.mark.process
def test_the_real_loader_lists_slirp4netns_libraries() -> None:
    path = shutil.which("slirp4netns")
    assert path is not None, "slirp4netns is installed by the set-up (scripts/_common.sh)"
    files, why = elfloads.loaded_files(os.path.realpath(path), {"PATH": "/usr/bin:/bin"})
    assert why == ""
    names = {os.path.basename(f).split(".so")[0] for f in files}
    assert {"libslirp", "libc"} <= names, files
    assert all(os.path.isfile(f) and os.path.realpath(f) == f for f in files)


def test_a_program_that_names_an_audit_library_is_not_listed(tmp_path: Path) -> None:
    """A loader loads and runs audit libraries (DT_AUDIT, DT_DEPAUDIT) even
    when it only lists: such a program is not listed (its libraries get no
    rule; its own start says what it cannot load). The twin: a dynamic
    section without them is listed."""
    run, seen = _run(b"")
    for tag in (elfloads.DT_AUDIT, elfloads.DT_DEPAUDIT):
        for wide in (True, False):
            _elf(tmp_path / "audited", b"/lib64/ld-linux-x86-64.so.2", wide=wide, dynamic=[1, tag])
            assert elfloads.audit_libraries(str(tmp_path / "audited"))
            files, why = elfloads.loaded_files(str(tmp_path / "audited"), {"PATH": "/usr/bin"}, run=run,
                                               loader="/my/ld.so")
            assert files == [] and "names audit libraries (DT_AUDIT)" in why
    assert seen == []
    _elf(tmp_path / "plain", b"/lib64/ld-linux-x86-64.so.2", dynamic=[1, 14])  # DT_NEEDED, DT_SONAME
    assert not elfloads.audit_libraries(str(tmp_path / "plain"))
    files, why = elfloads.loaded_files(str(tmp_path / "plain"), {"PATH": "/usr/bin"}, run=run, loader="/my/ld.so")
    assert why == "" and len(seen) == 1


def test_a_listed_file_that_is_not_an_elf_object_gets_no_rule(tmp_path: Path) -> None:
    """A DT_NEEDED name with a newline can make up a line of the list that
    names any file (a key): only regular ELF files are taken, and the rest
    are said."""
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    lib = tmp_path / "libslirp.so.0"
    lib.write_bytes(b"\x7fELF")
    (tmp_path / "dir.so").mkdir()
    _elf(tmp_path / "stack", b"/lib64/ld-linux-x86-64.so.2")
    listed = (f"\tlibslirp.so.0 => {lib} (0x1000)\n\tx\n\t{secret} (0x1)\n => not found\n"
              f"\tlibd.so => {tmp_path / 'dir.so'} (0x2000)\n").encode()
    run, _ = _run(listed)
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=run, loader="/my/ld.so")
    assert files == [os.path.realpath("/lib64/ld-linux-x86-64.so.2"), str(lib)]
    assert why == (f"/my/ld.so --list {tmp_path / 'stack'} named files that are not ELF objects, left out: "
                   f"{secret}, {tmp_path / 'dir.so'}")

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


def _elf(path: Path, interp: bytes | None, *, wide: bool = True) -> None:
    """A minimal ELF file: its header, one program header (PT_INTERP naming
    ``interp``, or PT_LOAD without), then the interpreter's name."""
    ehsize, phentsize = (64, 56) if wide else (52, 32)
    name_at = ehsize + phentsize
    name = (interp or b"") + b"\0"
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1, 1]) + bytes(9)
    kind = elfloads.PT_INTERP if interp is not None else 1
    if wide:
        header = struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, ehsize, 0, 0, ehsize, phentsize, 1, 64, 0, 0)
        phdr = struct.pack("<IIQQQQQQ", kind, 4, name_at, 0, 0, len(name), len(name), 1)
    else:
        header = struct.pack("<HHIIIIIHHHHHH", 2, 3, 1, 0, ehsize, 0, 0, ehsize, phentsize, 1, 40, 0, 0)
        phdr = struct.pack("<IIIIIIII", kind, name_at, 0, 0, len(name), len(name), 4, 1)
    path.write_bytes(ident + header + phdr + name)


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


LISTED = """\tlinux-vdso.so.1 (0x00007ffd5c3f2000)
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
    assert elfloads.parse_list("\tnot a dynamic executable\n") == []


def _run(stdout: str, code: int = 0, stderr: str = ""):
    seen: list[list[str]] = []

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        assert kwargs["env"] == {"PATH": "/usr/bin"} and kwargs["timeout"] == elfloads.LIST_TIMEOUT_S
        return subprocess.CompletedProcess(argv, code, stdout, stderr)
    return run, seen


def test_the_files_found_are_the_interpreter_and_the_listed_libraries(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libslirp.so.0.4").write_bytes(b"")
    (lib / "libslirp.so.0").symlink_to("libslirp.so.0.4")  # the rule binds to what the loader opens
    _elf(tmp_path / "stack", b"/lib64/ld-linux-x86-64.so.2")
    run, seen = _run(f"\tlibslirp.so.0 => {lib}/libslirp.so.0 (0x1000)\n\tlinux-vdso.so.1 (0x2000)\n")
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=run, loader="/my/ld.so")
    assert why == ""
    assert files == [os.path.realpath("/lib64/ld-linux-x86-64.so.2"), str(lib / "libslirp.so.0.4")]
    assert seen == [["/my/ld.so", "--list", str(tmp_path / "stack")]]  # our loader, not the program's


def test_a_loader_that_fails_gives_what_it_listed_and_says_why(tmp_path: Path) -> None:
    _elf(tmp_path / "stack", b"/lib64/ld-linux-x86-64.so.2")
    run, _ = _run("", 127, "ld.so: error while loading shared libraries: libx.so: bad ELF header\n")
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=run, loader="/my/ld.so")
    assert files == [os.path.realpath("/lib64/ld-linux-x86-64.so.2")]
    assert why == (f"/my/ld.so --list {tmp_path / 'stack'}: ld.so: error while loading shared libraries: "
                   "libx.so: bad ELF header")

    def slow(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(argv, elfloads.LIST_TIMEOUT_S)
    files, why = elfloads.loaded_files(str(tmp_path / "stack"), {"PATH": "/usr/bin"}, run=slow, loader="/my/ld.so")
    assert len(files) == 1 and "timed out after 10.0 seconds" in why


def test_a_static_program_or_a_script_loads_nothing_and_runs_no_loader(tmp_path: Path) -> None:
    _elf(tmp_path / "static", None)
    (tmp_path / "script").write_text("#!/bin/sh\n")
    run, seen = _run("")
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

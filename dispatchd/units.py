"""``dispatchd install-units`` / ``uninstall-units``: dispatchd as a systemd user service.

Two user units: ``dispatchd.socket`` makes systemd listen on dispatchd's
default socket path (``%t`` is ``$XDG_RUNTIME_DIR``) and start
``dispatchd.service`` on the first connection. They are written into
``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/systemd/user``), with
``ExecStart=`` naming the interpreter that runs this command, as given: a
venv's ``bin/python`` is a symlink, and its target would run without the venv.

The unit texts are kept once, in ``systemd/`` at the top of the repository
(written for ``/usr/bin/python3``, ready for packagers), and shipped in the
package as data (``dispatchd/unit-files``), so that any installation (a wheel,
an editable checkout) can write them.
"""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

COMMANDS = ("install-units", "uninstall-units")
UNIT_NAMES = ("dispatchd.socket", "dispatchd.service")
NEXT_STEP = "systemctl --user daemon-reload && systemctl --user enable --now dispatchd.socket"

# The unit files themselves are ``systemd/`` at the top of the repository,
# shipped in the package as ``dispatchd/unit-files`` (a link to it, as
# ``dispatchd/policies`` is to ``policies/``): one text, read by
# ``install-units`` and by packagers alike. They are written for this
# interpreter; ``render`` puts the one that runs install-units in its place.
_UNIT_DIR = Path(__file__).resolve().parent / "unit-files"
_SHIPPED_PYTHON = "/usr/bin/python3"
_SHIPPED_EXEC = f"\nExecStart={_SHIPPED_PYTHON} "


def exec_path(path: str) -> str:
    """``path`` as the executable of a unit's ``ExecStart=`` (systemd.service(5),
    "Command lines"), checked against systemd 252 with ``systemd-analyze
    verify``: ``%`` starts a specifier, so it is doubled; whitespace needs
    double quotes; ``$`` is taken literally in the executable (no variable
    expansion there, and ``$$`` is not undone); quotes, backslashes and control
    characters are refused by systemd in an executable name, so refused here."""
    if not os.path.isabs(path):
        raise ValueError(f"ExecStart= needs an absolute interpreter path, not {path!r}")
    bad = sorted({c for c in path if c in "\"'\\" or ord(c) < 0x20 or c == "\x7f"})
    if bad:
        raise ValueError(f"systemd refuses {''.join(bad)!r} in an executable's path: {path!r} "
                         "(install dispatchd in a Python whose path has none)")
    escaped = path.replace("%", "%%")
    return f'"{escaped}"' if any(c.isspace() for c in path) else escaped


def render(python: str) -> dict[str, str]:
    """The two unit files, by name, for the interpreter ``python`` (absolute):
    the shipped ones, with ``python`` in ``ExecStart=`` instead of /usr/bin/python3."""
    executable = exec_path(python)
    texts = {name: (_UNIT_DIR / name).read_text(encoding="utf-8") for name in UNIT_NAMES}
    service = texts["dispatchd.service"]
    # Exactly one such line, or the shipped file was edited past what this knows.
    if service.count(_SHIPPED_EXEC) != 1:
        raise RuntimeError(f"{_UNIT_DIR / 'dispatchd.service'}: expected one line starting "
                           f"{_SHIPPED_EXEC.strip()!r}")
    texts["dispatchd.service"] = service.replace(_SHIPPED_EXEC, f"\nExecStart={executable} ")
    return texts


def user_unit_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where systemd looks for a user's own units: ``$XDG_CONFIG_HOME/systemd/user``,
    ``~/.config/systemd/user`` when it is unset or not absolute (XDG's rule)."""
    env = os.environ if env is None else env
    config = env.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):
        config = os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "systemd" / "user"


def _import_problem(python: str) -> str | None:
    """Why ``python -P -m dispatchd`` would not start under systemd, if it
    would not: it runs from your home directory, without this shell's
    ``PYTHONPATH``. Typically this command ran from a checkout, or with
    ``PYTHONPATH``, for a Python that dispatchd is not installed for."""
    import dispatchd

    ours = os.path.dirname(os.path.abspath(dispatchd.__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    probe = subprocess.run([python, "-P", "-c", "import dispatchd, os; print(os.path.dirname(dispatchd.__file__))"],
                           cwd="/", env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    found = probe.stdout.strip()
    if probe.returncode != 0:
        return (f"{python} cannot import dispatchd without this directory or PYTHONPATH, as systemd would "
                "start it: install dispatchd for it (pip install .), or run install-units with the Python "
                "it is installed for")
    if os.path.realpath(found) != os.path.realpath(ours):
        return f"under systemd, {python} would run the dispatchd in {found}, not this one ({ours})"
    return None


def _write(path: Path, text: str) -> None:
    """Atomically, mode 0644 (unit files are configuration, not secrets)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def install(directory: Path, texts: Mapping[str, str]) -> list[Path]:
    """Write the units (from :func:`render`) into ``directory``, replacing
    earlier ones: running install-units again after moving a venv updates them."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in texts.items():
        _write(directory / name, text)
        written.append(directory / name)
    return written


def uninstall(directory: Path) -> list[Path]:
    """Remove the unit files and the links ``systemctl --user enable`` left
    beside them (``*.wants/dispatchd.*``), which would dangle otherwise."""
    removed = []
    for link in sorted(directory.glob("*.wants/dispatchd.*")):
        if link.name in UNIT_NAMES and link.is_symlink():
            link.unlink()
            removed.append(link)
    for name in UNIT_NAMES:
        path = directory / name
        if path.exists() or path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


def main(argv: list[str]) -> int:
    """``dispatchd install-units [--dry-run]`` or ``dispatchd uninstall-units``."""
    command, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"dispatchd {command}", description=(
        "Write dispatchd's systemd user units (dispatchd.socket, dispatchd.service) for this Python."
        if command == "install-units" else "Remove dispatchd's systemd user units."))
    if command == "install-units":
        p.add_argument("--dry-run", action="store_true", help="print the unit files and where they would go; write nothing")
    args = p.parse_args(rest)
    if os.geteuid() == 0:
        print(f"dispatchd: refusing to {command} as root: dispatchd runs as your own user, "
              "from your user units (run this command as yourself).", file=sys.stderr)
        return 2
    directory = user_unit_dir()
    try:
        return _uninstall(directory) if command == "uninstall-units" else _install(directory, args.dry_run)
    except OSError as exc:
        print(f"dispatchd: {command}: {exc.filename or directory}: {exc.strerror}", file=sys.stderr)
        return 1


def _uninstall(directory: Path) -> int:
    for path in uninstall(directory):
        print(f"removed {path}")
    print("next: systemctl --user stop dispatchd.socket dispatchd.service; systemctl --user daemon-reload")
    return 0


def _install(directory: Path, dry_run: bool) -> int:
    python = sys.executable
    try:
        texts = render(python)  # sys.executable may be empty, or a path systemd cannot run
    except ValueError as exc:
        print(f"dispatchd: cannot write units for this Python: {exc}", file=sys.stderr)
        return 1
    problem = _import_problem(python)
    if dry_run:
        for name, text in texts.items():
            print(f"==> {directory / name} <==\n{text}")
        if problem:
            print(f"dispatchd: warning: {problem}", file=sys.stderr)
        return 0
    if problem:
        print(f"dispatchd: {problem}", file=sys.stderr)
        return 1
    for path in install(directory, texts):
        print(f"wrote {path}")
    manager = user_manager_problem()
    if manager:
        print(f"dispatchd: {manager}", file=sys.stderr)
    print(f"next: {NEXT_STEP}")
    return 0


def user_manager_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why ``systemctl --user`` cannot start the units here, or None when a
    user manager answers: its private socket is ``$XDG_RUNTIME_DIR/systemd/private``."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    try:
        if stat.S_ISSOCK(os.stat(os.path.join(runtime, "systemd", "private")).st_mode):
            return None
    except OSError:
        pass
    return (f"no systemd user manager is running for you here (no {runtime}/systemd/private), so "
            "`systemctl --user` cannot start these units yet. Either run the daemon in the foreground "
            "(`dispatchd`), or let `dispatch` start it in the background (it does when none answers); or "
            "get a user manager: log in through a session that starts one (ssh or a desktop login, not "
            "`su`), or have root run `loginctl enable-linger $USER`, then run the next step")

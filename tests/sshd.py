"""An sshd of this user on 127.0.0.1 on a free port, for the remote tests and bench.

Unprivileged: sshd run by an ordinary user logs in only that user (no
privilege separation user, no PAM: ``UsePAM no``), reading the keys this
module makes in a directory of its own (``StrictModes no``: the tmp
directory's parents are not checked). ``SetEnv PATH`` puts a chosen
directory (the venv's bin, with ``dispatch``) first for the commands it runs.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


class Sshd:
    """An sshd of this user on 127.0.0.1, with keys and configs of its own in ``base``."""

    def __init__(self, base: Path, path_there: str) -> None:
        self.base = base
        base.mkdir(mode=0o700, exist_ok=True)
        for name in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / name)], check=True)
        (base / "authorized_keys").write_text((base / "user_key.pub").read_text())
        self.proc: subprocess.Popen[bytes] | None = None
        for _attempt in range(5):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.config = base / "sshd_config"
            self.config.write_text("\n".join([
                f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {base / 'host_key'}",
                f"PidFile {base / 'sshd.pid'}", f"AuthorizedKeysFile {base / 'authorized_keys'}",
                "StrictModes no", "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes", f"SetEnv PATH={path_there}", ""]))
            self.log_path = base / "sshd.log"
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(self.config)],
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                if "Server listening" in self.log_path.read_text():
                    break
                time.sleep(0.05)
            if self.proc.poll() is None:
                break
        else:
            raise RuntimeError(f"sshd did not start: {self.log_path.read_text()}")
        host_key = (base / "host_key.pub").read_text().split()
        (base / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {host_key[0]} {host_key[1]}\n")
        self.client_config = base / "ssh_config"
        self.client_config.write_text("\n".join([
            "Host 127.0.0.1", f"  Port {self.port}", f"  IdentityFile {base / 'user_key'}", "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {base / 'known_hosts'}", "  StrictHostKeyChecking yes", ""]))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

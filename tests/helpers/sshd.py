"""A real OpenSSH sshd on 127.0.0.1 for tests: generated host + user keys, known_hosts and an ssh_config.

``SSHD.start(dir)`` writes everything under ``dir`` and runs ``/usr/sbin/sshd -D`` in its own process group
as the current user; ``alias`` (``eaglehost``) is a Host entry of ``ssh_config`` that a client reads with
``-F`` (OpenSSH) or ``config=[path]`` (asyncssh).  ``kill_sessions()`` SIGKILLs the per-connection sshd
children (drops every link); ``stop()`` kills the whole group.  ``kill_tree_matching(text)`` ends the
processes (daemons, bridges, jobs) whose command line or environment mentions ``text`` (tests pass
their tmp dir).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD_BIN = "/usr/sbin/sshd"


def free_port() -> int:
    """An ephemeral port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path) -> str:
    """Generate an ed25519 key pair at ``path``; returns the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "eaglewatch-test", "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path.with_suffix(".pub").read_text().strip()


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def kill_tree_matching(text: str, sig: int = signal.SIGKILL, rounds: int = 20) -> list[int]:
    """Kill every process whose cmdline or environment contains ``text`` (not this process).

    Repeats until a scan finds nothing: a process may fork a child (a job) while we scan.
    """
    killed: list[int] = []
    for _ in range(rounds):
        found = _kill_matching_once(text.encode(), sig)
        if not found:
            break
        killed += found
        time.sleep(0.05)
    return killed


def _kill_matching_once(needle: bytes, sig: int) -> list[int]:
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            blob = Path(f"/proc/{entry}/cmdline").read_bytes()
            with contextlib.suppress(OSError):
                blob += Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in blob:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), sig)
                killed.append(int(entry))
    return killed


@dataclass
class SSHD:
    """A running sshd and the client-side files to reach it."""

    dir: Path
    port: int
    proc: subprocess.Popen[bytes]
    host_key: Path
    user_key: Path
    known_hosts: Path
    ssh_config: Path
    alias: str = "eaglehost"
    user: str = field(default_factory=lambda: os.environ.get("USER") or "root")

    @classmethod
    def start(cls, root: Path, alias: str = "eaglehost", sftp: bool = True, streamlocal: bool = True) -> SSHD:
        """Generate keys and config under ``root`` and start sshd on a free loopback port.

        ``sftp=False`` leaves out the ``Subsystem sftp`` line, as some hardened hosts do;
        ``streamlocal=False`` forbids channels to Unix sockets (``AllowStreamLocalForwarding no``).
        """
        root.mkdir(parents=True, exist_ok=True)
        host_key, user_key = root / "host_ed25519", root / "user_ed25519"
        host_pub = keygen(host_key)
        user_pub = keygen(user_key)
        (root / "authorized_keys").write_text(user_pub + "\n")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir sshd insists on
        last_err = ""
        for _ in range(5):
            port = free_port()
            cfg = root / "sshd_config"
            cfg.write_text(
                f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {root / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {root / 'authorized_keys'}\nStrictModes no\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                "PermitRootLogin prohibit-password\nAllowAgentForwarding no\nX11Forwarding no\n"
                + ("Subsystem sftp internal-sftp\n" if sftp else "")
                + ("" if streamlocal else "AllowStreamLocalForwarding no\n")
                + "MaxStartups 200\nMaxSessions 200\nLogLevel ERROR\n"
                "ClientAliveInterval 0\n"
            )
            log = open(root / "sshd.log", "ab")  # noqa: SIM115 (kept open for the process's lifetime)
            proc = subprocess.Popen(
                [SSHD_BIN, "-D", "-e", "-f", str(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
            log.close()
            if _wait_port(port, proc):
                break
            last_err = (root / "sshd.log").read_text()[-2000:]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            raise RuntimeError(f"sshd did not start: {last_err}")
        known_hosts = root / "known_hosts"
        key_type_and_data = " ".join(host_pub.split()[:2])
        known_hosts.write_text(f"[127.0.0.1]:{port} {key_type_and_data}\n")
        ssh_config = root / "ssh_config"
        user = os.environ.get("USER") or "root"
        ssh_config.write_text(
            f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n  IdentityFile {user_key}\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n  StrictHostKeyChecking yes\n"
            "  ForwardAgent no\n  BatchMode yes\n"
        )
        return cls(root, port, proc, host_key, user_key, known_hosts, ssh_config, alias)

    def restart(self) -> None:
        """Start sshd again on the same port with the same keys (after ``stop``)."""
        log = open(self.dir / "sshd.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [SSHD_BIN, "-D", "-e", "-f", str(self.dir / "sshd_config")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        if not _wait_port(self.port, self.proc):
            raise RuntimeError(f"sshd did not restart: {(self.dir / 'sshd.log').read_text()[-2000:]}")

    def session_pids(self) -> list[int]:
        """The per-connection sshd children."""
        return children_of(self.proc.pid)

    def kill_sessions(self) -> int:
        """SIGKILL every session child: every SSH link through this sshd drops; returns how many."""
        pids = self.session_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def ssh_argv(self, *remote: str) -> list[str]:
        """argv for the OpenSSH client reaching this server through the alias."""
        return ["ssh", "-F", str(self.ssh_config), self.alias, *remote]

    def stop(self) -> None:
        """Kill sshd and its session children."""
        for pid in self.session_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False

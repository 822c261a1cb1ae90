"""Processes in namespaces of their own, as containers run them (test helper; needs root).

`isolated` wraps a command so that it runs in new PID, network, IPC and mount namespaces
(`unshare`), with loopback up, a fresh /dev/shm, and a fresh /tmp that holds nothing but
the host directories it is given (bind mounts under /tmp/NAME): like a pod that mounts
the socket directory and nothing else of the node. With `uid`, the command runs as that
user (`setpriv`), with no supplementary groups and no capabilities.

`NamespacedServer` is `kvdepot serve` run that way, sharing its socket directory (and its
state directory, so the test can read the owner credential), reached by the test over
ipc:// in the socket directory: its TCP port is in a network namespace of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvdepot.client.admin import AdminClient
from kvdepot.errors import KVDepotError

NEEDS_NAMESPACES = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
    reason="needs root, unshare and setpriv (CI runs as root)")
"""The mark of every test that runs engines or attackers in namespaces of their own."""
NOBODY = 65534
PYTHON = "/tmp/python/bin/python"
"""The interpreter inside the namespaces, where `readable_python`'s directory is bound."""
STAGE = "/mnt"
"""Where the fresh /tmp is assembled before it is moved over /tmp: a directory every
Debian system has, and which the private mount namespace may cover."""


# Brings the new network namespace's loopback up (SIOCGIFFLAGS, then SIOCSIFFLAGS with
# IFF_UP on a 40-byte ifreq): what `ip link set lo up` does, without iproute2, which some
# hosts lack (the GPU machine's image).
_LOOPBACK_UP_CODE = (
    "import fcntl, socket, struct\n"
    "s = socket.socket()\n"
    "req = struct.pack('16sH22x', b'lo', 0)\n"
    "flags = struct.unpack('16sH22x', fcntl.ioctl(s, 0x8913, req))[1]\n"
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', flags | 1))\n")
LOOPBACK_UP = f"{shlex.quote(sys.executable)} -c {shlex.quote(_LOOPBACK_UP_CODE)}"


def isolated(command: list[str], binds: dict[str, Path], uid: int | None = None,
             workdir: str = "/", read_only: tuple[str, ...] = ()) -> list[str]:
    """`command` run in namespaces of its own, seeing host directory `binds[name]` as
    /tmp/NAME (read-only for the names in `read_only`, as a pod mounts a volume with
    readOnly); as `uid` when given."""
    steps = ["set -e", LOOPBACK_UP, "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
             f"mount -t tmpfs -o mode=1777 tmpfs {STAGE}"]
    for name, host in binds.items():
        steps += [f"mkdir {STAGE}/{name}", f"mount --bind {shlex.quote(str(host))} "
                  f"{STAGE}/{name}"]
        if name in read_only:
            steps.append(f"mount -o remount,bind,ro {STAGE}/{name}")
    steps += [f"mount --move {STAGE} /tmp", f"cd {shlex.quote(workdir)}"]
    if uid is None:
        steps.append('exec "$@"')
    else:
        steps.append(f'exec setpriv --reuid={uid} --regid={uid} --clear-groups '
                     '--inh-caps=-all -- "$@"')
    return ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--ipc", "--mount",
            "--propagation", "private", "--", "sh", "-c", "; ".join(steps), "sh", *command]


def _base_python() -> str:
    """The project's base interpreter if every uid may run it, else the system's."""
    real = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    if all(p.stat().st_mode & 0o001 for p in [real, *real.parents]):
        return str(real)
    return "/usr/bin/python3.11"


def readable_python(directory: Path) -> Path:
    """A Python for another uid: a virtual environment in `directory` on a base interpreter
    that uid may run, whose site directory is the project's .venv's; bind it as "python" and run
    `PYTHON`. The project's interpreter may live where another uid cannot reach it (pyenv
    under root's 0700 home), and vLLM starts its helper processes with `sys.executable`."""
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(directory)],
                   check=True)
    site = next(Path(sys.prefix).glob("lib/python3*/site-packages"))
    (next(directory.glob("lib/python3*/site-packages")) / "kvdepot-project.pth").write_text(
        f"import site; site.addsitedir({str(site)!r})\n")
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else path.stat().st_mode | 0o444)
    return directory


def start(command: list[str], log: Path, **popen: Any) -> subprocess.Popen[Any]:
    """Start `command` in a session of its own (so `stop` ends its whole namespace); its
    output goes to `log`, but for stdout when `popen` asks for a pipe (replies)."""
    with open(log, "ab") as out:
        stdout = popen.pop("stdout", out)
        return subprocess.Popen(command, stdout=stdout,
                                stderr=out if stdout is not out else subprocess.STDOUT,
                                start_new_session=True, **popen)


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    """Signal `proc`'s session (every process of the namespaces it started) and wait."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    proc.wait(timeout=60)


class NamespacedServer:
    """`kvdepot serve --socket-dir` in namespaces of its own, run as root."""

    def __init__(self, root: Path, port: int, chunk_size: int = 64, l1_size: str = "256MiB",
                 extra: tuple[str, ...] = ()) -> None:
        self.root = root
        self.socket_dir = root / "sockets"
        self.state_dir = root / "state"
        self.socket_dir.mkdir(mode=0o755, exist_ok=True)
        self.state_dir.mkdir(mode=0o700, exist_ok=True)
        self.port = port
        self.log = root / "server.log"
        self.url = f"ipc://{self.socket_dir}/kvdepot.sock"
        self._args = ["serve", "--port", str(port), "--chunk-size", str(chunk_size),
                      "--l1-size", l1_size, "--socket-dir", "/tmp/sockets",
                      "--state-dir", "/tmp/state", *extra]
        self.proc: subprocess.Popen[Any] | None = None

    @property
    def owner_credential(self) -> str:
        return str(self.state_dir / "servers" / f"tcp-{self.port}.json")

    def start(self, timeout: float = 120.0) -> None:
        command = isolated([sys.executable, "-m", "kvdepot.cli", *self._args],
                           {"sockets": self.socket_dir, "state": self.state_dir})
        self.proc = start(command, self.log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-3000:]}")
            with contextlib.suppress(KVDepotError, OSError, ValueError, TimeoutError):
                if os.path.exists(self.owner_credential):
                    self.stats()
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stats(self) -> dict[str, float]:
        with AdminClient(self.url, timeout=10, credentials=self.owner_credential) as admin:
            return admin.stats()

    def wait_for(self, name: str, predicate: Any, timeout: float = 60.0) -> dict[str, float]:
        """The stats once `predicate(stats[name])` holds (polled: the server acts on its own
        schedule, and a loaded machine may take a while)."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.stats()
            if predicate(values.get(name, 0)):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} never satisfied the condition: {values}")
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop(self.proc, sig)
        self.proc = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def add_credential(server: NamespacedServer, name: str, owner: int, out: Path,
                   tenant: str = "") -> Path:
    """A credential (role engine) of `server`'s, written to `out` for uid `owner` (0600)."""
    command = [sys.executable, "-m", "kvdepot.cli", "credentials", "--state-dir",
               str(server.state_dir), "add", name, "--out", str(out)]
    if tenant:
        command += ["--tenant", tenant]
    subprocess.run(command, check=True, capture_output=True)
    os.chown(out, owner, owner)
    out.chmod(0o600)
    return out


def private_dir(path: Path, owner: int) -> Path:
    """A directory only `owner` may use (the host side of what one namespace sees)."""
    path.mkdir(mode=0o700)
    os.chown(path, owner, owner)
    return path


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

"""The server's image, once `make image` built it: its own kvdepot, run as its uid from its
own root file system, serves an engine of other namespaces through the socket directory.

The image's root file system is mounted (`podman image mount`) and its entrypoint's
program run in it (chroot, in new PID, network, IPC and mount namespaces) as the image's
uid: what a container runtime does, done by hand because this VM's OCI runtime cannot
start containers (setrlimit and cgroups are refused here). Skipped where the image was
not built.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.admin import AdminClient
from kvdepot.testbed.server_process import free_port
from tests.support.namespaces import (
    LOOPBACK_UP,
    NOBODY,
    PYTHON,
    isolated,
    private_dir,
    readable_python,
    start,
    stop,
)

IMAGE = os.environ.get("KVDEPOT_IMAGE", "localhost/kvdepot:local")
IMAGE_UID = 10001
WORKDIR = str(Path(__file__).resolve().parents[2])


def _image_present() -> bool:
    if os.geteuid() != 0 or not shutil.which("podman") or not shutil.which("unshare"):
        return False
    return subprocess.run(["podman", "image", "exists", IMAGE]).returncode == 0


pytestmark = pytest.mark.skipif(not _image_present(),
                                reason=f"{IMAGE} is not built (make image, as root)")


@pytest.fixture
def rootfs() -> Iterator[Path]:
    mounted = subprocess.run(["podman", "image", "mount", IMAGE], check=True,
                             capture_output=True, text=True).stdout.strip()
    try:
        yield Path(mounted)
    finally:
        subprocess.run(["podman", "image", "unmount", IMAGE], capture_output=True)


def _server_command(rootfs: Path, sockets: Path, state: Path, port: int) -> list[str]:
    """The image's `kvdepot serve` in namespaces of its own, chrooted into the image, with
    the socket directory at /run/kvdepot and the state directory at /var/lib/kvdepot."""
    root = "/mnt/image"
    steps = [
        "set -e", LOOPBACK_UP,
        f"mount -t tmpfs tmpfs /mnt && mkdir {root}",
        f"mount --bind {shlex.quote(str(rootfs))} {root}",
        f"mount -t proc proc {root}/proc", f"mount --rbind /dev {root}/dev",
        f"mount -t tmpfs -o mode=1777 tmpfs {root}/tmp",
        f"mount -t tmpfs -o mode=755 tmpfs {root}/run && mkdir {root}/run/kvdepot",
        f"mount --bind {shlex.quote(str(sockets))} {root}/run/kvdepot",
        f"mount --bind {shlex.quote(str(state))} {root}/var/lib/kvdepot",
        f"exec chroot --userspec={IMAGE_UID}:{IMAGE_UID} {root} /usr/bin/env "
        "PATH=/opt/kvdepot/bin:/usr/bin:/bin KVDEPOT_STATE_DIR=/var/lib/kvdepot "
        f"kvdepot serve --socket-dir /run/kvdepot --port {port} --chunk-size 64 "
        "--l1-size 256MiB",
    ]
    return ["unshare", "--pid", "--fork", "--net", "--ipc", "--mount", "--propagation",
            "private", "--", "sh", "-c", "; ".join(steps)]


def test_the_image_s_server_serves_an_engine_of_other_namespaces(rootfs, tmp_path):
    tmp_path.chmod(0o755)
    sockets, state = tmp_path / "sockets", tmp_path / "state"
    for directory, mode in ((sockets, 0o755), (state, 0o700)):
        directory.mkdir(mode=mode)
        os.chown(directory, IMAGE_UID, IMAGE_UID)
    port = free_port()
    server = start(_server_command(rootfs, sockets, state, port), tmp_path / "server.log")
    engine = None
    try:
        owner = state / "servers" / f"tcp-{port}.json"
        url = f"ipc://{sockets}/kvdepot.sock"
        deadline = time.monotonic() + 180
        while not owner.exists() or not (sockets / "handover.sock").exists():
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.2)
        # The engine holds a copy of the owner credential, as a Secret would give it one.
        home = private_dir(tmp_path / "home", NOBODY)
        shutil.copy(owner, home / "credential.json")
        os.chown(home / "credential.json", NOBODY, NOBODY)
        python = readable_python(tmp_path / "python")
        command = isolated([PYTHON, "-m", "tests.support.ns_engine",
                            "ipc:///tmp/sockets/kvdepot.sock", "/tmp/home/credential.json"],
                           {"sockets": sockets, "home": home, "python": python}, uid=NOBODY,
                           workdir=WORKDIR, read_only=("sockets",))
        engine = start(command, tmp_path / "engine.log", stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, env=dict(os.environ, HOME="/tmp/home"))
        assert engine.stdin is not None and engine.stdout is not None
        assert json.loads(engine.stdout.readline()) == {"ready": True}
        engine.stdin.write(b'{"op": "roundtrip", "seed": 5}\n')
        engine.stdin.flush()
        assert json.loads(engine.stdout.readline()) == {"hit": 64, "exact": True}
        with AdminClient(url, timeout=10, credentials=str(owner)) as admin:
            assert admin.stats()["registered_engines"] == 1
    finally:
        if engine is not None:
            stop(engine)
        stop(server)

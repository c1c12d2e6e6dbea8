"""A Ray cluster on loopback for the tests and benchmarks: a head and a worker node, each `ray start --block` in a
process group of its own, 1 CPU each; `loopback_cluster()` stops both and checks that no Ray process of theirs is
left."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import child_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackCluster:
    """A Ray head and worker node on 127.0.0.1, each `ray start --block` in its own process group."""

    def __init__(self, root: Path, node_env: list[dict[str, str]]):
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.groups: list[subprocess.Popen] = []
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        ray_cli = Path(sys.executable).with_name("ray")
        common = ["--num-cpus", "1", "--memory", str(6 * 2**30), "--object-store-memory", str(300 * 2**20),
                  "--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--block"]
        # Ray's socket paths must stay under 108 bytes: a short folder of its own, removed with the cluster.
        self.temp = Path(tempfile.mkdtemp(prefix="oq-ray-"))
        head = [str(ray_cli), "start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                "--temp-dir", str(self.temp), *common]
        worker = [str(ray_cli), "start", "--address", self.address, *common]
        for i, (argv, extra) in enumerate(zip((head, worker), node_env)):
            env = {**child_env(), "RAY_USAGE_STATS_ENABLED": "0", **extra}
            with open(self.logs / f"node{i}.log", "w") as log:
                self.groups.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True))
            if i == 0:
                self._wait_for_nodes(1)
        self._wait_for_nodes(2)

    def _wait_for_nodes(self, count: int, timeout: float = 120) -> None:
        code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = subprocess.run([sys.executable, "-c", code, self.address], capture_output=True, text=True,
                                   env=child_env(), timeout=60)
            if probe.returncode == 0 and probe.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(1)
        raise AssertionError(f"The Ray cluster did not reach {count} nodes:\n"
                             + "\n".join(p.read_text()[-2000:] for p in self.logs.iterdir()))

    def stop(self) -> None:
        for group in reversed(self.groups):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group.pid, signal.SIGTERM)
        for group in self.groups:
            try:
                group.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group.pid, signal.SIGKILL)  # raylet, GCS and workers the SIGTERM left behind
        time.sleep(1)
        left = [pid for group in self.groups for pid in _group_members(group.pid)]
        shutil.rmtree(self.temp, ignore_errors=True)
        assert not left, f"Ray processes left after the test: {left}"


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.append(int(entry.name))
    return members


@contextlib.contextmanager
def loopback_cluster(root: Path, node_env: list[dict[str, str]] | None = None):
    cluster = LoopbackCluster(root, node_env or [{}, {}])
    try:
        yield cluster
    finally:
        cluster.stop()

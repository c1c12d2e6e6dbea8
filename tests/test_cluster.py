"""optimum_qnn.exporter.cluster: the export matrix on a real Ray cluster started by the test on loopback.

A head and a worker node (1 CPU each, 2 in all: tests/ray_cluster.py) run the (scheme, SoC) cells of a tiny random
Gemma4. Each cluster is started with `ray start --block` in a process group of its own and ends with the test: the
groups are killed and no Ray process of theirs is left.

What "the same variant" means: the cell's program equals the one a local export makes in a process of its own
(`optimum-cli export qnn` without --ray, one process per scheme) in every byte but the signature ExecuTorch stamps
into each QNN context header from the clock (`inspection.pte.normalized_program`); its manifest differs from the
local one only in the program's sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is part of the test extras (pip install -e '.[test]')")

from optimum_qnn.artifacts.inspection.pte import normalized_program  # noqa: E402
from tests.ray_cluster import loopback_cluster  # noqa: E402

SOCS = ("SM8650", "SM8750")
# Quantized schemes: an fp16 HTP context holds about 100 bytes that differ between any two compiles (heap addresses,
# measured between two fresh-process exports of the same graphs), so fp16 programs are never byte-identical.
SCHEMES = ("16a8w", "8a8w")
COMMON = ["--mode", "kv", "--max-seq-len", "32", "--prefill-ar-len", "4", "--embedding-quant", "none"]


class CellKiller(threading.Thread):
    """SIGKILLs the first Ray worker process seen running a cell (its title: `ray::lower <scheme> <soc>`)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.killed: tuple[int, str] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and self.killed is None:
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                with contextlib.suppress(OSError):
                    title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                    if title.startswith("ray::lower "):
                        time.sleep(3)  # well inside the cell's work (its edge conversion alone takes longer)
                        os.kill(int(entry.name), signal.SIGKILL)
                        self.killed = (int(entry.name), title)
                        return
            time.sleep(0.2)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from tests.gemma4_tiny import tiny_config, tiny_model

    folder = tmp_path_factory.mktemp("cluster-gemma4")
    tiny_model(tiny_config()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def local_matrix(tiny_checkpoint, tmp_path_factory, run_python) -> Path:
    """The matrix exported without Ray: one `python -m optimum_qnn export` process per scheme, both SoCs each."""
    out = tmp_path_factory.mktemp("local") / "artifact"
    for scheme in SCHEMES:
        proc = run_python("-m", "optimum_qnn", "export", "-m", str(tiny_checkpoint), "-o", str(out), "--soc", *SOCS,
                          "--quant", scheme, *COMMON, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _variants(folder: Path) -> dict[str, Path]:
    index = json.loads((folder / "qnn_index.json").read_text())
    return {v["path"]: folder / v["path"] for v in index["variants"]}


def _manifest_without_program_digest(variant: Path) -> dict:
    text = (variant / "manifest.json").read_text()
    digest = hashlib.sha256((variant / "model.pte").read_bytes()).hexdigest()
    assert digest in text  # the manifest records the program it came with
    return json.loads(text.replace(digest, "<program sha256>"))


@pytest.mark.slow
def test_a_ray_matrix_lands_every_cell_as_the_local_export_makes_it(tiny_checkpoint, local_matrix, tmp_path,
                                                                   run_python):
    """2 schemes x 2 SoCs on a 2-node loopback cluster, one cell's worker SIGKILLed while it lowers: Ray runs that
    cell again, and every variant equals the local export's. The driver is the command a user types, in a process of
    its own as the local export's are (calibration's float sums depend on the process's threads)."""
    out = tmp_path / "artifact"
    with loopback_cluster(tmp_path) as cluster:
        killer = CellKiller()
        killer.start()
        try:
            proc = run_python("-m", "optimum_qnn", "export", "-m", str(tiny_checkpoint), "-o", str(out), "--soc", *SOCS,
                              "--quant", *SCHEMES, *COMMON, "--ray", cluster.address, timeout=1200)
        finally:
            killer.done.set()
            killer.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert killer.killed is not None, "no cell was seen running to be killed"
    remote, local = _variants(out), _variants(local_matrix)
    assert sorted(remote) == sorted(local) and len(remote) == len(SOCS) * len(SCHEMES)
    for name in remote:
        assert f"wrote {remote[name]}" in proc.stdout
        a, b = (remote[name] / "model.pte").read_bytes(), (local[name] / "model.pte").read_bytes()
        assert a != b  # compiled at other times: the context signatures differ ...
        assert normalized_program(a) == normalized_program(b), name  # ... and nothing else does
        assert _manifest_without_program_digest(remote[name]) == _manifest_without_program_digest(local[name])
    stages = proc.stdout.split("Stages:")[1:]
    assert len(stages) == len(SCHEMES)
    assert all(f"lower {soc}" in table for table in stages for soc in SOCS)  # the cells' own time and memory
    retried = [line for line in proc.stderr.splitlines() if "its worker was lost" in line]
    assert len(retried) == 1 and "running it again (attempt 2 of 3)" in retried[0], proc.stderr[-3000:]
    assert killer.killed[1].split("::", 1)[1] in retried[0]  # the cell whose worker the test killed


@pytest.mark.slow
def test_a_failing_cell_is_reported_and_the_others_land(tiny_checkpoint, tmp_path, qnn_sdk, capsys):
    """The head node has no usable QNN libraries (QNN_SDK_ROOT points nowhere): its cells fail with that error in
    the summary, the worker node's cells are written, and the command exits 2."""
    from tests.conftest import run_main

    out = tmp_path / "artifact"
    nodes = [{"QNN_SDK_ROOT": str(tmp_path / "no-sdk-here")}, {}]
    with loopback_cluster(tmp_path, nodes) as cluster:
        code, stdout, stderr = run_main(["export", "-m", tiny_checkpoint, "-o", out, "--soc", *SOCS, "--quant",
                                         "fp16", *COMMON, "--ray", cluster.address], capsys)
        # And a lowering no node has the memory for is refused up front (the nodes have 6 GB each).
        from optimum_qnn.exporter.cluster import ClusterError, RayMatrix
        from optimum_qnn.exporter.memory import MemoryEstimate, MemoryPlan

        with RayMatrix(cluster.address) as matrix:
            matrix.check_fits(MemoryPlan(MemoryEstimate({"lower": 5.5}, 1), None, "test", True))
            with pytest.raises(ClusterError, match=r"estimated at 6\.5 GB.*largest: 6\.0 GB of 2 node"):
                matrix.check_fits(MemoryPlan(MemoryEstimate({"lower": 6.5}, 1), None, "test", True))
    assert code == 2, stderr[-3000:]
    landed = _variants(out)
    failed = [line for line in stderr.splitlines() if line.strip().startswith(("fp16 SM8650:", "fp16 SM8750:"))]
    assert landed and failed and len(landed) + len(failed) == len(SOCS), stderr[-3000:]
    assert all("QNN_SDK_ROOT" in line for line in failed), failed
    assert f"cells failed on the cluster" in stderr
    for path in landed.values():
        assert f"wrote {path}" in stdout
        assert (path / "model.pte").stat().st_size > 0 and (path / "manifest.json").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")and p.suffix == ".pte"]


def test_a_matrix_refuses_what_a_cluster_cannot_do_before_any_work(tiny_checkpoint, tmp_path, capsys):
    """Bad matrix arguments are refused before the model loads or a cluster is touched, and leave no folder."""
    from tests.conftest import run_main

    out = tmp_path / "artifact"
    base = ["export", "-m", tiny_checkpoint, "-o", out, "--soc", *SOCS, *COMMON]
    code, _, stderr = run_main([*base, "--quant", *SCHEMES, "--ray", "127.0.0.1:9", "--check-weight-sharing"], capsys)
    assert code == 2 and "--check-weight-sharing" in stderr and "drop --ray" in stderr
    code, _, stderr = run_main([*base, "--quant", "16a8w", "16a9w", "--ray", "127.0.0.1:9"], capsys)
    assert code == 2 and "16a9w" in stderr and "16a8w" in stderr  # the bad scheme, and the ones there are
    assert not ray.is_initialized() and not out.exists()

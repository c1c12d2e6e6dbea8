"""The export matrix on a Ray cluster: each (scheme, SoC) cell's lowering is a Ray task on the cluster's nodes.

The driver (the machine `optimum-cli export qnn --ray` runs on) loads, swaps, exports, calibrates and quantizes each
scheme once, as a local export does, and puts each method's quantized graph (`torch.export.save`) in Ray's object
store once per scheme. Each cell is then a task that reserves the memory the export's estimate gives a lowering
(Ray's `memory` resource, so a node never takes more lowerings than fit), converts the graphs for QNN, partitions,
compiles and serializes them for its SoC, and returns the program. The driver writes each variant into the artifact
folder as it arrives (under the folder's index lock, as any writer).

What runs per cell that a local multi-SoC export does once: the edge conversion. ExecuTorch's edge programs do not
serialize (their node metadata holds fake tensors and native objects), so each task converts the graphs again; what
the driver ships is everything before that.

Each task runs in a process of its own (`max_calls=1`): libQnnHtp numbers the tensors of every context from
process-wide counters, so a worker reused for a second cell would build a different binary from the same graphs. A
cell's program is then the one a local export of the same scheme and SoC makes (only the compile-time signature in
each QNN context header differs: `inspection.pte.normalized_program`).

Failures: a cell whose worker or node is lost while it runs (killed, out of memory) is submitted again, up to
`MAX_RETRIES` times, with a line saying so; a cell whose lowering raises is not retried, its error goes in the
summary, and every other cell still lands.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from optimum_qnn.config import ExportConfig, Soc
from optimum_qnn.errors import InvalidInputError, OptimumQnnError

logger = logging.getLogger(__name__)
stage_logger = logging.getLogger("optimum_qnn.stages")

ADDRESS_ENV = "OPTIMUM_QNN_RAY_ADDRESS"
# A lost worker's cell is run again this many times before it counts as failed.
MAX_RETRIES = 2


class ClusterError(OptimumQnnError):
    """Some cells of the matrix failed (the others landed), or the cluster cannot be used."""


@dataclass
class _Cell:
    config: ExportConfig
    soc: Soc
    weight_sharing: bool
    output: Path
    landed: Callable  # landed(soc, lowered program, the cell's seconds, its peak RSS MB): writes the variant
    submitted: float = field(default_factory=time.perf_counter)
    attempt: int = 1
    args: tuple = ()
    reserve: int = 0

    @property
    def label(self) -> str:
        return f"{self.config.recipe or self.config.quant.value} {self.soc.value}"


class RayMatrix:
    """Connects to a Ray cluster and runs the SoC-specific lowering of each cell there (see the module docstring).

    Args:
        address: the cluster (`ray://...` or `host:port` of a head node); None: `OPTIMUM_QNN_RAY_ADDRESS`, else
            what `ray.init()` finds (`RAY_ADDRESS`, a cluster started on this machine, or a new local one).

    Raises:
        InvalidInputError: Ray is not installed.
        ClusterError: the cluster cannot be reached.
    """

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise InvalidInputError(
                "--ray needs Ray: pip install 'optimum-qnn[ray]' (or drop --ray to export on this machine)"
            ) from None
        self._ray = ray
        address = address or os.environ.get(ADDRESS_ENV) or None
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"Cannot connect to the Ray cluster at {address or 'the default address'}: {e}") from None
        # Lost workers are retried here, not by Ray, so the summary can say which cell ran again and why.
        self._task = ray.remote(max_calls=1, max_retries=0, num_cpus=1)(_lower_cell)
        self._pending: dict[object, _Cell] = {}  # Ray ObjectRef -> its cell
        self.failures: list[str] = []
        self.landed: list[str] = []

    def __enter__(self) -> "RayMatrix":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pending:  # interrupted: the cells still running are of no use
            for ref in self._pending:
                self._ray.cancel(ref, force=True)
            self._pending.clear()
        self._ray.shutdown()

    def check_fits(self, memory) -> None:
        """Refuse, before any weight is read, a lowering that no node of the cluster has the memory for (Ray would
        keep such a task pending for ever).

        Raises:
            ClusterError: the export's lowering estimate exceeds the memory of every live node."""
        need = memory.estimate.lowering
        nodes = [n.get("Resources", {}).get("memory", 0) / 2**30 for n in self._ray.nodes() if n.get("Alive")]
        largest = max(nodes, default=0.0)
        if need > largest:
            raise ClusterError(
                f"A lowering of this export is estimated at {need:.1f} GB and no node of the Ray cluster has that much "
                f"memory for tasks (largest: {largest:.1f} GB of {len(nodes)} node(s)): add a node with more memory, "
                "or choose more --shards (each shard's compile holds less)"
            )

    def submit(self, lowering, config: ExportConfig, weight_sharing: bool, memory, output: Path,
               landed: Callable) -> None:
        """Ship one scheme's graphs (once) and start a task per SoC of ``config``.

        Args:
            lowering: the scheme's `EdgeLowering`, not prepared (`portable()` takes its sources).
            memory: the export's `MemoryPlan`; each task reserves its estimate of a lowering's peak.
            output: the artifact folder (the program is staged there before ``landed`` writes the variant).
            landed: called as each SoC's program arrives: ``landed(soc, lowered, seconds, peak_rss_mb)``."""
        portable = self._ray.put(lowering.portable())
        reserve = int(memory.estimate.lowering * 2**30)
        for soc in config.socs:
            cell = _Cell(config, soc, weight_sharing, Path(output), landed, reserve=reserve,
                         args=(portable, soc.value, weight_sharing, memory.estimate.lowering))
            self._start(cell)
            logger.info("Submitted the lowering of %s to the cluster (reserving %.1f GB)", cell.label, reserve / 2**30)

    def _start(self, cell: _Cell) -> None:
        ref = self._task.options(memory=cell.reserve, name=f"lower {cell.label}").remote(*cell.args)
        self._pending[ref] = cell

    def collect(self) -> None:
        """Write each cell's variant as it arrives; a failed cell's error goes to `failures`.

        Raises:
            ClusterError: after every cell has ended, when any failed (the others are written).
        """
        from optimum_qnn.artifacts.writer import staging_path
        from optimum_qnn.exporter.lowering import LoweredProgram

        ray = self._ray
        while self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=1)
            cell = self._pending.pop(ready[0])
            try:
                data, delegation, seconds, peak_mb, node = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the lowering itself raised: running it again would too
                self.failures.append(f"{cell.label}: {_what_failed(e)}")
                stage_logger.error("[lower %s] failed on the cluster: %s", cell.label, _what_failed(e))
                continue
            except ray.exceptions.RayError as e:  # its worker or node was lost (killed, out of memory, gone)
                if cell.attempt > MAX_RETRIES:
                    self.failures.append(f"{cell.label}: lost {cell.attempt} times, last: {_what_failed(e)}")
                    stage_logger.error("[lower %s] failed on the cluster: %s", cell.label, self.failures[-1])
                    continue
                cell.attempt += 1
                stage_logger.warning("[lower %s] its worker was lost (%s); running it again (attempt %d of %d)",
                                     cell.label, _what_failed(e), cell.attempt, MAX_RETRIES + 1)
                self._start(cell)
                continue
            stage_logger.info("[lower %s] done in %.1f s, peak RSS %.0f MB (on %s, %.1f s after it was submitted)",
                              cell.label, seconds, peak_mb, node, time.perf_counter() - cell.submitted)
            program_file = staging_path(cell.output, ".pte")
            try:
                program_file.write_bytes(data)
                del data
                lowered = LoweredProgram(program_file, delegation, cell.weight_sharing, cell.soc)
                cell.landed(cell.soc, lowered, seconds, peak_mb)
                self.landed.append(cell.label)
            finally:
                program_file.unlink(missing_ok=True)
        if self.failures:
            raise ClusterError(
                f"{len(self.failures)} of {len(self.failures) + len(self.landed)} cells failed on the cluster "
                "(the others were written):\n  " + "\n  ".join(self.failures)
            )


def _what_failed(error: BaseException) -> str:
    """One line for a failed cell: the lowering's own error (Ray wraps it with the remote traceback), or what Ray
    says happened to the worker or node."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        text = str(cause).strip()
        return f"{type(cause).__name__}: {' '.join(text.split())}" if text else type(cause).__name__
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__


def _lower_cell(portable, soc: str, weight_sharing: bool, budget_gb: float):
    """One cell, in a Ray worker process of its own: prepare the graphs for QNN, lower them for ``soc`` and return
    (program bytes, delegation, wall seconds, peak RSS MB, node)."""
    import socket
    import tempfile
    from pathlib import Path

    from optimum_qnn.console import third_party_quiet
    from optimum_qnn.exporter.lowering import EdgeLowering

    start = time.perf_counter()
    with third_party_quiet(False), tempfile.TemporaryDirectory(prefix="optimum-qnn-cell-") as folder:
        lowering = EdgeLowering.from_portable(portable)
        del portable
        path = Path(folder) / "model.pte"
        lowered = lowering.lower(Soc.parse(soc), weight_sharing=weight_sharing, memory_budget_gb=budget_gb,
                                 path=path, keep=False)
        data = path.read_bytes()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return data, lowered.delegation, time.perf_counter() - start, peak_mb, socket.gethostname() + f":{os.getpid()}"

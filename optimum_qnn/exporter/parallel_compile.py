"""Compile the QNN shards of one lowering in forked worker processes, side by side with the Python work.

Why: ExecuTorch 1.5.1's `QnnBackend.preprocess_multimethod` builds and compiles the context binaries of a sharded
lowering one after the other, and the compile (`PyQnnManagerAdaptor.Compile`, C++) holds the GIL, so no thread can
overlap it. Measured on 7 layers at Gemma-4-E2B widths (16a4w_block, hybrid, 7 shards, cProfile): `Compile` took
68.6 s of a 295 s lowering, on one of the machine's two cores; the rest is Python (graph passes, op wrappers).

How: for shard i the parent builds the op wrappers of every method in its QNN context (Python, as ExecuTorch does),
then forks. The child inherits that context and those wrappers, runs `Compile`, writes the context binary to a file
and leaves with `os._exit`; the parent drops its context and builds the next shard meanwhile. The last shard (the
lm_head's) goes first, its compile being the longest, unless memory leaves nothing to run beside it (`compile_order`).

What differs from the sequential path: libQnnHtp numbers the tensors and graphs of a context from process-wide
counters that preparing and compiling a shard advance; a worker starts from the parent's counters, which no compile
advanced, and the shards are prepared in another order. So the context binaries differ from the sequential ones in
those numbers (two sequential lowerings in one process differ from each other the same way), while a worker's
binary is byte-identical to what the parent compiles from the same state and the programs compute bit-identical
outputs (tests/test_parallel_compile.py).

Measured (7 layers at E2B widths, 7 shards, the lowering stage sequential vs 2 workers, back to back on a 2-core
machine shared with other jobs): 289.6 vs 264.4 s, 262.8 vs 324.9 s, 185.5 vs 186.0 s; the workers took 69-77 CPU s,
of which 53-58 for the last shard. The compiles can only overlap the last ~85 s of the stage (the Python before
preprocessing runs first), and only on a free core; the last shard's compile (53 s) bounds that phase from below.

Memory: a worker shares the parent's pages copy-on-write and adds the compiler's working set for its shard. A new
worker starts only while the memory the kernel reports available covers the working set expected of it (measured
on the shards compiled so far, per parameter), on top of what the running workers are still expected to take.
`workers_private_mb` gives the workers' own memory (USS) to the export's RSS sampler, so stage peaks stay honest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from optimum_qnn.exporter.by_reference import KeptArrays, weights_by_reference
from optimum_qnn.quantization.weights import resident_kb, return_free_heap
from optimum_qnn.progress import COMPILED_MESSAGE, PREPARING_MESSAGE

logger = logging.getLogger(__name__)

# The compiler's working set per parameter of a shard (`_shard_params`), before a worker has measured it: what the
# three compiles of full-size Gemma-4-E2B in 3 shards grew by, 7.5-7.7 bytes per parameter (16a4w_block), rounded up.
_DEFAULT_BYTES_PER_PARAM = 8.0
_POLL_SECONDS = 0.05

# pid -> shard index of the compile workers running now (-1: a forked SoC lowering); read by the export's RSS
# sampler thread.
_live: dict[int, int] = {}
# Reading /proc/PID/smaps_rollup walks the worker's page tables: measured 135 ms for a 2.8 GB process on a busy
# 2-core machine, so each worker's figure is re-read only after 20 times the last read's cost (at least 0.25 s),
# which keeps the sampler under 5 % of a core. pid -> (when to re-read, kB).
_private_cache: dict[int, tuple[float, int]] = {}
_MIN_REFRESH_SECONDS = 0.25


def fork_available() -> bool:
    """Forked workers need Linux: `os.fork` and /proc (the memory accounting) as this module uses them."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(os, "waitid")


def freeze_inherited() -> None:
    """In a forked child: never garbage-collect what it inherited. A collection there runs the finalizers of the
    parent's unreachable objects, onnxruntime sessions among them, whose native threads do not exist in the child:
    an edge-conversion child segfaulted "Garbage-collecting" inside torch.export after the parent had run and dropped
    onnxruntime programs (fresh-clone suite, block4_export after tests/runtime/backends)."""
    import gc

    gc.freeze()


def die_with_parent(parent: int) -> None:
    """In a forked child: be killed when the process that forked it ends (Linux `PR_SET_PDEATHSIG`), so an export
    that is killed leaves no compile or lowering running behind it, writing files nobody reads."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the request was made
        os._exit(1)


def exited(pid: int) -> bool:
    """Whether the child ``pid`` has ended, without reaping it: WNOWAIT keeps the pid reserved (a zombie) until its
    parent waits for it, so the memory sampler never reads a recycled pid."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity), or 1 where workers cannot be forked."""
    if not fork_available():
        return 1
    return max(1, len(os.sched_getaffinity(0)))


def workers_private_mb() -> float:
    """Private memory (USS: Private_Clean + Private_Dirty) of the compile workers running now, in MiB.

    The pages a worker shares copy-on-write with the parent are already in the parent's RSS; adding the workers'
    RSS instead would count them twice. Each figure is at most a few tenths of a second old (see `_private_cache`)."""
    total = 0
    for pid in list(_live):
        due, kb = _private_cache.get(pid, (0.0, 0))
        now = time.monotonic()
        if now >= due:
            kb = _private_kb(pid)
            cost = time.monotonic() - now
            if pid in _live:  # not reaped meanwhile
                _private_cache[pid] = (now + max(_MIN_REFRESH_SECONDS, 20 * cost), kb)
        total += kb
    return total / 1024


def _private_kb(pid: int) -> int:
    """USS of ``pid`` and of its own children (a SoC's forked lowering, `optimum_qnn.exporter.forked`, forks its
    shard compiles in turn)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kb = sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(child) for child in f.read().split()]
    except (OSError, ValueError, IndexError):  # exited meanwhile
        return 0
    return kb + sum(_private_kb(child) for child in children)


def _available_kb() -> float:
    """What the machine, or the memory cgroup this process runs in, has available (`memory.available_memory`)."""
    from optimum_qnn.exporter.memory import available_memory

    available = available_memory()[0]
    return float("inf") if available is None else available * 2**20


@contextlib.contextmanager
def parallel_shard_compiles(workers: int, budget_gb: float | None = None) -> Iterator[None]:
    """While active, QnnBackend compiles the shards of a multi-method lowering in up to ``workers`` processes, a new
    one only while the memory they are expected to take is available (and within ``budget_gb``, counting this
    process and its workers, when given).

    ExecuTorch's own method runs when ``workers`` is 1, fork is unavailable, a lowering has one shard, or the QNN
    options dump tensors or record API calls (saver): those write files from the compiling process."""
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend

    if workers < 1:
        raise ValueError(f"workers must be >= 1; got {workers}")
    if workers == 1 or not fork_available():
        yield
        return
    original = QnnBackend.preprocess_multimethod

    def preprocess_multimethod(edge_programs, compile_specs):
        return _preprocess(edge_programs, compile_specs, workers, original, budget_gb)

    saved = QnnBackend.__dict__["preprocess_multimethod"]
    QnnBackend.preprocess_multimethod = staticmethod(preprocess_multimethod)
    try:
        yield
    finally:
        QnnBackend.preprocess_multimethod = saved


def _preprocess(edge_programs, compile_specs, workers: int, original: Callable, budget_gb: float | None = None):
    """`preprocess_multimethod` with the compiles in worker processes: the i-th partitions of all methods make one
    context binary, as in ExecuTorch (the first method's spec serves all, which `lower_to_pte` guarantees)."""
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import flatbuffer_to_option
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import get_current_qnn_manager
    from executorch.exir.backend.backend_details import PreprocessResult

    spec = next(iter(compile_specs.values()))[0]
    option = flatbuffer_to_option(spec[0].value)
    counts = {len(programs) for programs in edge_programs.values()}
    shards = next(iter(counts))
    manager = get_current_qnn_manager(option.backend_options.backend_type, spec)
    if len(counts) != 1 or shards < 2 or option.saver or manager.IsTensorDump():
        return original(edge_programs, compile_specs)
    graph_names = list(edge_programs)
    pool = _WorkerPool(workers, shards, budget_gb)
    binaries: list[bytes | list[bytes]] = [b""] * shards
    params = [_shard_params(programs[i] for programs in edge_programs.values()) for i in range(shards)]
    room = pool.room_kb()
    order = compile_order(shards, params, room / pool.bytes_per_param * 1024)
    if order[0] != shards - 1:
        logger.info("The last shard (%.0f M parameters) compiles last: in the %.0f MiB left it fits beside no other "
                    "shard, and the others fit side by side", params[-1] / 1e6, room / 1024)
    try:
        for i in order:
            logger.info(PREPARING_MESSAGE, i + 1, shards)  # progress lines (optimum_qnn.progress)
            manager.InitContext(graph_names)
            wrappers, loaded, kept = [], [], KeptArrays()
            try:
                for programs in edge_programs.values():
                    pool.collect(binaries)  # report and reap the compiles that finished meanwhile
                    with weights_by_reference(kept):
                        built = QnnBackend._build_op_wrappers(
                            programs[i], False, option.op_package_options.op_package_infos, option.use_mha2sha,
                            option.backend_options.backend_type,
                        )
                    if isinstance(built, bytes):  # a precompiled context (context loader op): nothing to compile
                        loaded.append(built)
                    else:
                        wrappers.append([wrapper.GetOpWrapper() for wrapper in built])
                if loaded and wrappers:
                    raise RuntimeError(f"Shard {i + 1}/{shards}: some methods load a precompiled context and "
                                       "others compile one; QNN cannot mix them in one context")
                if loaded:
                    binaries[i] = loaded
                    pool.count_done()
                else:
                    return_free_heap()  # what the previous shard's op wrappers held: the fork need not share those pages
                    pool.start(i, params[i], lambda: manager.Compile(graph_names, wrappers), binaries, kept.nbytes)
            finally:
                manager.DestroyContext()
            del wrappers, loaded, kept  # the worker has its own references (its copy of this address space)
        pool.finish(binaries)
    finally:
        pool.kill()
    results = {name: [] for name in edge_programs}
    for binary in binaries:
        for j, name in enumerate(edge_programs):
            data = binary[j] if isinstance(binary, list) else binary
            results[name].append(PreprocessResult(processed_bytes=data, debug_handle_map={}))
    return results


def compile_order(shards: int, params: list[int] | None = None, room_params: float = float("inf")) -> list[int]:
    """The last shard first, then the others from the smallest: it holds the lm_head (vocabulary x hidden), the
    largest shard when the layers are split evenly (as the exporter split them before it balanced the shards by
    parameters), so its compile is the longest. Started last, it would run alone after everything else; started
    first, it overlaps the preparation and the compiles of the others (the smallest first, as the memory beside it
    allows). The exporter's balanced shards (`parameters.ParameterCounts.shard_starts`) are within a tenth of each other
    at E2B's size, and pair in any order.

    Unless nothing fits beside it: when the memory left (``room_params``, in parameters the compiler's working set
    covers) does not hold the last shard's compile (``params[-1]``) beside even the smallest other one, while two
    others fit side by side, those go first, from the largest, and it last. Measured at full-size Gemma-4-E2B in a 16 GB
    cgroup, 4 shards (989 M parameters in the last, 348, 422 and 522 M in the others; 11059 MiB left, 1382 M at 8 bytes
    per parameter): the rule had asked whether it fits beside the largest other one, and compiled it last, alone for
    153 s, where it fits beside the smallest. From the largest: in 3 shards (478 M and 651 M beside each other, then
    the lm_head's 1223 M), the smaller one started first finished 46-57 s before the other, which then compiled alone
    while the last waited for both; started second, it ends with the larger one, the core in between busy."""
    if shards < 2:
        return list(range(shards))
    others = list(range(shards - 1))
    if params is not None:
        others.sort(key=lambda i: params[i])
        if shards > 2 and params[-1] + params[others[0]] > room_params >= sum(params[i] for i in others[-2:]):
            return [*reversed(others), shards - 1]
    return [shards - 1, *others]


def _shard_params(programs) -> int:
    """Parameters the compile of one shard takes: the weights its graphs' ops read, each once (the methods of a
    context share theirs, as different tensor objects over the same memory). A weight no op reads compiles to
    nothing: ExecuTorch leaves the token table (262144 x 1536 at E2B widths) among the inputs of the first shard
    of each method, unread. Counting every state_dict tensor of every method once per object, the gate expected
    5515 M parameters of the first of three full-size E2B shards (432 M) and made every compile wait for the
    one before it."""
    import torch

    seen: dict[tuple[int, int], int] = {}
    for program in programs:
        signature = program.graph_signature
        targets = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
                   **signature.inputs_to_lifted_tensor_constants}
        for node in program.graph.nodes:
            if node.op != "placeholder" or not node.users or node.name not in targets:
                continue
            tensor = program.state_dict.get(targets[node.name], program.constants.get(targets[node.name]))
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                seen[(tensor.data_ptr(), tensor.numel())] = tensor.numel()
    return sum(seen.values())


class _WorkerPool:
    """At most ``workers`` forked compiles at once, each writing its context binary (or its error) to a file."""

    def __init__(self, workers: int, shards: int, budget_gb: float | None = None):
        self.workers, self.shards = workers, shards
        self.budget_kb = None if budget_gb is None else budget_gb * 2**20
        self.done = 0
        self.folder = tempfile.TemporaryDirectory(prefix="optimum-qnn-compile-")
        self.running: dict[int, tuple[int, int, int]] = {}  # pid -> (shard, parameters, kB it inherits to hold)
        self.bytes_per_param = _DEFAULT_BYTES_PER_PARAM
        self.compile_cpu_seconds = 0.0  # summed over the workers, from their rusage

    def start(self, shard: int, params: int, compile_fn: Callable[[], object], binaries: list, kept: int = 0) -> None:
        """Fork a worker that compiles ``shard``, once a slot is free and the memory it is expected to take is.
        ``kept``: bytes of this process's memory the worker reads (the shard's `KeptArrays`), which this process lets
        go after the fork: they become the worker's own."""
        while self.running and (len(self.running) >= self.workers or not self._memory_allows(params)):
            self._wait_one(binaries)
        path = self._path(shard)
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            freeze_inherited()
            die_with_parent(parent)
            _compile_and_exit(compile_fn, path)
        self.running[pid] = (shard, params, kept // 1024)
        _live[pid] = shard
        logger.debug("Shard %d/%d: compiling in worker %d (%d running)", shard + 1, self.shards, pid, len(self.running))

    def _memory_allows(self, params: int) -> bool:
        """Whether the memory left covers the new worker's expected working set plus what the running ones may
        still take (their expected set minus what they hold already). Left: what the machine (or the cgroup) has
        available and, with a budget (the export's --max-memory, or the default it chose the shards for), the budget
        less this process's anonymous memory and its workers' own. This process's file pages (the checkpoint's
        mapped weights, read again as the op wrappers are built: 3.1 GB of the 6.8 GB RSS of a full-size
        Gemma-4-E2B lowering, measured) are left out: the kernel drops them under pressure, and the memory
        available counts them as free."""
        private = {pid: _private_kb(pid) for pid in self.running}
        pending = sum(max(0, p * self.bytes_per_param / 1024 + kept - private[pid])
                      for pid, (_, p, kept) in self.running.items())
        need = params * self.bytes_per_param / 1024 + pending
        system, budget = self._rooms(private)
        available = min(system, budget)
        if available >= need:
            return True
        logger.info("Waiting for a compile to finish: about %.0f MiB needed (%.0f for the next shard at %.1f bytes per "
                    "parameter, %.0f still to come from the running ones), %.0f MiB available to the system, %.0f left "
                    "in the budget", need / 1024, params * self.bytes_per_param / 2**20, self.bytes_per_param,
                    pending / 1024, system / 1024, budget / 1024)
        return False

    def _rooms(self, private: dict[int, int]) -> tuple[float, float]:
        """kB (what the system has available, what the budget leaves beside this process and the running workers)."""
        budget = float("inf") if self.budget_kb is None else self.budget_kb - resident_kb()[1] - sum(private.values())
        return _available_kb(), budget

    def room_kb(self) -> float:
        """The memory new compiles may take now, in kB (the smaller of the system's and the budget's room)."""
        return min(self._rooms({pid: _private_kb(pid) for pid in self.running}))

    def collect(self, binaries: list) -> None:
        """Reap the workers that finished, without waiting."""
        for pid in list(self.running):
            if self._finished(pid):
                self._reap(pid, binaries)

    def finish(self, binaries: list) -> None:
        while self.running:
            self._wait_one(binaries)

    def _wait_one(self, binaries: list) -> None:
        while True:
            for pid in list(self.running):
                if self._finished(pid):
                    self._reap(pid, binaries)
                    return
            time.sleep(_POLL_SECONDS)

    @staticmethod
    def _finished(pid: int) -> bool:
        return exited(pid)

    def _reap(self, pid: int, binaries: list) -> None:
        shard, params, _ = self.running.pop(pid)
        _live.pop(pid, None)
        _private_cache.pop(pid, None)
        _, status, usage = os.wait4(pid, 0)
        seconds = usage.ru_utime + usage.ru_stime
        path = self._path(shard)
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            raise RuntimeError(
                f"The QNN compile of shard {shard + 1}/{self.shards} was killed by signal {signal.Signals(number).name} "
                f"in its worker process {pid}" + (" (the kernel kills with SIGKILL when memory runs out: lower "
                "with fewer workers, e.g. workers=1, or more shards)" if number == signal.SIGKILL else "")
            )
        code = os.WEXITSTATUS(status)
        if code != 0:
            error = path.with_suffix(".err")
            text = error.read_text(errors="replace").strip() if error.exists() else "(no error text)"
            raise RuntimeError(f"The QNN compile of shard {shard + 1}/{self.shards} failed in its worker process "
                               f"{pid} (exit code {code}):\n{text}")
        binaries[shard] = path.read_bytes()
        path.unlink()
        self.count_done()
        # ru_maxrss counts the pages mapped at fork (fewer than the parent's: file pages are not copied): what the
        # compile added is the peak above the RSS the worker started with, less the file pages it read meanwhile
        # (the weights QNN reads by reference: the kernel drops those under pressure and reads them again).
        start_kb, file_kb = (int(v) for v in path.with_suffix(".rss").read_text().split())
        grown_kb = max(0, usage.ru_maxrss - start_kb - file_kb)
        if params:
            self.bytes_per_param = max(self.bytes_per_param, grown_kb * 1024 / params)
        self.compile_cpu_seconds += seconds
        logger.info("Shard %d/%d compiled in %.1f CPU s, its worker grew by %.0f MiB (%d parameters)",
                     shard + 1, self.shards, seconds, grown_kb / 1024, params)

    def count_done(self) -> None:
        self.done += 1
        logger.info(COMPILED_MESSAGE, self.done, self.shards)

    def _path(self, shard: int) -> Path:
        return Path(self.folder.name) / f"shard{shard}.bin"

    def kill(self) -> None:
        """Stop and reap the workers still running (the lowering failed) and remove the files."""
        for pid in list(self.running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self.running.pop(pid)
            _live.pop(pid, None)
            _private_cache.pop(pid, None)
        self.folder.cleanup()
        if self.compile_cpu_seconds:
            logger.debug("The compile workers took %.1f CPU s", self.compile_cpu_seconds)


def _compile_and_exit(compile_fn: Callable[[], object], path: Path) -> None:
    """The worker's whole life: compile, write the binary (or the error text), leave without Python's shutdown
    (no atexit hooks, no flushing of buffers inherited from the parent, no logging handlers run)."""
    code = 1
    try:
        start_kb, start_anon_kb = resident_kb()
        import torch

        torch.set_num_threads(1)
        binary = _as_buffer(compile_fn())
        rss, anon = resident_kb()
        path.with_suffix(".rss").write_text(f"{start_kb} {max(0, (rss - anon) - (start_kb - start_anon_kb))}")
        if not binary.nbytes:
            raise RuntimeError("QNN returned an empty context binary")
        with open(path, "wb") as f:
            f.write(binary)
        code = 0
    except BaseException:  # noqa: BLE001 - everything goes to the parent, which raises it
        with contextlib.suppress(BaseException):
            path.with_suffix(".err").write_text(traceback.format_exc())
    finally:
        os._exit(code)


def _as_buffer(binary) -> memoryview:
    """The compile's context binary as a view of its own memory (PyQnnManager returns an array): a `bytes` copy
    would add the whole binary (603 MB for Gemma-4-E2B's largest context) to the worker's peak, at its end, when the
    compiler's working set is largest (measured: the worker's private memory rose from 8.0 to 9.3 GB in its last
    seconds)."""
    try:
        return memoryview(binary).cast("B")
    except TypeError:  # not a buffer (e.g. a list of ints)
        return memoryview(bytes(binary))

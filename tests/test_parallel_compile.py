"""optimum_qnn.exporter.parallel_compile: shards compiled in forked workers, their failures, and their memory.

What "the same program" means here. libQnnHtp numbers the tensors and graphs of every context from process-wide
counters that preparing and compiling a shard advance. A sequential lowering compiles shard i after shards 0..i-1
advanced them; a worker compiles from the counters the parent had when it forked, and the parent prepares the last
shard first. So the context binaries of a parallel lowering differ from the sequential ones in those numbers (two
sequential lowerings in one process differ the same way). The checks below pin down the rest: a worker's binary is
byte-identical to what the parent compiles from the same state, and the parallel and sequential programs compute
bit-identical outputs on the x86 HTP emulator.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from optimum_qnn.exporter import parallel_compile
from optimum_qnn.exporter.parallel_compile import _WorkerPool, workers_private_mb
from tests.htp_graphs import lower_stack, stack_and_inputs

needs_fork = pytest.mark.skipif(not parallel_compile.fork_available(), reason="compile workers need Linux fork")


# --- the worker pool, without QNN ----------------------------------------------------------------------------------


def _run(pool: _WorkerPool, fns) -> list:
    binaries = [b""] * len(fns)
    try:
        for shard, fn in enumerate(fns):
            pool.start(shard, 0, fn, binaries)
        pool.finish(binaries)
    finally:
        pool.kill()
    return binaries


def _wait_for(path: Path, seconds: float = 120.0) -> bool:
    """Whether ``path`` appeared within ``seconds`` (a generous ceiling: only a broken pool reaches it)."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


@needs_fork
def test_workers_return_their_binaries_in_shard_order(tmp_path):
    def compile_fn(i):
        if i < 2:  # shard i ends only after shard i + 1 has ended: the last shard ends first, whatever the load
            assert _wait_for(tmp_path / f"end{i + 1}")
        (tmp_path / f"end{i}").touch()
        return f"ctx{i}".encode()

    assert _run(_WorkerPool(workers=3, shards=3), [lambda i=i: compile_fn(i) for i in range(3)]) == [b"ctx0", b"ctx1", b"ctx2"]


@needs_fork
def test_a_failing_compile_names_its_shard_and_error():
    def fail():
        raise ValueError("op Foo has no HTP kernel")

    with pytest.raises(RuntimeError, match=r"(?s)shard 2/2 failed in its worker process \d+ \(exit code 1\).*op Foo"):
        _run(_WorkerPool(workers=2, shards=2), [lambda: b"ok", fail])
    assert not parallel_compile._live


@needs_fork
def test_a_worker_killed_by_a_signal_fails_the_lowering(tmp_path):
    """What the kernel's OOM killer does to a worker: the lowering stops with a clear error instead of hanging."""
    started, finished = tmp_path / "started", tmp_path / "finished"

    def long_compile():
        started.touch()
        time.sleep(600)
        finished.touch()
        return b"late"

    def killed():
        _wait_for(started)  # the other worker is compiling when this one dies
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RuntimeError, match=r"shard 1/2 was killed by signal SIGKILL .* when memory runs out"):
        _run(_WorkerPool(workers=2, shards=2), [killed, long_compile])
    assert started.exists() and not finished.exists()  # the compiling worker was killed, not waited for
    assert not parallel_compile._live


@needs_fork
def test_at_most_workers_compile_at_once(tmp_path):
    """Counted, not timed: each compile sees which others are running; the first two wait for each other, which only
    works if two run at once."""
    def compile_fn(i):
        (tmp_path / f"running{i}").touch()
        (tmp_path / f"arrived{i}").touch()
        seen = len(list(tmp_path.glob("running*")))
        if i < 2:
            assert _wait_for(tmp_path / f"arrived{1 - i}")  # both first shards compile at the same time
        (tmp_path / f"seen{i}").write_text(str(seen))
        (tmp_path / f"running{i}").unlink()
        return b"x"

    _run(_WorkerPool(workers=2, shards=4), [lambda i=i: compile_fn(i) for i in range(4)])
    assert max(int((tmp_path / f"seen{i}").read_text()) for i in range(4)) <= 2


def test_a_shard_counts_the_weights_its_ops_read_once():
    """What a shard's compile is expected to take: the weights its graphs read, each once across its methods (the
    same memory under other tensor objects), not a weight no op reads (ExecuTorch leaves the token table among the
    first shard's inputs)."""

    class Shard(nn.Module):
        def __init__(self):
            super().__init__()
            self.read = nn.Parameter(torch.randn(64, 32))
            self.unread = nn.Parameter(torch.randn(1000, 32))

        def forward(self, x):
            return x @ self.read.T

    module = Shard()
    methods = [torch.export.export(module, (torch.randn(n, 32),)) for n in (1, 4)]
    for name, tensor in methods[1].state_dict.items():
        methods[1].state_dict[name] = tensor.detach()  # another object over the same memory
    assert methods[1].state_dict["read"] is not module.read
    assert parallel_compile._shard_params(methods) == 64 * 32


@pytest.mark.parametrize("room, order", [
    (float("inf"), [2, 0, 1]),  # room for all: the lm_head shard first, the others compile beside it
    (1200, [1, 0, 2]),  # full-size E2B in 16 GB: it fits beside neither other one, the two others fit together
    (800, [2, 0, 1]),  # the two others do not fit together either: one at a time, whatever the order
    (1700, [2, 0, 1]),  # it fits beside the largest other one
    (1550, [2, 0, 1]),  # beside the smallest only: that one compiles beside it
])
def test_the_lm_head_shard_goes_first_unless_nothing_fits_beside_it(room, order):
    """Shards of 432 M, 470 M and 1107 M parameters (full-size Gemma-4-E2B in 3 shards), ``room`` M parameters of
    compiler working set left."""
    params = [432_000_000, 470_000_000, 1_107_000_000]
    assert parallel_compile.compile_order(3, params, room * 1_000_000) == order
    assert parallel_compile.compile_order(2, params[1:], 100) == [1, 0]  # a single other shard: nothing to pair
    assert parallel_compile.compile_order(3) == [2, 0, 1]
    # Full-size E2B in 4 shards, 16 GB: the lm_head shard fits beside the smallest other one (1382 M left).
    assert parallel_compile.compile_order(4, [348_000_000, 422_000_000, 522_000_000, 989_000_000], 1382e6) == [3, 0, 1, 2]
    # The others from the smallest, when the last goes first.
    assert parallel_compile.compile_order(4, [500, 300, 400, 2000]) == [3, 1, 2, 0]
    # From the largest when it goes last: the pair that starts together ends together.
    assert parallel_compile.compile_order(4, [500, 300, 400, 2000], 1000) == [0, 2, 1, 3]


@needs_fork
def test_no_new_worker_while_memory_does_not_cover_it(monkeypatch):
    """With MemAvailable below what a shard is expected to take, a worker starts only when the others are done."""
    monkeypatch.setattr(parallel_compile, "_available_kb", lambda: 0)
    pool, binaries = _WorkerPool(workers=2, shards=2), [b"", b""]
    try:
        pool.start(0, 1_000_000, lambda: (time.sleep(0.5), b"first")[1], binaries)
        pool.start(1, 1_000_000, lambda: b"second", binaries)
        assert binaries[0] == b"first"  # the second start waited for the first compile
        pool.finish(binaries)
    finally:
        pool.kill()


@needs_fork
@pytest.mark.parametrize("budget_gb, waits", [(0.001, True), (1000.0, False)])
def test_the_export_budget_caps_the_workers(monkeypatch, budget_gb, waits):
    """With plenty available on the machine, a second worker still waits when this process plus the running
    worker leave no room for it in the export's memory budget, and does not when the budget has room."""
    monkeypatch.setattr(parallel_compile, "_available_kb", lambda: float("inf"))
    pool, binaries = _WorkerPool(workers=2, shards=2, budget_gb=budget_gb), [b"", b""]
    try:
        pool.start(0, 1000, lambda: (time.sleep(0.5), b"first")[1], binaries)
        pool.start(1, 1000, lambda: b"second", binaries)
        assert (binaries[0] == b"first") is waits
        pool.finish(binaries)
    finally:
        pool.kill()


@needs_fork
def test_the_budget_counts_this_process_s_anonymous_memory_not_its_file_pages(monkeypatch, tmp_path):
    """A file this process has read through a mapping (the checkpoint's weights) is in its RSS but not in what the
    budget must hold: the kernel drops those pages under pressure."""
    import mmap

    from optimum_qnn.quantization.weights import resident_kb

    monkeypatch.setattr(parallel_compile, "_available_kb", lambda: float("inf"))
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\1" * (256 * 2**20))
    with data.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE)) == len(mapped) // mmap.PAGESIZE
        rss, anon = resident_kb()
        budget_kb = anon + 100 * 1024  # room in anonymous memory for a 1000-parameter compile, none beside the file
        assert rss > budget_kb
        pool = _WorkerPool(workers=2, shards=2, budget_gb=budget_kb / 2**20)
        try:
            assert pool._memory_allows(1000)
            assert not pool._memory_allows(200 * 2**20 // 7)  # 200 MB expected: more than the room
        finally:
            pool.kill()


@needs_fork
def test_workers_private_memory_is_counted(tmp_path):
    """The export's RSS sampler adds the workers' own pages: 200 MiB a worker touches show up while it runs."""
    release = tmp_path / "release"

    def hold_memory():
        block = bytearray(200 * 2**20)  # zero-filled: every page written
        while not release.exists():
            time.sleep(0.02)
        return bytes(block[:1]) + b"done"

    pool, binaries = _WorkerPool(workers=1, shards=1), [b""]
    try:
        pool.start(0, 0, hold_memory, binaries)
        deadline = time.monotonic() + 30
        while workers_private_mb() < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers_private_mb() >= 200
        release.write_text("")
        pool.finish(binaries)
    finally:
        pool.kill()
    assert binaries == [b"\0done"]
    assert workers_private_mb() == 0


@needs_fork
def test_stage_peak_includes_the_workers_memory(tmp_path):
    """The export's per-stage peak counts what its compile workers hold, not only the parent's RSS."""
    from optimum_qnn.exporter.pipeline import ExportResult, _rss_mb, _stage

    release, result = tmp_path / "release", ExportResult(tmp_path)
    before = _rss_mb()

    def hold_memory():
        block = bytearray(300 * 2**20)
        while not release.exists():
            time.sleep(0.02)
        return bytes(block[:1])

    pool, binaries = _WorkerPool(workers=1, shards=1), [b""]
    try:
        with _stage(result, "lower"):
            pool.start(0, 0, hold_memory, binaries)
            deadline = time.monotonic() + 30
            while workers_private_mb() < 300 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # a few samples (every 50 ms) after the worker's figure was refreshed
            release.write_text("")
            pool.finish(binaries)
    finally:
        pool.kill()
    assert result.stages[0].peak_rss_mb >= before + 280, result.stage_table()


@needs_fork
def test_progress_bar_counts_compiled_shards_and_console_stays_quiet(caplog):
    """The lowering's progress advances per compiled shard; the lines reach it only, not the root's handlers (the
    CLI's console handler shows every optimum_qnn record)."""
    from optimum_qnn.progress import LoweringProgress, progress_lines_to

    caplog.set_level(logging.INFO)
    bar = LoweringProgress("Lowering")
    counts = []
    with progress_lines_to(bar):
        pool, binaries = _WorkerPool(workers=2, shards=3), [b""] * 3
        try:
            for shard in range(3):
                pool.start(shard, 0, lambda: b"ctx", binaries)
            while pool.running:
                pool.collect(binaries)
                counts.append(bar.n)
                time.sleep(0.05)
        finally:
            pool.kill()
    assert (bar.n, bar.total) == (3, 3) and counts == sorted(counts)
    assert "Compiled shard" not in caplog.text


# --- real QNN compiles ---------------------------------------------------------------------------------------------


def test_workers_below_one_are_refused(qnn_sdk):
    from optimum_qnn.config import Soc
    from optimum_qnn.exporter.lowering import lower_to_pte

    with pytest.raises(ValueError, match="workers must be >= 1"):
        lower_to_pte({"forward": (nn.Linear(4, 4), (torch.randn(1, 4),))}, Soc.SM8650, fp16=True, workers=0)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _lower_logging(workers: int):
    source, messages = logging.getLogger(parallel_compile.__name__), _Messages()
    level = source.level
    source.addHandler(messages)
    source.setLevel(logging.DEBUG)
    try:
        return lower_stack(workers), messages.lines
    finally:
        source.removeHandler(messages)
        source.setLevel(level)


@pytest.fixture(scope="module")
def sequential_and_parallel(qnn_sdk):
    """The stack lowered with workers=1 and with 2 workers, each with what this module logged meanwhile."""
    return _lower_logging(workers=1), _lower_logging(workers=2)


def _worker_pids(lines: list[str]) -> set[int]:
    return {int(m) for line in lines for m in re.findall(r"compiling in worker (\d+)", line)}


@needs_fork
def test_parallel_lowering_forks_one_worker_per_shard(sequential_and_parallel):
    (_, sequential_lines), (parallel, lines) = sequential_and_parallel
    assert not sequential_lines  # workers=1: ExecuTorch's own path, in this process
    workers = _worker_pids(lines)
    assert parallel.shards == 3 and len(workers) == 3 and os.getpid() not in workers
    assert [line for line in lines if line.startswith("Compiled shard")] == [
        "Compiled shard 1/3", "Compiled shard 2/3", "Compiled shard 3/3"]


@needs_fork
def test_parallel_program_computes_what_the_sequential_one_does(sequential_and_parallel):
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (the CPU kernel of llama::fallback)
    from executorch.runtime import Runtime

    from optimum_qnn.artifacts.inspection.pte import qnn_delegates

    (sequential, _), (parallel, _) = sequential_and_parallel
    assert parallel.delegation == sequential.delegation and parallel.shards == 3
    assert len(parallel.buffer) == len(sequential.buffer)
    seq_delegates, par_delegates = qnn_delegates(sequential.buffer), qnn_delegates(parallel.buffer)
    assert [len(d.binary) for d in par_delegates] == [len(d.binary) for d in seq_delegates]
    _, inputs = stack_and_inputs()
    outputs = {}
    for lowered in (sequential, parallel):
        program = Runtime.get().load_program(lowered.buffer)
        outputs[id(lowered)] = {name: program.load_method(name).execute(list(args))[0].clone() for name, args in inputs.items()}
    seq_out, par_out = outputs[id(sequential)], outputs[id(parallel)]
    module, _ = stack_and_inputs()
    for name, args in inputs.items():
        assert torch.equal(par_out[name], seq_out[name]), name
        cosine = torch.nn.functional.cosine_similarity(par_out[name].flatten(), module(*args).flatten(), dim=0)
        assert cosine > 0.999, (name, cosine)  # and both compute the model (fp16 on the HTP)


@needs_fork
def test_a_worker_compiles_exactly_what_the_parent_would(qnn_sdk, monkeypatch):
    """Fork safety, byte for byte: right after a worker is forked for a shard, the parent compiles the same shard
    itself from the same QNN state; every context binary in the .pte (the workers') equals the parent's."""
    from executorch.backends.qualcomm.python import PyQnnManagerAdaptor

    from optimum_qnn.artifacts.inspection.pte import qnn_delegates

    in_parent: dict[int, bytes] = {}
    fork_and_compile = _WorkerPool.start

    def start(self, shard, params, compile_fn, binaries, kept=0):
        fork_and_compile(self, shard, params, compile_fn, binaries, kept)
        in_parent[shard] = bytes(PyQnnManagerAdaptor.StripProtocol(bytes(compile_fn())))

    monkeypatch.setattr(_WorkerPool, "start", start)
    delegates = qnn_delegates(lower_stack(workers=2).buffer)
    assert sorted(in_parent) == [0, 1, 2] and len(delegates) == 6  # 3 shards x 2 methods sharing each context
    for delegate in delegates:
        assert delegate.binary == in_parent[delegate.index], (delegate.method, delegate.index)
    assert len({d.binary for d in delegates}) == 3


@needs_fork
def test_a_forked_child_dies_with_the_process_that_forked_it(tmp_path):
    """`die_with_parent`: a compile worker or a SoC's lowering does not outlive an export that was killed."""
    marker = tmp_path / "grandchild"
    middle = os.fork()
    if middle == 0:  # stands for the export
        parent = os.getpid()
        child = os.fork()
        if child == 0:  # stands for its worker
            parallel_compile.die_with_parent(parent)
            marker.write_text(str(os.getpid()))
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
        os._exit(0)
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    worker = int(marker.read_text())
    os.kill(middle, signal.SIGKILL)
    os.waitpid(middle, 0)
    deadline = time.monotonic() + 10
    while _running(worker):
        assert time.monotonic() < deadline, "the worker outlived the process that forked it"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

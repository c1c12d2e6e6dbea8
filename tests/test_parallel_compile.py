"""optimum_qnn.parallel_compile: shards compiled in forked workers, their failures, and their memory.

What "the same program" means here. The QNN HTP library numbers the tensors (and a second kind of object) of every
context from process-wide counters that creating a graph advances. A sequential lowering compiles shard i after
shards 0..i-1 advanced those counters; a worker compiles shard i from the counters the parent had when it forked,
where no shard was compiled. So only the FIRST shard's context binary can be byte-identical between the two (as it
is, measured here in fresh processes); every other shard differs in those numbers only, by the same amounts
throughout a shard. Two sequential lowerings in one process differ the same way. The checks below assert exactly
that, and that the programs compute bit-identical outputs on the x86 HTP emulator.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import struct
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from optimum_qnn import parallel_compile
from optimum_qnn.parallel_compile import _WorkerPool, workers_private_mb

needs_fork = pytest.mark.skipif(not parallel_compile.fork_available(), reason="compile workers need Linux fork")


class _Layer(nn.Module):
    """RMSNorm -> linear -> gelu -> linear, residual: one shard's worth of HTP ops."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(dim) + 0.5)
        self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.down(nn.functional.gelu(self.up(h), approximate="tanh"))


class Stack(nn.Module):
    """`layers.N` like the Gemma4 static model, so `shard_starts` cut it between layers."""

    def __init__(self, layers: int = 3, dim: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack_and_inputs():
    torch.manual_seed(0)
    return Stack().eval(), {"prefill_forward": (torch.randn(1, 4, 64),), "kv_forward": (torch.randn(1, 1, 64),)}


def lower_stack(workers: int):
    from optimum_qnn.config import Soc
    from optimum_qnn.lowering import lower_to_pte

    module, inputs = stack_and_inputs()
    programs = {name: (module, example) for name, example in inputs.items()}
    return lower_to_pte(programs, Soc.SM8650, fp16=True, shard_starts=(1, 2), weight_sharing=False, workers=workers)


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


@needs_fork
def test_workers_return_their_binaries_in_shard_order():
    fns = [lambda i=i: (time.sleep(0.3 * (2 - i)), f"ctx{i}".encode())[1] for i in range(3)]  # the last ends first
    assert _run(_WorkerPool(workers=3, shards=3), fns) == [b"ctx0", b"ctx1", b"ctx2"]


@needs_fork
def test_a_failing_compile_names_its_shard_and_error():
    def fail():
        raise ValueError("op Foo has no HTP kernel")

    with pytest.raises(RuntimeError, match=r"(?s)shard 2/2 failed in its worker process \d+ \(exit code 1\).*op Foo"):
        _run(_WorkerPool(workers=2, shards=2), [lambda: b"ok", fail])
    assert not parallel_compile._live


@needs_fork
def test_a_worker_killed_by_a_signal_fails_the_lowering():
    """What the kernel's OOM killer does to a worker: the lowering stops with a clear error instead of hanging."""
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"shard 1/2 was killed by signal SIGKILL .* when memory runs out"):
        _run(_WorkerPool(workers=2, shards=2), [lambda: os.kill(os.getpid(), signal.SIGKILL), lambda: time.sleep(60)])
    assert time.perf_counter() - t0 < 30  # the sleeping worker was killed, not waited for
    assert not parallel_compile._live


@needs_fork
def test_at_most_workers_compile_at_once(tmp_path):
    def compile_fn(i):
        (tmp_path / f"start{i}").write_text(str(time.monotonic()))
        time.sleep(0.4)
        (tmp_path / f"end{i}").write_text(str(time.monotonic()))
        return b"x"

    _run(_WorkerPool(workers=2, shards=4), [lambda i=i: compile_fn(i) for i in range(4)])
    spans = [(float((tmp_path / f"start{i}").read_text()), float((tmp_path / f"end{i}").read_text())) for i in range(4)]
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == 2


@needs_fork
def test_no_new_worker_while_memory_does_not_cover_it(monkeypatch):
    """With MemAvailable below what a shard is expected to take, a worker starts only when the others are done."""
    monkeypatch.setattr(parallel_compile, "_meminfo_kb", lambda field: 0)
    pool, binaries = _WorkerPool(workers=2, shards=2), [b"", b""]
    try:
        pool.start(0, 1_000_000, lambda: (time.sleep(0.5), b"first")[1], binaries)
        pool.start(1, 1_000_000, lambda: b"second", binaries)
        assert binaries[0] == b"first"  # the second start waited for the first compile
        pool.finish(binaries)
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


# --- real QNN compiles ---------------------------------------------------------------------------------------------


def test_workers_below_one_are_refused(qnn_sdk):
    from optimum_qnn.config import Soc
    from optimum_qnn.lowering import lower_to_pte

    with pytest.raises(ValueError, match="workers must be >= 1"):
        lower_to_pte({"forward": (nn.Linear(4, 4), (torch.randn(1, 4),))}, Soc.SM8650, fp16=True, workers=0)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def sequential_and_parallel(qnn_sdk):
    """The stack lowered with workers=1 and with 2 workers, and what the parallel lowering logged."""
    sequential = lower_stack(workers=1)
    source, messages = logging.getLogger(parallel_compile.__name__), _Messages()
    level = source.level
    source.addHandler(messages)
    source.setLevel(logging.DEBUG)
    try:
        parallel = lower_stack(workers=2)
    finally:
        source.removeHandler(messages)
        source.setLevel(level)
    return sequential, parallel, messages.lines


@needs_fork
def test_parallel_lowering_forks_one_worker_per_shard(sequential_and_parallel):
    _, parallel, lines = sequential_and_parallel
    workers = {int(m) for line in lines for m in re.findall(r"compiling in worker (\d+)", line)}
    assert parallel.shards == 3 and len(workers) == 3 and os.getpid() not in workers
    assert [line for line in lines if line.startswith("Compiled shard")] == [
        "Compiled shard 1/3", "Compiled shard 2/3", "Compiled shard 3/3"]


@needs_fork
def test_parallel_program_computes_what_the_sequential_one_does(sequential_and_parallel):
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (the CPU kernel of llama::fallback)
    from executorch.runtime import Runtime

    from optimum_qnn.lowering import read_qnn_delegates

    sequential, parallel, _ = sequential_and_parallel
    assert parallel.delegation == sequential.delegation and parallel.shards == 3
    assert len(parallel.buffer) == len(sequential.buffer)
    seq_delegates, par_delegates = read_qnn_delegates(sequential.buffer), read_qnn_delegates(parallel.buffer)
    assert [len(d.context) for d in par_delegates] == [len(d.context) for d in seq_delegates]
    _, inputs = stack_and_inputs()
    outputs = {}
    for lowered in (sequential, parallel):
        program = Runtime.get().load_program(lowered.buffer)
        outputs[id(lowered)] = {name: program.load_method(name).execute(list(args))[0].clone() for name, args in inputs.items()}
    seq_out, par_out = outputs[id(sequential)], outputs[id(parallel)]
    for name in inputs:
        assert torch.equal(par_out[name], seq_out[name]), name


_LOWER_SCRIPT = textwrap.dedent("""
    import pickle, sys
    sys.path.insert(0, {tests!r})
    from test_parallel_compile import lower_stack
    from optimum_qnn.lowering import read_qnn_delegates
    lowered = lower_stack(workers=int(sys.argv[1]))
    pickle.dump([d.context for d in read_qnn_delegates(lowered.buffer)], open(sys.argv[2], "wb"))
""")


@needs_fork
@pytest.mark.slow
def test_fresh_process_binaries_differ_only_in_qnn_object_numbers(run_python, tmp_path):
    """Sequential vs parallel, each in a fresh process: the first shard's context is byte-identical; in the others,
    every differing 32-bit word is larger in the sequential binary by one of at most two amounts per shard (the
    numbers the earlier shards took from QNN's counters), and those amounts grow from shard to shard."""
    script = tmp_path / "lower.py"
    script.write_text(_LOWER_SCRIPT.format(tests=os.path.dirname(__file__)))
    contexts = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}.pkl"
        proc = run_python(str(script), str(workers), str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        contexts[workers] = pickle.loads(out.read_bytes())
    sequential, parallel = contexts[1], contexts[3]
    assert len(sequential) == len(parallel) == 6  # 3 shards x 2 methods (each method's delegates share a context)
    shifts = []
    for seq, par in zip(sequential, parallel):
        assert len(seq) == len(par)
        words = {i - i % 4 for i in range(len(seq)) if seq[i] != par[i]}
        deltas = {struct.unpack_from("<I", seq, w)[0] - struct.unpack_from("<I", par, w)[0] for w in words}
        assert len(deltas) <= 2 and all(0 < d < 2**16 for d in deltas), sorted(deltas)[:8]
        shifts.append(min(deltas, default=0))
    assert shifts[0] == 0 and sequential[0] == parallel[0]
    assert 0 < shifts[1] < shifts[2]
    assert shifts[3:] == shifts[:3]  # the second method's delegates are the same three contexts

"""Lower exported graphs to one ExecuTorch program (.pte) whose QNN delegates are HTP context binaries.

Several methods (hybrid mode: `prefill_forward` with ar_len N and `kv_forward` with ar_len 1) are lowered in ONE
call. ExecuTorch 1.5.1's `QnnBackend.preprocess_multimethod` then compiles the i-th partition of every method
into one shared HTP context binary, and the serializer stores that binary once in the .pte. With
`weight_sharing=True` the graphs of that context also share one copy of their weights (the on-device choice).

Measured with the QAIRT 2.49.40 libraries of onnxruntime-qnn 2.5.0 (tiny attention block, two methods): with weight
sharing the context is smaller (weights once) but the x86 HTP emulator cannot load it (`Shared weights buffer isn't
supported on this platform`, then a segfault in `load_method`); without, each graph holds its own weights and it
runs there. So artifacts meant for the emulator (tests, parity checks on x86) pass `weight_sharing=False`.

Example:
    >>> programs = {"prefill_forward": (block, prefill_inputs), "kv_forward": (block, decode_inputs)}
    >>> lowered = lower_to_pte(programs, Soc.SM8650, fp16=True, constant_methods={"get_max_seq_len": 64})
    >>> lowered.write("model.pte"); print(format_delegation(lowered.delegation))  # optimum_qnn.exporter.delegation
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from optimum_qnn.config import Soc
from optimum_qnn.environment import env_switch
from optimum_qnn.errors import QnnCompileError
from optimum_qnn.exporter.htp_limits import qnn_refusal_message
from optimum_qnn.exporter.delegation import MethodDelegation, delegation_summary
from optimum_qnn.exporter.edge import (
    EDGE_SIDE_BY_SIDE_VARIABLE,
    SHARD_OP,
    MethodSource,
    copy_sharing_tensors,
    export_method,
    lower_edge,
    release_example_inputs,
    to_edge,
    to_edge_in_parallel,
)
from optimum_qnn.quantization.weights import return_free_heap
from optimum_qnn.exporter.program_transfer import SharedTensors
from optimum_qnn.native_output import quiet_native_output
from optimum_qnn.exporter.forked import Forked
from optimum_qnn.exporter.parallel_compile import default_workers, fork_available
from optimum_qnn.progress import report_step
from optimum_qnn.sdk import ensure_qnn_sdk

if TYPE_CHECKING:  # pragma: no cover
    from executorch.exir import EdgeProgramManager
    from executorch.exir.backend.compile_spec_schema import CompileSpec

logger = logging.getLogger(__name__)


_OP_NAME_RE = re.compile(r"\w+\.\w+\.\w+")


def compile_specs(
    soc: Soc,
    *,
    fp16: bool,
    multiple_graphs: bool = False,
    weight_sharing: bool | None = None,
    shared_buffer: bool = False,
    multiple_contexts: bool = False,
    debug: bool = False,
) -> list[CompileSpec]:
    """ExecuTorch compile specs that target the HTP of `soc`.

    Args:
        soc: the target SoC.
        fp16: compile a floating-point graph at HTP fp16 precision; False for a PT2E-quantized graph.
        multiple_graphs: the spec is shared by several methods compiled into one context (hybrid mode).
        weight_sharing: let the graphs of one context share their weights. Defaults to `multiple_graphs`.
            The x86 emulator cannot load such a context: pass False for artifacts that run on x86.
        shared_buffer: graph IO lives in buffers the runner registers with the HTP (RPC memory on a phone);
            the x86 emulator does not support it.
        multiple_contexts: the methods are split into several QNN partitions (shards), each its own context; the
            runtime then reserves one spill-fill buffer for all of them.
        debug: verbose QNN logging during compilation.

    Returns:
        The compile specs (one `CompileSpec` holding the serialized QNN options).
    """
    ensure_qnn_sdk()
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    if weight_sharing is None:
        weight_sharing = multiple_graphs
    if weight_sharing and not multiple_graphs:
        raise ValueError("weight_sharing=True needs multiple_graphs=True: one graph has nobody to share with")
    chipset = QcomChipset.__members__.get(soc.name)
    if chipset is None:
        raise ValueError(f"SoC {soc.value} is unknown to this executorch; expected one of: {', '.join(QcomChipset.__members__)}")
    backend_options = generate_htp_compiler_spec(
        use_fp16=fp16, use_weight_sharing=weight_sharing, use_multi_contexts=multiple_contexts
    )
    return generate_qnn_executorch_compiler_spec(
        soc_model=chipset, backend_options=backend_options, shared_buffer=shared_buffer, debug=debug
    )


@dataclass
class LoweredProgram:
    """A serialized ExecuTorch program plus what lowering found out about it.

    Args:
        program: the .pte bytes, or the file they were written to (`lower_to_pte(..., path=...)`: a program of
            several GB is streamed to disk, never joined in memory).
        delegation: per method, what was delegated to QNN.
        weight_sharing: whether the methods' graphs share weights inside their context binaries.
        soc: the target SoC.
    """

    program: bytes | Path
    delegation: dict[str, MethodDelegation]
    weight_sharing: bool
    soc: Soc

    @property
    def shards(self) -> int:
        """QNN delegates per method."""
        return max((d.partitions for d in self.delegation.values()), default=1)

    @property
    def buffer(self) -> bytes:
        """The .pte bytes (read from the file when the program was written to one)."""
        return self.program if isinstance(self.program, bytes) else self.program.read_bytes()

    def write(self, path: str | Path) -> Path:
        """Write the program to `path`; a program already in a file is moved there (same file system) or copied."""
        path = Path(path)
        if isinstance(self.program, bytes):
            path.write_bytes(self.program)
        else:
            shutil.move(self.program, path)
            self.program = path
        return path


def lower_to_pte(
    programs: Mapping[str, MethodSource],
    soc: Soc,
    *,
    fp16: bool,
    constant_methods: Mapping[str, Any] | None = None,
    weight_sharing: bool | None = None,
    shared_buffer: bool = False,
    skip_ops: Collection[str] = (),
    int64_inputs: Collection[str] = (),
    shard_starts: Collection[int] | Mapping[str, Collection[int]] = (),
    quantized_io: Mapping[str, Collection[int]] | None = None,
    float_outputs: Mapping[str, Collection[int]] | None = None,
    workers: int | None = None,
    memory_budget_gb: float | None = None,
    path: str | Path | None = None,
) -> LoweredProgram:
    """Lower one or more methods to QNN for one SoC and serialize them into one .pte.

    The same as ``EdgeLowering(programs, ...).lower(soc, ..., keep=False)``; lowering the same graphs for several
    SoCs through one `EdgeLowering` does their SoC-independent part once.

    Args:
        programs: method name -> `ExportedProgram` or `(module, example_inputs)`; see `EdgeLowering`.
        soc: the target SoC.
        fp16, constant_methods, skip_ops, int64_inputs, shard_starts, quantized_io, float_outputs: see `EdgeLowering`.
        weight_sharing, shared_buffer, workers, memory_budget_gb, path: see `EdgeLowering.lower`.

    Returns:
        The `LoweredProgram` (bytes + delegation summary).
    """
    lowering = EdgeLowering(
        programs, fp16=fp16, constant_methods=constant_methods, skip_ops=skip_ops, int64_inputs=int64_inputs,
        shard_starts=shard_starts, quantized_io=quantized_io, float_outputs=float_outputs,
    )
    return lowering.lower(
        soc, weight_sharing=weight_sharing, shared_buffer=shared_buffer, workers=workers,
        memory_budget_gb=memory_budget_gb, path=path, keep=False,
    )


class EdgeLowering:
    """Graphs on their way to QNN: the SoC-independent part of a lowering done once, the rest per SoC.

    ExecuTorch's QNN lowering (`to_edge_transform_and_lower_to_qnn` in 1.5.1) re-exports each method, runs QNN's
    export passes, converts to the edge dialect (ExecuTorch's decompositions) and runs QNN's edge passes; only then
    do the partitioner and the QNN compiler see the SoC. None of the first steps reads it: QNN's pass list is the
    same for every HTP (its one pass that reads the compile specs serves the LPAI backend), and the partitioner's
    list of ops kept whole is a fixed table. So `prepare` does them once, and `lower` partitions, compiles and
    serializes a copy of the edge programs for each SoC, a copy that shares their weight tensors.

    `prepare` converts the methods side by side where fork exists (`parallel_edge`): the first in this process, each
    other one in a forked child (`edge.to_edge_in_parallel`). ExecuTorch's conversion is Python on one core and was
    the longest stage of a full-size export (481 of 1124 s for Gemma-4-E2B, SM8650 16a4w_block, profiled).

    Args:
        programs: method name -> `ExportedProgram` or `(module, example_inputs)`; a PT2E-quantized method is the
            `convert_pt2e` graph (as is, or re-exported). Each method is re-exported (non-strict) for this lowering,
            so the sources are left as they were. Several methods must split into the same number of QNN partitions
            (their i-th partitions share a context).
        fp16: floating-point graphs compiled at HTP fp16; False for quantized (PT2E) graphs.
        constant_methods: extra methods that take no input and return a constant, e.g. `{"get_max_seq_len": 1024}`
            (an int, float, bool or tensor).
        skip_ops: edge op names kept on the CPU even where QNN supports them, e.g. `{"aten.embedding.default"}`.
        int64_inputs: graph inputs that must stay int64 for the CPU ops they feed (e.g. `tokens` for the
            quantized embedding kernels, which take only Long indices). By default QNN's lowering casts every
            int64 input to int32 inside its delegate, and the CPU ops downstream would receive int32.
        shard_starts: decoder layers (index in `layers.N`) that begin a new shard. Each shard is compiled into its
            own context binary, so the compiler holds one shard's weights at a time; the shards hand their
            activations over through an identity op on the CPU (`llama::fallback`).
            A mapping gives each method its own (a method not in it is not split): with weight sharing, every
            method must split into as many partitions (a Gemma 4 drafter has fewer layers than its target).
        quantized_io: method name -> positions of the inputs that become integer graph IO (with the encoding the
            quantizer gave them); every output of those methods does too, but those of ``float_outputs``. See
            `optimum_qnn.quantization.io`.
        float_outputs: method name -> output positions that stay float32 with integer IO (an assistant's hidden
            states: docs/assistant.md).

    Raises:
        ValueError: no methods, a method name that clashes with a constant method, or a malformed op name.
    """

    # Convert the methods to the edge dialect side by side, one process each (`to_edge_in_parallel`), where fork exists;
    # OPTIMUM_QNN_EDGE_SIDE_BY_SIDE=off converts them one after the other (in the memory of one conversion). None:
    # the variable decides, read when `prepare` runs (`environment.env_switch`); a test may set True or False.
    parallel_edge: bool | None = None

    def __init__(
        self,
        programs: Mapping[str, MethodSource],
        *,
        fp16: bool,
        constant_methods: Mapping[str, Any] | None = None,
        skip_ops: Collection[str] = (),
        int64_inputs: Collection[str] = (),
        shard_starts: Collection[int] | Mapping[str, Collection[int]] = (),
        quantized_io: Mapping[str, Collection[int]] | None = None,
        float_outputs: Mapping[str, Collection[int]] | None = None,
    ):
        if not programs:
            raise ValueError("No methods to lower")
        clash = set(programs) & set(constant_methods or {})
        if clash:
            raise ValueError(f"Method names used both as graphs and as constant methods: {sorted(clash)}")
        # QnnPartitioner compares these with `node.target.__name__`: a name in another form silently matches nothing.
        malformed = sorted(op for op in skip_ops if not _OP_NAME_RE.fullmatch(op))
        if malformed:
            raise ValueError(f"Op names must look like 'aten.embedding.default' (namespace.op.overload); got {malformed}")
        self._programs: dict[str, MethodSource] | None = dict(programs)
        self.methods = tuple(programs)
        self.fp16 = fp16
        self.constant_methods = dict(constant_methods) if constant_methods else None
        if not isinstance(shard_starts, Mapping):
            shard_starts = dict.fromkeys(self.methods, shard_starts)
        self.shard_starts = {name: tuple(sorted(starts)) for name, starts in shard_starts.items() if starts}
        self.skip_ops = {*skip_ops, SHARD_OP} if self.shard_starts else set(skip_ops)
        self.int64_inputs = frozenset(int64_inputs)
        self.quantized_io = dict(quantized_io or {})
        self.float_outputs = {name: tuple(positions) for name, positions in (float_outputs or {}).items()}
        self._edge: EdgeProgramManager | None = None
        self._fresh = False  # the sources are exported programs made for this lowering (`from_portable`)

    def portable(self) -> dict[str, Any]:
        """What another process (a Ray task: `optimum_qnn.exporter.cluster`) needs to make this lowering again:
        each method exported and saved with `torch.export.save`, and this lowering's options.
        `EdgeLowering.from_portable` takes it. Releases this object's sources; must come before `prepare`.

        The edge programs themselves do not travel: their node metadata holds fake tensors and native objects that do
        not pickle (measured on executorch 1.5.1), so a lowering made from this prepares them again.
        (`optimum_qnn.exporter.program_transfer` hands them between a forked child and its parent, which share the
        weights; a Ray node shares nothing.)"""
        import io

        if self._programs is None:
            raise RuntimeError("portable() needs the sources: call it before prepare() or lower()")
        saved = {}
        for name, source in self._programs.items():
            program = export_method(name, source)
            buffer = io.BytesIO()
            torch.export.save(program, buffer)
            saved[name] = buffer.getvalue()
        self._programs = None
        return {
            "saved": saved, "fp16": self.fp16, "constant_methods": self.constant_methods, "skip_ops": self.skip_ops,
            "int64_inputs": self.int64_inputs, "shard_starts": self.shard_starts, "quantized_io": self.quantized_io,
            "float_outputs": self.float_outputs,
        }

    @classmethod
    def from_portable(cls, portable: Mapping[str, Any]) -> "EdgeLowering":
        """The lowering `portable()` described, in this process."""
        import io

        # The custom ops a quantized graph calls must be registered before it deserializes: the PT2E quantize and
        # dequantize ops, and ExecuTorch's quantized embedding lookups.
        import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401
        import torchao.quantization.pt2e  # noqa: F401

        options = dict(portable)
        programs = {name: torch.export.load(io.BytesIO(data)) for name, data in options.pop("saved").items()}
        lowering = cls(programs, **options)
        lowering._fresh = True  # exported for this lowering alone: `prepare` takes them as they are
        return lowering

    @property
    def prepared(self) -> bool:
        """The SoC-independent part is done (and the sources were let go)."""
        return self._edge is not None

    def prepare(self) -> None:
        """Re-export the methods, run QNN's export passes, convert to the edge dialect and run QNN's edge passes.

        Releases this object's references to the source graphs: every later `lower` starts from the edge programs.
        """
        if self._edge is not None:
            return
        if self._programs is None:
            raise RuntimeError("This lowering was consumed by lower(..., keep=False); create a new EdgeLowering")
        ensure_qnn_sdk()
        freed = return_free_heap()  # what calibration, the fold or the last lowering freed but the heap kept
        logger.debug("Returned %.2f GB of free heap to the system before lowering", freed)
        with quiet_native_output() as native_log:
            spec = _edge_spec(fp16=self.fp16, multiple=len(self._programs) > 1)
            options = dict(skip_ops=self.skip_ops, int64_inputs=self.int64_inputs, shard_starts=self.shard_starts,
                           quantized_io=self.quantized_io, float_outputs=self.float_outputs)
            parallel = self.parallel_edge if self.parallel_edge is not None else env_switch(EDGE_SIDE_BY_SIDE_VARIABLE, True)
            if len(self._programs) > 1 and parallel and fork_available():
                # One method per process (ExecuTorch converts them one after the other, on one core).
                sources = {name: functools.partial(self._export, name, source) for name, source in self._programs.items()}
                tensors = [t for source in self._programs.values() for t in SharedTensors.tensors_of(source)]
                self._programs = None
                self._edge = to_edge_in_parallel(
                    sources, tensors, spec, constant_methods=self.constant_methods, **options
                )
            else:
                report_step("re-exporting the graphs")
                exported = {name: self._export(name, source) for name, source in self._programs.items()}
                self._programs = None
                self._edge = to_edge(exported, spec, constant_methods=self.constant_methods, **options)
        release_example_inputs(self._edge, self.methods)
        logger.debug("Edge conversion output:\n%s", native_log.text)

    def _export(self, name: str, source: MethodSource) -> torch.export.ExportedProgram:
        if self._fresh:
            return source
        report_step(f"re-exporting {name}")
        return export_method(name, source)

    def lower(
        self,
        soc: Soc,
        *,
        weight_sharing: bool | None = None,
        shared_buffer: bool = False,
        workers: int | None = None,
        memory_budget_gb: float | None = None,
        path: str | Path | None = None,
        keep: bool = True,
    ) -> LoweredProgram:
        """Partition, compile and serialize the methods for `soc` (preparing them first if `prepare` was not called).

        Args:
            soc: the target SoC.
            weight_sharing: share weights between the methods' graphs. Defaults to True when there are several
                methods (what a phone wants); pass False for artifacts that run on the x86 emulator.
            shared_buffer: see `compile_specs`.
            workers: at most this many shards compile at once, each in a forked process, while the next shard is
                prepared (see `optimum_qnn.exporter.parallel_compile`). Defaults to the cores available to the
                process; 1 compiles in this process, one shard after the other. The programs compute the same either
                way (only QNN's internal tensor numbering inside the context binaries differs).
            memory_budget_gb: a second compile worker starts only while this process and its workers stay within it
                (the export's memory budget); None: only what the machine has available limits them.
            path: write the program to this file as it is serialized (ExecuTorch's `write_to_file`) instead of
                returning its bytes: Gemma-4-E2B's program is 3 GB, and joining it in memory costs that much again.
            keep: keep the edge programs for another `lower`: lowered in a forked child on Linux (`lower_forked`),
                elsewhere on a copy sharing their weights; False lowers them and lets them go (the last SoC).

        Returns:
            The `LoweredProgram` (bytes + delegation summary).

        Raises:
            ValueError: workers < 1.
            RuntimeError: a shard's compile failed (in a worker process: its error text, or the signal that killed
                it); the lowering was already consumed.
        """
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1 (1 compiles the shards one after the other); got {workers}")
        multiple = len(self.methods) > 1
        if weight_sharing is None:
            weight_sharing = multiple
        # The same spec for every method: QnnBackend.preprocess_multimethod compiles the i-th partition of all
        # methods into one context with the FIRST method's spec, so differing specs would be silently ignored.
        spec = compile_specs(
            soc, fp16=self.fp16, multiple_graphs=multiple, weight_sharing=weight_sharing, shared_buffer=shared_buffer,
            multiple_contexts=bool(self.shard_starts),
        )
        self.prepare()
        from executorch.backends.qualcomm._passes.build_quant_io import BuildQuantIo
        from executorch.exir import ExecutorchBackendConfig
        from executorch.exir.passes.memory_planning_pass import MemoryPlanningPass

        if keep and fork_available():
            # In a child that lowers its copy-on-write copy of the edge programs: this process's QNN counters stay
            # where they were, so this SoC's program is the one a single-SoC export makes (`optimum_qnn.exporter.forked`).
            return self.lower_forked(
                soc, weight_sharing=weight_sharing, shared_buffer=shared_buffer, workers=workers,
                memory_budget_gb=memory_budget_gb, path=path,
            ).result()
        logger.info("Lowering %s to QNN for %s (%s)", ", ".join(self.methods), soc.value, "fp16" if self.fp16 else "quantized")
        if keep:
            edge = copy_sharing_tensors(self._edge)
        else:
            edge, self._edge = self._edge, None
        freed = return_free_heap()  # what the last SoC's lowering freed but the heap kept
        logger.debug("Returned %.2f GB of free heap to the system before lowering", freed)
        with _compile_failures_explained(soc) as native_log:
            edge = lower_edge(
                edge, spec, skip_ops=self.skip_ops, workers=default_workers() if workers is None else workers,
                budget_gb=memory_budget_gb,
            )
            if self.shard_starts:
                from executorch.backends.qualcomm.utils.utils import update_spill_fill_size

                for method in self.methods:
                    update_spill_fill_size(edge.exported_program(method))
            delegation = delegation_summary(edge)
            config = ExecutorchBackendConfig(
                # Graph IO that was quantized in the graph (tagged by the quantization step) keeps its integer dtype.
                passes=[BuildQuantIo()],
                # Graph inputs and outputs are not memory-planned: ExecuTorch's C++ LLM runner (qnn_llama_runner) hands each
                # method its own IO buffers (`set_outputs`), which a planned output refuses ("Output 0 is memory planned,
                # or is a constant. Cannot override the existing data pointer."); the Python runtime allocates them.
                memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, alloc_graph_output=False),
            )
            report_step("serializing the program")
            executorch_program = edge.to_executorch(config)
            del edge
            if path is None:
                program: bytes | Path = bytes(executorch_program.buffer)
            else:
                program = Path(path)
                with program.open("wb") as f:
                    executorch_program.write_to_file(f)
            del executorch_program
        logger.debug("QNN compiler output:\n%s", native_log.text)
        return LoweredProgram(program=program, delegation=delegation, weight_sharing=weight_sharing, soc=soc)

    def lower_forked(self, soc: Soc, *, records: logging.Handler | None = None, **options: Any) -> Forked:
        """`lower(soc, keep=True, **options)` in a forked child (Linux) while this process goes on, e.g. several SoCs
        side by side; `result()` gives the `LoweredProgram`, ``records`` gets the child's progress records."""
        if not fork_available():
            raise RuntimeError("lower_forked needs os.fork (Linux); lower() one SoC after the other here")
        self.prepare()  # once, in this process: every child starts from the same edge programs
        return Forked(
            functools.partial(self.lower, soc, **options, keep=False),
            f"the lowering for {soc.value}", "export fewer SoCs at once, or use more shards", records=records,
        )


@contextlib.contextmanager
def _compile_failures_explained(soc: Soc) -> Iterator[Any]:
    """`quiet_native_output`, with QNN's refusal to compile a graph (ExecuTorch asserts on the empty context binary;
    a shard's worker exits with it) raised as a `QnnCompileError` that names what QNN said."""
    native_log = None
    try:
        with quiet_native_output() as native_log:
            yield native_log
    except (AssertionError, RuntimeError) as e:
        text = str(e)
        refused = ("Qnn context binary" in text or "empty context binary" in text
                   or ("QNN compile of shard" in text and "exit code" in text))
        if not refused:
            raise
        # A shard compiled in a worker process brings QNN's words in the error itself.
        raise QnnCompileError(qnn_refusal_message(soc, (native_log.text if native_log else "") + "\n" + text)) from e


def _edge_spec(*, fp16: bool, multiple: bool) -> list[CompileSpec]:
    """The compile specs the SoC-independent steps are built with. QNN's pass manager reads only the backend type
    from them (the HTP for every SoC of `Soc`), and its one edge pass that reads the specs serves the LPAI backend; a
    SoC is needed to make a spec at all, and the lowering itself is compiled with each SoC's own."""
    return compile_specs(Soc.SM8650, fp16=fp16, multiple_graphs=multiple, weight_sharing=False)

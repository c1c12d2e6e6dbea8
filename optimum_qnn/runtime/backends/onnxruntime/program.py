"""Run an exported `.pte` through onnxruntime-qnn, without torch or ExecuTorch.

The program is read from the `.pte` itself (`artifacts.inspection.pte_plan`): each method's instruction chain runs
here in order, its CPU kernels in numpy (`cpu_ops`), each QNN delegate as an onnxruntime session over the delegate's
own context binary (`onnx_model.ep_context_model`). A context that holds several graphs (prefill and decode of one
shard) is loaded once: its first graph's session carries the context (`main_context=1`), the others take their
graph from it (`main_context=0`, session option `ep.share_ep_contexts=1`).

Each context is written to a scratch folder of optimum-qnn's cache while its sessions load, and the models are loaded
from files there (`embed_mode=0`); the folder is deleted once they have loaded. Embedded in in-memory model bytes, the
context was held several times over (measured on one 0.64 GB context of Gemma-4-E2B: peak RSS 5.18 GB, 2.68 GB after
loading; from a file, with the mapped pages released after each context: 2.68 GB and 0.82 GB).

Delegate arguments map to graph tensors the way ExecuTorch's QNN backend maps them (executorch 1.5.1,
`QnnManager::AllocateTensor` and `QnnExecuTorchBackend::execute`): the graph's inputs sorted by the number after the
first `_` of their names (`input_3_caches_4@0` is input 3) take the first args in order; then every graph output
whose name starts with `output_`, in the context's order, takes the next arg.

Example:
    >>> from optimum_qnn.artifacts.manifest import read_manifest
    >>> program = OrtProgram(folder / "model.pte", read_manifest(folder))
    >>> logits, *caches = program.methods["kv_forward"](inputs)  # inputs in runner-contract order
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimum_qnn.artifacts.inspection.pte_plan import DelegateCall, ExecutionPlan, KernelCall, TensorValue, read_plans
from optimum_qnn.artifacts.inspection.qnn_system import GraphInfo, QnnInspectError, QnnSystem, TensorInfo
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.artifacts.inspection import graph_load_bytes
from optimum_qnn.program import EMULATOR_PD_BYTES, check_emulator_can_hold, check_pte_structure, host_can_run
from optimum_qnn.runtime.backends.onnxruntime.cpu_ops import KERNELS, missing_kernels, output_spec
from optimum_qnn.runtime.backends.onnxruntime.onnx_model import TensorType, ep_context_model
from optimum_qnn.sdk.loading import cache_home
from optimum_qnn.sdk.onnxruntime_ep import (
    OrtBackendError, check_single_htp_library, htp_backend_path, package_dir, protect_unwinder, qnn_ep_devices,
)

logger = logging.getLogger(__name__)

# QNN data types as the System library names them -> the numpy dtype of their bytes.
_QNN_NUMPY = {
    "float32": "float32", "float16": "float16", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool8": "bool",
    "ufixed8": "uint8", "ufixed16": "uint16", "ufixed32": "uint32", "sfixed8": "int8", "sfixed16": "int16",
    "sfixed32": "int32",
}
QNN_BACKEND_ID = "QnnBackend"
_CONTEXT_FILE = "context.bin"  # in each context's scratch folder, beside the models that name it


@dataclass(frozen=True)
class _GraphCall:
    """One delegate call bound to its onnxruntime session: which values feed which graph tensors."""

    session: Any
    input_names: tuple[str, ...]
    input_args: tuple[int, ...]
    output_names: tuple[str, ...]
    output_args: tuple[int, ...]


def _graph_input_number(tensor: TensorInfo) -> int:
    """ExecuTorch's `CompareExportedInput`: the integer after the first `_` of the name."""
    tail = tensor.name.split("_", 1)[1] if "_" in tensor.name else ""
    digits = tail.split("_", 1)[0]
    if not digits.isdigit():
        raise OrtBackendError(f"QNN graph input {tensor.name!r} does not carry ExecuTorch's input number")
    return int(digits)


def _tensor_type(t: TensorInfo) -> TensorType:
    if t.dtype not in _QNN_NUMPY:
        raise OrtBackendError(f"QNN graph tensor {t.name!r} has type {t.dtype}, which this backend cannot pass")
    return TensorType(t.name, _QNN_NUMPY[t.dtype], tuple(t.shape))


def _check_value(value: Any, tensor: TensorType, where: str) -> None:
    if not isinstance(value, TensorValue):
        raise OrtBackendError(f"{where}: the program passes a non-tensor to QNN graph tensor {tensor.name!r}")
    if value.dtype != tensor.dtype or tuple(value.sizes) != tensor.shape:
        raise OrtBackendError(
            f"{where}: the program's {value.dtype}{list(value.sizes)} does not match QNN graph tensor {tensor.name!r} "
            f"({tensor.dtype}{list(tensor.shape)}); the .pte and its context disagree, export it again"
        )


class _Method:
    """One method, callable with its inputs in runner-contract order; returns its outputs in that order."""

    def __init__(self, program: "OrtProgram", plan: ExecutionPlan, steps: list, specs: Sequence[Any]):
        self.program, self.plan, self.steps, self.specs = program, plan, steps, tuple(specs)
        self.values: list = [self._initial(v) for v in plan.values]
        self._slots = list(self.values)  # the constants and output specs, restored per call

    @staticmethod
    def _initial(value: Any) -> Any:
        if isinstance(value, TensorValue):
            if value.constant is not None:
                return np.frombuffer(value.constant, dtype=value.dtype).reshape(value.sizes)
            return output_spec(value)
        return value

    def __call__(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        plan = self.plan
        if len(inputs) != len(plan.inputs):
            raise OrtBackendError(f"{plan.name} takes {len(plan.inputs)} inputs, got {len(inputs)}")
        with self.program.lock:
            t0 = time.perf_counter()
            values = self._slots.copy()
            for index, spec, x in zip(plan.inputs, self.specs, inputs):
                x = np.asarray(x)
                if x.dtype != spec.dtype or x.shape != tuple(spec.shape):
                    raise OrtBackendError(
                        f"{plan.name} input {spec.name} must be {spec.dtype}{list(spec.shape)}, got {x.dtype}{list(x.shape)}"
                    )
                values[index] = np.ascontiguousarray(x)
            for step in self.steps:
                if isinstance(step, _GraphCall):
                    feed = {name: values[arg] for name, arg in zip(step.input_names, step.input_args)}
                    try:
                        results = step.session.run(step.output_names, feed)
                    except Exception as e:  # onnxruntime's own types (EPFail, Fail...)
                        raise OrtBackendError(f"{plan.name} of {self.program.path}: QNN failed to run it: {e}") from None
                    for arg, out in zip(step.output_args, results):
                        values[arg] = out
                else:
                    kernel, args = step
                    kernel(values, args)
            outputs = [values[i] for i in plan.outputs]
            self.program.exec_seconds += time.perf_counter() - t0
            self.program.calls += 1
        return outputs


class OrtProgram:
    """A variant's `.pte` loaded into onnxruntime-qnn, kept loaded between calls.

    Args:
        pte: the variant's `model.pte`.
        manifest: its `optimum_qnn.artifacts.manifest.Manifest` (the runner contract, the weight-sharing flag).
        methods: the methods to load (default: every method of the runner contract).

    Attributes:
        methods: name -> callable taking the method's inputs in runner-contract order (numpy arrays of the
            contract's dtypes and shapes) and returning its outputs in contract order.
        load_seconds: wall time of the load (reading the program, creating every session).
        exec_seconds, calls: time spent inside method calls and how many, for the caller's timing.

    Raises:
        OptimumQnnError: a weight-shared program on the x86 emulator (before anything loads), a corrupt file, a
            program whose CPU side holds an operator this backend has no kernel for (named), or a context that
            onnxruntime-qnn cannot load.
    """

    def __init__(self, pte: Path | str, manifest: Any, *, methods: Sequence[str] | None = None):
        t0 = time.perf_counter()
        self.path = Path(pte)
        protect_unwinder()  # before any QNN library, whatever loads next (torch, executorch) in this process
        if not host_can_run(manifest.contract.weight_sharing):
            # Measured: onnxruntime-qnn fails with QNN_COMMON_ERROR_NOT_SUPPORTED, and QNN's log says why.
            raise OrtBackendError(
                f"{self.path} shares weights between its prefill and decode graphs, which the x86 HTP emulator "
                "cannot load (QNN: \"Shared weights buffer isn't supported on this platform\"). Run it on a "
                "Snapdragon host, or re-export with --no-weight-sharing to run it on x86."
            )
        check_pte_structure(self.path)
        self.lock = threading.Lock()
        self.exec_seconds, self.calls = 0.0, 0
        # The manifest's own contract section, not `manifest.runner_contract()`: the same names, dtypes and shapes
        # in the same order, without importing the exporter's torch-based contract module.
        specs_by_method = {m.name: m.inputs for m in manifest.contract.methods}
        names = list(methods) if methods is not None else list(specs_by_method)
        with open(self.path, "rb") as f:
            # Mapped, not read: the constants (embedding tables) stay views into the file, paged in as used.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        plans = read_plans(self._map, str(self.path))
        for name in names:
            if name not in plans:
                raise OrtBackendError(f"{self.path} has no method {name!r}; it has: {', '.join(plans)}")
            problem = _plan_problem(plans[name], str(self.path))
            if problem is not None:
                raise OrtBackendError(problem)
        self._sessions: list[Any] = []
        graph_calls = self._load_graphs([plans[n] for n in names])
        self.methods: dict[str, Callable[[Sequence[np.ndarray]], list[np.ndarray]]] = {}
        for name in names:
            plan = plans[name]
            specs = specs_by_method[name]
            steps = [
                graph_calls[name, step.delegate] if isinstance(step, DelegateCall)
                else (KERNELS[plan.operators[step.op]], step.args)
                for step in plan.instructions
            ]
            self.methods[name] = _Method(self, plan, steps, specs)
        self.load_seconds = time.perf_counter() - t0
        logger.info("Loaded %s into onnxruntime-qnn in %.2f s (%d sessions)", self.path, self.load_seconds,
                    len(self._sessions))

    def _load_graphs(self, plans: list[ExecutionPlan]) -> dict[tuple[str, int], _GraphCall]:
        """One session per (method, QNN delegate); each context binary loaded once."""
        system = _qnn_system()
        by_context: dict[str, list[tuple[ExecutionPlan, int]]] = {}
        for plan in plans:
            for index in sorted(plan.qnn):
                by_context.setdefault(plan.qnn[index].key, []).append((plan, index))
        infos = {}
        for key, users in by_context.items():
            try:
                infos[key] = system.binary_info(users[0][0].qnn[users[0][1]].binary)
            except QnnInspectError as e:
                raise OrtBackendError(f"{self.path}: QNN context {key} cannot be read ({e}); export it again") from None
        # QNN reserves room for every graph of a context it loads, used by the loaded methods or not
        check_emulator_can_hold(sum(graph_load_bytes(g.blob) for info in infos.values() for g in info.graphs),
                                str(self.path))
        calls: dict[tuple[str, int], _GraphCall] = {}
        for key, users in by_context.items():
            binary = users[0][0].qnn[users[0][1]].binary
            graphs = {g.name: g for g in infos[key].graphs}
            share = len(users) > 1
            scratch_root = scratch_folder()
            with tempfile.TemporaryDirectory(prefix="context-", dir=scratch_root, ignore_cleanup_errors=True) as tmp:
                scratch = Path(tmp)
                with open(scratch / _CONTEXT_FILE, "wb") as f:
                    f.write(binary)
                for position, (plan, index) in enumerate(users):
                    graph = graphs.get(plan.name) or (next(iter(graphs.values())) if len(graphs) == 1 else None)
                    if graph is None:
                        raise OrtBackendError(
                            f"{self.path}: method {plan.name}'s QNN context {key} has no graph of that name "
                            f"(it has {', '.join(graphs)})"
                        )
                    session = self._session(graph, scratch, main=position == 0, share=share)
                    calls[plan.name, index] = self._bind(plan, plan.instructions, index, graph, session)
            self._release_pages()
        return calls

    def _release_pages(self) -> None:
        """Drop the mapped `.pte` pages this process touched (reading and writing out a context) from its RSS.

        They are clean file pages: the kernel refaults any that are read again (the constants), from the page cache
        or the file, so nothing changes but the RSS (measured on Gemma-4-E2B's 4 contexts: file-backed RSS after
        load 2.45 GB without this). No-op where `mmap` has no `madvise` (Windows).
        """
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _session(self, graph: GraphInfo, scratch: Path, *, main: bool, share: bool) -> Any:
        """A session over ``graph``; the main one loads the context from ``scratch``, the others share it."""
        import onnxruntime

        model = ep_context_model(
            graph.name, [_tensor_type(t) for t in graph.inputs], [_tensor_type(t) for t in graph.outputs],
            _CONTEXT_FILE if main else None, main_context=main,
        )
        model_path = scratch / f"{graph.name}.onnx"
        model_path.write_bytes(model)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # the QNN EP logs every graph it loads at warning level
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        # The whole graph is one QNN node: onnxruntime's own CPU thread pool has nothing to do, and its threads
        # spinning after each run would take cores from the HTP emulator's threads (2-core hosts).
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if share:
            options.add_session_config_entry("ep.share_ep_contexts", "1")
        backend = htp_backend_path()
        check_single_htp_library(backend, "onnxruntime-qnn", OrtBackendError)  # a second copy aborts the process
        options.add_provider_for_devices(qnn_ep_devices(), {"backend_path": str(backend)})
        try:
            session = onnxruntime.InferenceSession(str(model_path), sess_options=options)
        except Exception as e:  # onnxruntime raises its own exception types (Fail, RuntimeException...)
            full = ("; the HTP memory is full: on the x86 emulator every loaded context shares one protection domain "
                    f"of about {EMULATOR_PD_BYTES / 1e9:.1f} GB, so free other models first"
                    if "MEM_ALLOC" in str(e) else "")
            raise OrtBackendError(
                f"onnxruntime-qnn cannot load QNN graph {graph.name!r} of {self.path}: {e}{full}"
            ) from None
        # onnxruntime's Python session retries a failed run on the CPU provider alone by building the session again
        # from its model file: that graph is one QNN node, which the CPU cannot run, and the file is gone by then,
        # so the retry's error would hide the QNN error the caller must see.
        session.disable_fallback()
        self._sessions.append(session)
        return session

    def _bind(self, plan: ExecutionPlan, instructions, index: int, graph: GraphInfo, session: Any) -> _GraphCall:
        call = next(i for i in instructions if isinstance(i, DelegateCall) and i.delegate == index)
        inputs = sorted(graph.inputs, key=_graph_input_number)
        outputs = [t for t in graph.outputs if t.name.startswith("output_")]
        where = f"{self.path} method {plan.name} delegate {index}"
        if len(call.args) != len(inputs) + len(outputs):
            raise OrtBackendError(
                f"{where}: the call passes {len(call.args)} values, the QNN graph {graph.name!r} has "
                f"{len(inputs)} inputs and {len(outputs)} outputs"
            )
        in_args, out_args = call.args[:len(inputs)], call.args[len(inputs):]
        for arg, tensor in zip(call.args, [*inputs, *outputs]):
            _check_value(plan.values[arg], _tensor_type(tensor), where)
        return _GraphCall(session, tuple(t.name for t in inputs), tuple(in_args), tuple(t.name for t in outputs),
                          tuple(out_args))

    def close(self) -> None:
        """Free the sessions (and with them the QNN contexts) and unmap the file."""
        self.methods.clear()
        self._sessions.clear()


SCRATCH_MAX_AGE_S = 24 * 3600  # a load takes minutes: an older scratch folder is one a crashed load left behind


def scratch_folder() -> Path:
    """Where contexts are written while they load (created); a scratch folder older than `SCRATCH_MAX_AGE_S` (a load
    that crashed, or a file the platform kept open: deletion is best-effort) is removed first, so they cannot pile up."""
    root = cache_home() / "ort-contexts"
    root.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in root.glob("context-*"):
        try:
            if now - old.stat().st_mtime > SCRATCH_MAX_AGE_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # another process removed it first
            pass
    return root


def _qnn_system() -> QnnSystem:
    """onnxruntime-qnn's QNN System library (reads each context's graph names and tensors), loaded without torch:
    `protect_unwinder` has run, which makes loading a QNN library before torch safe."""
    protect_unwinder()
    return QnnSystem(package_dir() / ("QnnSystem.dll" if os.name == "nt" else "libQnnSystem.so"), import_torch=False)


def check_program_file(pte: Path) -> None:
    """Check that the onnxruntime backend can run the `.pte` at ``pte``, reading the file only: nothing is loaded
    into QNN or onnxruntime (`doctor`'s question, answered before anyone pays for a load).

    Every method's plan is read (`pte_plan.read_plans`) and checked as `OrtProgram` checks it when it loads: each
    instruction is a CPU kernel or a delegate call, every delegate is QNN's, and every CPU operator has a numpy
    kernel here (`cpu_ops.KERNELS`).

    Args:
        pte: the program file of a variant (``<variant>/model.pte``).

    Raises:
        OrtBackendError: the program holds what this backend cannot run; the message names the method and the
            instruction, delegate or operator.
        OptimumQnnError: the file is not an ExecuTorch program, or is damaged (`pte_plan.read_plans`' error).
        OSError: the file cannot be read.
    """
    where = str(pte)
    # The plans hold views of the mapping, and so does a raised error's traceback: the map closes only once both are
    # gone (else "BufferError: cannot close exported pointers exist" replaces the message), so the error is raised
    # after it closes.
    with open(pte, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        error: type[OptimumQnnError] = OrtBackendError
        try:
            plans = read_plans(data, where)
            problems = [p for p in (_plan_problem(plan, where) for plan in plans.values()) if p is not None]
            del plans
        except OptimumQnnError as e:  # a file that is no program: its own error and message
            problems, error = [str(e)], type(e)
    if problems:
        raise error(problems[0])


def _plan_problem(plan: ExecutionPlan, where: str) -> str | None:
    """What of ``plan`` this backend cannot run, named (None: it runs all of it)."""
    for step in plan.instructions:
        if not isinstance(step, (KernelCall, DelegateCall)):
            return (f"{where} method {plan.name} holds a {step.kind}, which the onnxruntime backend does not run; run "
                    "it with the ExecuTorch backend (device='host')")
    for step in plan.instructions:
        if isinstance(step, DelegateCall) and plan.delegates[step.delegate] != QNN_BACKEND_ID:
            return (f"{where} method {plan.name} delegates to {plan.delegates[step.delegate]}, which the onnxruntime "
                    "backend cannot run (it runs QnnBackend delegates only); run it with the ExecuTorch backend")
    used = [s.op for s in plan.instructions if isinstance(s, KernelCall)]
    missing = missing_kernels(plan.operators, used)
    if missing:
        return (f"{where} method {plan.name} runs {', '.join(missing)} on the CPU, which the onnxruntime backend has "
                f"no kernel for (it has: {', '.join(sorted(KERNELS))}). Run this variant with the ExecuTorch "
                "backend (device='host'), or re-export it so that op is delegated to QNN.")
    return None

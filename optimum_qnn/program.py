"""One exported .pte in ExecuTorch's Python runtime (the QNN delegate on a Snapdragon host, or the x86 HTP emulator).

Core: the runtime's host backend generates through it, and the exporter's `--evaluate` scores a staged variant
through it, so neither needs the other.
"""

from __future__ import annotations

import platform
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.native_output import quiet_runtime

# Hosts whose HTP is the x86 emulator inside onnxruntime-qnn's libQnnHtp.so (`platform.machine()` spells it both ways).
EMULATOR_MACHINES = frozenset({"x86_64", "amd64"})


@dataclass(frozen=True)
class ProgramFacts:
    """What loading a .pte needs to know from its manifest."""

    sha256: str
    method_names: tuple[str, ...]
    weight_sharing: bool
    shards: int
    qairt_build_id: str
    htp_arch: int = 0  # the arch its context binaries were compiled for (0: unknown)

    @classmethod
    def of(cls, manifest) -> "ProgramFacts":
        """From an `artifacts.manifest.Manifest` (read duck-typed: the core does not import the artifacts wing)."""
        return cls(
            sha256=manifest.program.sha256,
            method_names=tuple(m.name for m in manifest.runner_contract().methods),
            weight_sharing=manifest.contract.weight_sharing,
            shards=manifest.contract.shards,
            qairt_build_id=manifest.versions.qairt_build_id,
            htp_arch=manifest.target.htp_arch,
        )


class LoadedProgram:
    """One loaded .pte and its methods, shared by every `QNNModelForCausalLM` of the same file content.

    ExecuTorch's QNN backend caches the delegate handle of each context binary by the signature stamped into it at
    compile time (`QnnExecuTorchBackend::init`, "Use cached delegate handle for current method"): a second load of
    the same .pte gets the first load's handle, and destroying either program destroys the QNN context both use
    (the next call fails with "DelegateHandle has been deleted" and the process crashes). So a .pte is loaded once per
    process and its program lives as long as any model uses it: models hold it strongly, the table below weakly,
    and Python's reference counting frees it with its last model. Copies of one file (same sha256) carry the same
    signatures and share an entry too. Methods run under a lock: the QNN graphs' IO tensors are per context.
    """

    _live: "weakref.WeakValueDictionary[str, LoadedProgram]" = weakref.WeakValueDictionary()
    _live_lock = threading.Lock()

    def __init__(self, program: Any, method_names: Sequence[str], htp_arch: int = 0):
        self.htp_arch = htp_arch
        self.methods = {name: program.load_method(name) for name in method_names}
        self._held = [program]  # the methods reference their program's memory: keep it alive with them
        self.lock = threading.Lock()
        # Freed with the last model that uses it (or at exit), the methods first, with what the QNN runtime prints
        # as it destroys its contexts held back. Only the finalizer may hold the program besides `_held`.
        weakref.finalize(self, _release, self.methods, self._held)

    @property
    def program(self) -> Any:
        return self._held[0]

    @classmethod
    def get(cls, path: Path, facts: "ProgramFacts", load_bytes: Callable[[], int] | None = None) -> "LoadedProgram":
        """The live program of ``path``'s content (``facts.sha256``), or a fresh load of it; ``load_bytes`` gives the
        HTP memory its contexts need (`inspection.program_load_bytes`): when a load fails on the emulator, it says
        whether that is why. (Read only then: the QNN System library keeps a copy of every context it reads, 3 MB a
        load of the demo's program, which twenty loads and drops would leave in the process.)"""
        check_host_can_run(facts.weight_sharing, str(path))  # before the cache: a live copy does not make it loadable
        with cls._live_lock:
            loaded = cls._live.get(facts.sha256)
            if loaded is None:
                check_emulator_can_add(facts.htp_arch, [live.htp_arch for live in cls._live.values()], str(path))
                try:
                    with quiet_runtime():  # the QNN backend prints a dozen INFO lines as it opens the contexts
                        loaded = cls(load_program(path, facts), facts.method_names, facts.htp_arch)
                except RuntimeError:  # ExecuTorch's bare "Failed to load method ..., error: 0x:1"
                    if load_bytes is not None and is_emulator_host():
                        check_emulator_can_hold(load_bytes(), str(path))
                    raise
                cls._live[facts.sha256] = loaded
            return loaded

    @classmethod
    def live_count(cls) -> int:
        """Programs loaded in this process and still used by a model."""
        return len(cls._live)


def _release(methods: dict[str, Any], held: list[Any]) -> None:
    with quiet_runtime():
        methods.clear()
        held.clear()


class ExecClock:
    """Seconds spent inside method calls, owned by one model (not by the shared program)."""

    total: float = 0.0


class TimedMethod:
    """Calls one method of a shared program, timing it on a model's clock.

    It refers to the program and the clock, never to the model, so a model is freed as soon as its last reference
    goes (no reference cycle left for the garbage collector).
    """

    def __init__(self, loaded: LoadedProgram, name: str, clock: ExecClock):
        # The method is looked up per call, never held here: the program's finalizer must be able to free it.
        self.loaded, self.name, self.clock = loaded, name, clock

    def __call__(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Runs the method on the session's numpy inputs: tensors that share their memory in, numpy views of the
        runtime's outputs back."""
        import torch

        # The runtime needs contiguous inputs; only the prefill method's K-cache views are not.
        args = [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]
        with self.loaded.lock:
            t0 = time.perf_counter()
            out = self.loaded.methods[self.name].execute(args)
            self.clock.total += time.perf_counter() - t0
        return [t.numpy() for t in out]


def is_emulator_host(machine: str | None = None) -> bool:
    """x86_64 hosts run QNN through the HTP emulator inside libQnnHtp.so, which cannot load weight-shared contexts."""
    return (machine or platform.machine()).lower() in EMULATOR_MACHINES


def host_can_run(weight_sharing: bool, machine: str | None = None) -> bool:
    """Whether this host can load a .pte: the x86 HTP emulator cannot load graphs that share weights."""
    return not (weight_sharing and is_emulator_host(machine))


def check_host_can_run(weight_sharing: bool, what: str) -> None:
    """Refuse, before anything is loaded, a weight-shared program on the x86 HTP emulator (``what`` names it)."""
    if not host_can_run(weight_sharing):
        raise OptimumQnnError(
            f"{what} shares weights between its prefill and decode graphs, which the x86 HTP emulator cannot load. "
            "Run it on a Snapdragon device, or re-export with --no-weight-sharing to run it on x86."
        )


# The emulator in onnxruntime-qnn 2.5.0's libQnnHtp.so (QAIRT 2.49.40) cannot create a v81 context while a context of
# an older arch is live in the process: QNN fails it with "Can't run HMX in background due to lack of HMX thread(s)"
# (error 5005) and ExecuTorch's load_method raises a bare "Failed to load method ... 0x1". Measured on tiny fp16
# exports: SM8550 (v73), SM8650 (v75), SM8750 (v79) then SM8850 (v81) fails on the fourth, and SM8550 or SM8750 then
# SM8850 fails on the second; SM8850 first and the older three after it all run, and so does SM8850 once the older
# programs are freed. The number of contexts is not the limit (six loads one after the other, four live at once, run),
# and onnxruntime-qnn runs the four in the failing order in one process.
EMULATOR_HMX_ARCH = 81


def check_emulator_can_add(htp_arch: int, live_archs: Sequence[int], what: str,
                           machine: str | None = None) -> None:
    """Refuse, before loading it, a v81+ program on the x86 HTP emulator while an older arch's program is live."""
    older = sorted({a for a in live_archs if 0 < a < EMULATOR_HMX_ARCH})
    if htp_arch >= EMULATOR_HMX_ARCH and older and is_emulator_host(machine):
        raise OptimumQnnError(
            f"{what} is compiled for HTP v{htp_arch}, which the x86 HTP emulator cannot load while a program for "
            f"{', '.join(f'v{a}' for a in older)} is loaded in this process (QNN: lack of HMX threads). Load the "
            f"v{htp_arch} variant first, free the older models before loading it, use device=\"host:onnxruntime\", "
            "or run one process per SoC."
        )


# The x86 emulator places every context in one protection domain ("Router.X86 does not support multi-PD; using single
# PD"), and refuses a context that does not fit what is left ("Failed to find available PD for contextId 3 ... with
# context size estimate 1289034496", QNN error 1002; onnxruntime-qnn reports QNN_COMMON_ERROR_MEM_ALLOC). Measured
# with full-size Gemma-4-E2B at 32768 tokens, --no-weight-sharing: two contexts of ~3.12 GB placed, "available space
# 493532057" left, so the domain holds ~3.6 GB. On a Snapdragon, QNN spreads contexts over several domains.
EMULATOR_PD_GB = 3.6
EMULATOR_PD_BYTES = int(EMULATOR_PD_GB * 1e9)


def check_emulator_can_hold(load_bytes: int, what: str, machine: str | None = None) -> None:
    """Refuse, before loading, a program whose contexts need more HTP memory (``load_bytes``: the graphs' constants,
    IO, spill-fill and op data, `inspection.graph_load_bytes`) than the x86 emulator's one protection domain holds."""
    if load_bytes > EMULATOR_PD_BYTES and is_emulator_host(machine):
        raise OptimumQnnError(
            f"{what} needs about {load_bytes / 1e9:.1f} GB of HTP memory (its graphs' constants, IO and spill-fill), "
            f"more than the x86 HTP emulator holds (one protection domain of about {EMULATOR_PD_BYTES / 1e9:.1f} GB; "
            "QNN would fail it with a memory allocation error). For the emulator, export it with --mode kv (one "
            "graph per context: about half) or a smaller --max-seq-len; on a Snapdragon device QNN spreads the "
            "contexts over several protection domains."
        )


def load_program(path: Path, facts: "ProgramFacts"):
    """Load the .pte with the QNN backend and the CPU kernels its embedding lookups need."""
    from optimum_qnn.sdk import check_runtime_can_load, ensure_qnn_sdk

    check_host_can_run(facts.weight_sharing, str(path))
    check_pte_structure(path)
    sdk = ensure_qnn_sdk()
    check_runtime_can_load(facts.qairt_build_id, sdk.build_id, runtime_source=sdk.source)
    import executorch.kernels.quantized  # noqa: F401  (registers quantized_decomposed::embedding_* kernels)

    if facts.shards > 1:
        # The CPU kernel of `llama::fallback`, the identity op between the shards' QNN delegates.
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.runtime import Runtime

    from optimum_qnn.sdk.backend import check_qnn_backend

    check_qnn_backend()  # an ExecuTorch without QNN would fail in load_method with a bare backend error
    try:
        return Runtime.get().load_program(path)
    except (RuntimeError, ValueError) as e:
        raise OptimumQnnError(f"Cannot load {path} ({e}); the file is corrupt or not an ExecuTorch program") from None


def check_pte_structure(path: Path) -> None:
    """Refuse a file that is not a whole ExecuTorch program before the runtime parses it.

    ExecuTorch's loader trusts the sizes in the file and crashes the process on a truncated one, so the header
    (file identifier ``ET..``, extended header ``eh00`` with the program and segment sizes) is checked here.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(40)
    bad = OptimumQnnError(f"{path} is corrupt or not an ExecuTorch program (bad or truncated header); export it again")
    if len(head) < 40 or head[4:6] != b"ET" or head[8:12] != b"eh00":
        raise bad
    program_size = int.from_bytes(head[16:24], "little")
    segment_base = int.from_bytes(head[24:32], "little")
    segment_size = int.from_bytes(head[32:40], "little")
    if program_size > size or (segment_size and segment_base + segment_size > size):
        raise bad

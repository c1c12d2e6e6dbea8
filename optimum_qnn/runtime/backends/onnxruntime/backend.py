"""`OnnxRuntimeBackend`: a variant generated through onnxruntime-qnn in this process, with the same host-side logic as
ExecuTorch's backend (`backends.host.InProcessBackend`: caches, masks, positions, prefix reuse, stops, sampling).

It is the in-process runtime of every host whose ExecuTorch has no QNN backend or has no ExecuTorch at all: Windows
on Snapdragon, Snapdragon Linux boards, and the runtime install anywhere (on x86_64, the HTP emulator inside
onnxruntime-qnn's libQnnHtp). Needs neither torch nor ExecuTorch.
"""

from __future__ import annotations

import functools
from pathlib import Path

from optimum_qnn.artifacts.manifest import Manifest, resolve_inside
from optimum_qnn.native_output import quiet_runtime
from optimum_qnn.runtime.backends.host import InProcessBackend
from optimum_qnn.runtime.backends.onnxruntime.program import OrtProgram


class _ProgramClock:
    """The seconds the program's methods spent in onnxruntime (`OrtProgram.exec_seconds`), as the generation loop
    reads and resets its clock."""

    def __init__(self, program: OrtProgram):
        self.program = program

    @property
    def total(self) -> float:
        return self.program.exec_seconds

    @total.setter
    def total(self, value: float) -> None:
        self.program.exec_seconds = value


class OnnxRuntimeBackend(InProcessBackend):
    """The variant's QNN contexts in onnxruntime-qnn sessions, loaded once and kept (``program``)."""

    runtime = "onnxruntime"

    def __init__(self, variant: Path, manifest: Manifest, *, allowed_root: Path | None = None):
        from optimum_qnn.sdk import check_runtime_can_load

        pte = resolve_inside(variant, manifest.program.path, allowed_root=allowed_root)
        build_id, source = runtime_build_id()
        check_runtime_can_load(manifest.versions.qairt_build_id, build_id, runtime_source=source)
        with quiet_runtime():  # onnxruntime-qnn and QNN print their set-up lines as the contexts load
            self.program = OrtProgram(pte, manifest)
        super().__init__(manifest, self.program.methods, _ProgramClock(self.program))


@functools.lru_cache(maxsize=1)
def runtime_build_id() -> tuple[str, str]:
    """The QAIRT build id of onnxruntime-qnn's HTP library (read from its bytes, as for a phone's libraries) and the
    package it comes from: a context binary needs QNN libraries at least as new as the QAIRT that compiled it."""
    from importlib.metadata import version

    import onnxruntime_qnn

    from optimum_qnn.runtime.backends.bundle import library_build_id

    return library_build_id(Path(onnxruntime_qnn.get_qnn_htp_path())), f"onnxruntime-qnn=={version('onnxruntime-qnn')}"

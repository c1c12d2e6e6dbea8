"""The local transport of the runner backend: ExecuTorch's ``qnn_llama_runner`` as a subprocess of this machine.

For a Snapdragon Linux board (aarch64) or a Windows-on-Snapdragon laptop, where no ExecuTorch Python wheel has the
QNN backend, this runs an artifact without building ExecuTorch's Python bindings; on x86 the runner drives the HTP
emulator inside onnxruntime-qnn's ``libQnnHtp.so``. The QNN libraries are this machine's, found as the host backend
finds them (`sdk.ensure_qnn_sdk`: ``$QNN_SDK_ROOT`` or the registry package). The workspace is a folder of links to
the runner, its backend library, the .pte and the tokenizer (nothing is copied), under the user cache.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

from optimum_qnn.program import check_host_can_run, is_emulator_host
from optimum_qnn.runtime.backends.device import DeviceError
from optimum_qnn.sdk.loading import cache_home

WORKSPACE_ENV = "OPTIMUM_QNN_RUNNER_WORKSPACE"


class LocalTransport:
    """Runs the runner here, in ``workspace`` (default ``$OPTIMUM_QNN_RUNNER_WORKSPACE`` or
    ``<cache>/runner-workspace/<key of this environment>``)."""

    name = "runner"
    weight_sharing_hint = "weights not shared for the x86 emulator" if is_emulator_host() else "weights shared"

    def __init__(self, *, qnn_sdk_root=None, workspace: str | Path | None = None):
        if platform.system() == "Windows":
            raise DeviceError(
                "device='runner' drives the runner through POSIX paths and libraries; on Windows on Snapdragon it is "
                "not supported yet: run generate with device='host' (an ExecuTorch built with its QNN backend)"
            )
        self.qnn_sdk_root = Path(qnn_sdk_root).expanduser() if qnn_sdk_root else None
        self.shared_buffer_default = not is_emulator_host()
        env = os.environ.get(WORKSPACE_ENV)
        key = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:8]
        self.workspace = Path(workspace or env or cache_home() / "runner-workspace" / key)
        self.lib_dirs: list[Path] = []
        self.skel_dirs: list[Path] = []

    def qairt_libraries(self, htp_arch: int):
        """No files to place: the runner loads this machine's QNN libraries through LD_LIBRARY_PATH."""
        from optimum_qnn.sdk import ensure_qnn_sdk

        if self.qnn_sdk_root is not None:
            from optimum_qnn.runtime.backends.bundle import library_build_id
            from optimum_qnn.sdk.finding import find_host_lib_dir

            lib_dir = find_host_lib_dir(self.qnn_sdk_root, platform.machine(), platform.system())
            htp = lib_dir / "libQnnHtp.so"
            if not htp.is_file():
                raise DeviceError(f"{htp} is missing; point qnn_sdk_root at a QAIRT SDK")
            self.lib_dirs = [lib_dir]
            return [], library_build_id(htp), str(htp)
        sdk = ensure_qnn_sdk()
        lib_dir = sdk.lib_dir.resolve()
        # onnxruntime-qnn's libraries load their private libc++ from the wheel's `.libs` folder beside them.
        self.lib_dirs = [lib_dir] + [d for d in (lib_dir.parent / f"{lib_dir.name}.libs",) if d.is_dir()]
        self.skel_dirs = [d.resolve() for d in sdk.skel_dirs.values()]
        return [], sdk.build_id, sdk.source

    def connect(self) -> None:
        try:
            self.workspace.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DeviceError(f"Cannot create the runner workspace {self.workspace}: {e.strerror or e}; set "
                              f"{WORKSPACE_ENV} to a writable folder") from None

    def check_target(self, manifest) -> None:
        """An x86 host runs any SoC's variant on the emulator, if its weights are not shared; elsewhere the SoC is read
        where Linux tells it."""
        if is_emulator_host():
            check_host_can_run(manifest.contract.weight_sharing, f"The {manifest.target.soc} variant's model.pte")
            return
        from optimum_qnn.runtime.backends.soc import host_soc

        got = host_soc()
        want = manifest.target.soc
        if got is not None and got != want:
            raise DeviceError(
                f"This machine has a {got}, but the variant was compiled for {want} (HTP v{manifest.target.htp_arch}): "
                f"load the {got} variant (soc='{got}') or export one with --soc {got}"
            )

    def install(self, files, variant_dir: str) -> list[str]:
        """Link every file into the workspace (re-pointing links that point elsewhere); returns those linked anew."""
        (self.workspace / variant_dir / "outputs").mkdir(parents=True, exist_ok=True)
        linked = []
        for f in files:
            dst = self.workspace / f.remote
            dst.parent.mkdir(parents=True, exist_ok=True)
            target = Path(f.local).resolve()
            if dst.is_symlink() and Path(os.readlink(dst)) == target:
                continue
            tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}")
            tmp.symlink_to(target)
            os.replace(tmp, dst)
            linked.append(f.remote)
        return linked

    def put(self, local: Path, rel: str) -> None:
        shutil.copyfile(local, self.workspace / rel)

    def get(self, rel: str, local: Path) -> None:
        src = self.workspace / rel
        if not src.is_file():
            raise DeviceError(f"The runner wrote no {src}")
        shutil.copyfile(src, local)

    def remove(self, rels: Sequence[str]) -> None:
        for rel in rels:
            (self.workspace / rel).unlink(missing_ok=True)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        libs = [str(self.workspace), *map(str, self.lib_dirs)]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
        if self.skel_dirs:  # aarch64 Linux: where FastRPC finds the DSP-side skel libraries
            env["ADSP_LIBRARY_PATH"] = ";".join(map(str, self.skel_dirs))
        return env

    def start(self, args: Sequence[str]) -> tuple[subprocess.Popen, str]:
        import shlex

        proc = subprocess.Popen(list(args), cwd=self.workspace, env=self.environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        return proc, f"cd {shlex.quote(str(self.workspace))} && {shlex.join(args)}"

    def log_tail(self) -> str:
        return ""

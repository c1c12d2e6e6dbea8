"""`PhoneModelForCausalLM`: generate with an exported variant on an Android phone's NPU, from the machine it is
plugged into.

The phone runs ExecuTorch's own Qualcomm LLM runner (``qnn_llama_runner``, from ExecuTorch's
``examples/qualcomm/oss_scripts/llama``), driven over adb the way ExecuTorch's host script drives it: the runner,
its backend library, QAIRT's Android libraries, the .pte and the tokenizer go to a workspace under
``/data/local/tmp/optimum_qnn`` once (files already there with the same sha256 are not pushed again), then each
`generate` pushes the prompt as raw token ids (``--tokenized_prompt``: uint64 little-endian, no BOS added), runs the
runner and pulls its ``outputs.txt`` and ``inference_speed.txt``.

What the runner gives back, read from its sources (``qnn_llama_runner.cpp``, ``runner/runner.cpp``,
``runner/token_generator.cpp``): ``outputs.txt`` holds the ``--tokenized_prompt`` argument (its echo of the prompt)
then each generated token's text, written only when the runner exits; stdout holds a ``PyTorchObserver {json}``
line with token counts and millisecond timestamps. It prints no token ids, so the ids are the generated text
encoded again with the artifact's tokenizer, checked against the runner's token count (equal to the ids
`QNNModelForCausalLM` generates from the same .pte on the emulator, fp16 and 16a8w, hybrid and kv). It stops at its own end
tokens: the tokenizer's EOS and ``encode("<turn|>")[0]`` (``runner.cpp``, Gemma4), see `runner_stop_ids`.

Runtime code: imports neither the exporter, the quantizer nor torch.export, and does not load ExecuTorch.
"""

from __future__ import annotations

import json
import logging
import shlex
import struct
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from optimum_qnn.config import Soc
from optimum_qnn.contract import PREFILL_METHOD
from optimum_qnn.device.adb import Adb, DeviceError, DeviceSpec
from optimum_qnn.device.bundle import (
    BACKEND_LIBRARY,
    RUNNER_NAME,
    BundleFile,
    android_libraries,
    find_backend_library,
    find_runner,
    library_build_id,
    sdk_root,
)
from optimum_qnn.errors import ContextOverflowError, InvalidInputError
from optimum_qnn.manifest import Manifest, resolve_inside, sha256_file
from optimum_qnn.modeling import GenerationStats, QNNModelForCausalLM
from optimum_qnn.runtime_args import check_generate_args, eos_ids, prompt_ids
from optimum_qnn.sdk import check_runtime_can_load

logger = logging.getLogger(__name__)

WORKSPACE = "/data/local/tmp/optimum_qnn"
FREE_SPACE_MARGIN = 64 << 20  # outputs, the prompt file, and some room for the phone itself
_OBSERVER = "PyTorchObserver "
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # the runner reads EOS/BOS from the config
_STDERR_TAIL = 40


@dataclass(frozen=True)
class RunnerReport:
    """What the runner said about the last generation: its ``PyTorchObserver`` stats, ``inference_speed.txt``
    (generated tokens per second of the whole call), the command, and the last lines of its stderr."""

    command: str
    observer: dict[str, Any]
    inference_speed: float | None
    stderr_tail: str = ""
    text: str = ""

    @property
    def model_load_s(self) -> float:
        return (self.observer.get("model_load_end_ms", 0) - self.observer.get("model_load_start_ms", 0)) / 1000


@dataclass
class _Streams:
    stdout: list[str] = field(default_factory=list)
    stderr: deque = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL))


class PhoneModelForCausalLM:
    """An exported variant run on a phone by ExecuTorch's ``qnn_llama_runner`` over adb.

    Same `generate` / `text_generation` API and `GenerationStats` as `QNNModelForCausalLM`; build it through
    ``QNNModelForCausalLM.from_pretrained(..., device="adb")`` (or ``"adb:SERIAL"``).

    Args:
        root: the artifact folder (its ``tokenizer.json`` goes to the phone).
        variant: the variant folder (``model.pte`` + ``manifest.json``), already verified against its manifest.
        manifest: the variant's manifest.
        device: ``"adb"`` or ``"adb:SERIAL"``.
        runner: ExecuTorch's ``qnn_llama_runner`` built for the phone; default ``$QNN_LLAMA_RUNNER``.
        qnn_sdk_root: the QAIRT SDK holding the Android libraries; default ``$QNN_SDK_ROOT``.
        shared_buffer: pass ``--shared_buffer`` (zero-copy RPC memory, what a phone wants); off only to run an
            x86 build of the runner on the HTP emulator.
        allowed_root: see `resolve_inside` (a Hub cache snapshot's blobs folder).

    Example:

    ```python
    >>> model = QNNModelForCausalLM.from_pretrained("out/", soc="SM8650", quant="16a8w", device="adb")
    >>> model.generate(input_ids, max_new_tokens=32)
    ```
    """

    def __init__(
        self,
        root: Path,
        variant: Path,
        manifest: Manifest,
        *,
        device: str = "adb",
        runner: str | Path | None = None,
        qnn_sdk_root: str | Path | None = None,
        shared_buffer: bool = True,
        allowed_root: Path | None = None,
    ):
        spec = DeviceSpec.parse(device)
        if spec.kind != "adb":
            raise InvalidInputError(
                f"PhoneModelForCausalLM runs on device 'adb' or 'adb:SERIAL', not {device!r}; for this machine use "
                "QNNModelForCausalLM.from_pretrained(..., device='host')"
            )
        self.root, self.variant, self.manifest = Path(root), Path(variant), manifest
        self.contract = manifest.runner_contract()
        self.stats = GenerationStats()
        self.report: RunnerReport | None = None
        self.shared_buffer = shared_buffer
        self.hybrid = any(m.name == PREFILL_METHOD for m in self.contract.methods)
        self.remote_dir = f"{WORKSPACE}/{self.variant.relative_to(self.root).as_posix().replace('/', '_')}"
        files = self._bundle(runner, qnn_sdk_root, allowed_root)
        self._tokenizer = _load_tokenizer(self.root)
        self.runner_stop_ids = frozenset(_runner_stop_ids(self._tokenizer, self.root, manifest))
        self.adb = Adb(spec.serial)
        self.device = f"adb:{self.adb.serial}"
        self._check_soc()
        self._push(files)

    # -- set-up ------------------------------------------------------------------------------------------------

    def _bundle(self, runner, qnn_sdk_root, allowed_root) -> list[BundleFile]:
        """Everything the phone needs, checked on this machine (runner, libraries, QAIRT version, tokenizer)."""
        runner_path = find_runner(runner)
        backend = find_backend_library(runner_path)
        root = sdk_root(qnn_sdk_root)
        libs = android_libraries(root, self.manifest.target.htp_arch)
        lib_build = library_build_id(libs[0])
        check_runtime_can_load(self.manifest.versions.qairt_build_id, lib_build, runtime_source=f"{libs[0]}")
        program = self.manifest.program
        variant_dir = self.remote_dir.removeprefix(WORKSPACE + "/")
        files = [
            BundleFile(runner_path, RUNNER_NAME, executable=True),
            BundleFile(backend, BACKEND_LIBRARY),
            *(BundleFile(lib, lib.name) for lib in libs),
            BundleFile(resolve_inside(self.variant, program.path, allowed_root=allowed_root), f"{variant_dir}/model.pte",
                       sha256=program.sha256),
        ]
        for name in _TOKENIZER_FILES:
            path = self.root / name
            if path.is_file():
                files.append(BundleFile(path, f"{variant_dir}/tokenizer/{name}"))
            elif name == "tokenizer.json":
                raise DeviceError(f"{self.root} has no tokenizer.json, which the phone's runner needs; export again")
        return files

    def _check_soc(self) -> None:
        want = self.manifest.target.soc
        got = self.adb.getprop("ro.soc.model").upper()
        if not got:
            raise DeviceError(
                f"Phone {self.adb.serial} does not report its SoC (getprop ro.soc.model is empty; Android 12+ sets it), "
                f"so it cannot be checked against this variant's {want}"
            )
        if got != want:
            known = [s.value for s in Soc]
            fix = (f"load the {got} variant (soc='{got}') or export one with --soc {got}" if got in known
                   else f"this tool targets {', '.join(known)}")
            raise DeviceError(
                f"Phone {self.adb.serial} has a {got}, but this variant was compiled for {want} "
                f"(HTP v{self.manifest.target.htp_arch}): {fix}"
            )

    def _push(self, files: list[BundleFile]) -> None:
        """Push the files that are missing or differ (by sha256), after checking the phone has room for them."""
        self.adb.shell(f"mkdir -p {shlex.quote(self.remote_dir)}/tokenizer {shlex.quote(self.remote_dir)}/outputs")
        remote = {f"{WORKSPACE}/{f.remote}": f for f in files}
        on_phone = self.adb.sha256(list(remote))
        todo = [(path, f) for path, f in remote.items() if on_phone.get(path) != (f.sha256 or sha256_file(f.local))]
        need = sum(f.local.stat().st_size for _, f in todo)
        if todo:
            free = self.adb.free_bytes("/data/local/tmp")
            if free < need + FREE_SPACE_MARGIN:
                raise DeviceError(
                    f"Phone {self.adb.serial} has {free / 2**20:.0f} MiB free under /data/local/tmp but needs "
                    f"{(need + FREE_SPACE_MARGIN) / 2**20:.0f} MiB for {len(todo)} files: free some space "
                    f"(e.g. `adb shell rm -r {WORKSPACE}` removes earlier pushes), then retry"
                )
        logger.info("Pushing %d of %d files (%.1f MiB) to %s", len(todo), len(files), need / 2**20, self.device)
        for path, f in todo:
            self.adb.push(f.local, path)
        executables = [shlex.quote(path) for path, f in remote.items() if f.executable]
        self.adb.shell(f"chmod 755 {' '.join(executables)}")
        self.pushed = [f.remote for _, f in todo]

    # -- generation --------------------------------------------------------------------------------------------

    # The host model's own code, which reads only `manifest` and `generate`.
    eos_token_ids = QNNModelForCausalLM.eos_token_ids
    text_generation = QNNModelForCausalLM.text_generation

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: Any = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Generate up to ``max_new_tokens`` after ``input_ids`` on the phone; returns ``[1, prompt + new]`` ids.

        The runner also stops at its own end tokens (`runner_stop_ids`); ``eos_token_id`` can only stop earlier.
        Sampling takes ``temperature`` only (the runner's sampler has fixed top-p and seeds itself from the clock).
        The runner writes its text when it exits, so ``streamer`` receives the tokens when the call ends.
        """
        prompt = prompt_ids(input_ids).tolist()
        check_generate_args(max_new_tokens, do_sample, temperature, top_k, top_p, streamer, generator)
        self._check_request(prompt, do_sample, top_k, top_p, generator)
        stops = self.runner_stop_ids | eos_ids(eos_token_id, default=())  # the runner's own stop ids always apply
        stats = GenerationStats(prompt_tokens=len(prompt), stopped_by="max_new_tokens")
        new: list[int] = []
        if max_new_tokens > 0:
            seq_len = min(len(prompt) + max_new_tokens, self.contract.context_len)
            new = self._run(prompt, seq_len, temperature if do_sample else 0.0, stats)
            if len(prompt) + max_new_tokens > seq_len and len(new) == seq_len - len(prompt):
                stats.stopped_by = "context_full"
        cut = next((i + 1 for i, t in enumerate(new) if t in stops), None)
        if cut is not None:
            new, stats.stopped_by = new[:cut], "eos"
        stats.new_tokens = len(new)
        if streamer is not None:
            for token in new:
                streamer.put(torch.tensor([token]))
            streamer.end()
        self.stats = stats
        return torch.tensor(prompt + new, dtype=torch.long).unsqueeze(0)

    def _check_request(self, prompt, do_sample, top_k, top_p, generator) -> None:
        """What only the phone's runner refuses (the common checks are `check_generate_args`)."""
        vocab = self.contract.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidInputError(f"Token ids must lie in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        # The runner's prompt processor needs the whole prompt in the cache slots of its method.
        limit = self.contract.context_len - (self.contract.method(PREFILL_METHOD).ar_len if self.hybrid else 1)
        if len(prompt) > limit:
            raise ContextOverflowError(
                f"The prompt has {len(prompt)} tokens but the phone's runner takes at most {limit} with this export "
                f"(context {self.contract.context_len}); shorten it or export with a larger --max-seq-len"
            )
        if do_sample and (top_k is not None or top_p is not None or generator is not None):
            raise InvalidInputError(
                "The phone's runner samples with a temperature only (its top-p is fixed and it seeds itself): "
                "drop top_k, top_p and generator, or generate on the host"
            )

    def command(self, seq_len: int, temperature: float) -> str:
        """The shell command that runs the runner on the phone for one generation."""
        ws = shlex.quote(WORKSPACE)
        v = self.remote_dir.removeprefix(WORKSPACE + "/")
        args = [
            f"./{RUNNER_NAME}",
            "--decoder_model_version", "gemma4",
            "--model_path", f"{v}/model.pte",
            "--tokenizer_path", f"{v}/tokenizer",
            "--tokenized_prompt", f"{v}/prompt.raw",
            "--eval_mode", "1" if self.hybrid else "0",
            "--seq_len", str(seq_len),
            "--temperature", repr(float(temperature)),
            "--output_path", f"{v}/outputs/outputs.txt",
            "--performance_output_path", f"{v}/outputs/inference_speed.txt",
        ]
        if self.shared_buffer:
            args.append("--shared_buffer")
        # LD_LIBRARY_PATH: the runner's backend library and QAIRT's; ADSP_LIBRARY_PATH: where the DSP finds the skel.
        return (
            f"cd {ws} && export LD_LIBRARY_PATH={ws}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}} && "
            f"export ADSP_LIBRARY_PATH={ws} && {shlex.join(args)}"
        )

    def _run(self, prompt: list[int], seq_len: int, temperature: float, stats: GenerationStats) -> list[int]:
        """Run the runner once; returns the generated ids and fills ``stats`` from the runner's own figures."""
        outputs = f"{self.remote_dir}/outputs"
        with tempfile.TemporaryDirectory(prefix="optimum-qnn-phone-") as tmp:
            local = Path(tmp)
            (local / "prompt.raw").write_bytes(struct.pack(f"<{len(prompt)}Q", *prompt))
            self.adb.push(local / "prompt.raw", f"{self.remote_dir}/prompt.raw")
            self.adb.shell(f"rm -f {shlex.quote(outputs)}/outputs.txt {shlex.quote(outputs)}/inference_speed.txt")
            command = self.command(seq_len, temperature)
            returncode, streams = self._stream(command)
            observer = _observer(streams.stdout)
            tail = "".join(streams.stderr).strip()
            if returncode != 0 or observer is None:
                if not tail:  # a runner built with ExecuTorch's android PAL logs to logcat, not stderr
                    tail = self.adb.shell("logcat -d -t 40 -s ExecuTorch", timeout=60, check=False).stdout.strip()
                why = f"exited with status {returncode}" if returncode != 0 else "printed no PyTorchObserver stats"
                raise DeviceError(
                    f"{RUNNER_NAME} on {self.device} {why}. Its last output:\n{tail or '(none)'}\n"
                    "Check that the runner, its backend library and QAIRT's libraries come from matching builds, and "
                    "that the .pte was exported by this optimum-qnn (weights shared for a phone)"
                )
            self.adb.pull(f"{outputs}/outputs.txt", local / "outputs.txt")
            self.adb.pull(f"{outputs}/inference_speed.txt", local / "inference_speed.txt")
            raw = (local / "outputs.txt").read_bytes()
            speed = _float_or_none((local / "inference_speed.txt").read_text().strip())
        echo = f"{self.remote_dir.removeprefix(WORKSPACE + '/')}/prompt.raw".encode()
        text = (raw[len(echo):] if raw.startswith(echo) else raw).decode("utf-8", errors="replace")
        expected = int(observer.get("generated_tokens", 0)) + 1  # the runner does not count the prefill's token
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != expected:
            logger.warning(
                "The runner generated %d tokens but its text encodes to %d; the returned ids are the text's own "
                "tokenization", expected, len(ids),
            )
        self.report = RunnerReport(command, observer, speed, tail, text)
        _fill_stats(stats, observer)
        return ids

    def _stream(self, command: str) -> tuple[int, _Streams]:
        """Run ``command`` on the phone, reading its stdout line by line as it comes and its stderr beside it."""
        proc = self.adb.shell_process(command)
        streams = _Streams()

        def drain_stderr():
            for line in proc.stderr:
                streams.stderr.append(line.decode("utf-8", errors="replace"))

        reader = threading.Thread(target=drain_stderr, daemon=True)
        reader.start()
        try:
            for line in proc.stdout:
                text = line.decode("utf-8", errors="replace")
                streams.stdout.append(text)
                logger.debug("runner: %s", text.rstrip())
            returncode = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: closing adb's end of the shell ends the runner too
                proc.kill()
                proc.wait()
        reader.join()
        return returncode, streams


def _load_tokenizer(root: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(root / "tokenizer.json"))


def _runner_stop_ids(tokenizer, root: Path, manifest: Manifest) -> set[int]:
    """The ids ExecuTorch's runner stops at for Gemma4 (``runner.cpp``): the tokenizer's EOS (named by
    tokenizer_config.json, which is pushed beside tokenizer.json) and the first id of ``encode("<turn|>")``."""
    stops = set()
    config = root / "tokenizer_config.json"
    eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
    eos_id = tokenizer.token_to_id(eos if isinstance(eos, str) else (eos or {}).get("content", "")) if eos else None
    stops |= {eos_id} if eos_id is not None else set(manifest.tokenizer.eos_ids)
    turn = tokenizer.encode("<turn|>", add_special_tokens=False).ids
    if turn:
        stops.add(turn[0])
    return stops


def _observer(lines: list[str]) -> dict[str, Any] | None:
    for line in reversed(lines):
        if line.startswith(_OBSERVER):
            try:
                return json.loads(line[len(_OBSERVER):])
            except json.JSONDecodeError:
                return None
    return None


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _fill_stats(stats: GenerationStats, observer: dict[str, Any]) -> None:
    """``GenerationStats`` from the runner's ``PyTorchObserver`` figures (milliseconds, tokens per second).

    The QNN runner times no model execution apart from the rest, so ``host_overhead_share`` stays 0 and there are
    no per-step times.
    """
    stats.prompt_tokens = int(observer.get("prompt_tokens", stats.prompt_tokens))
    stats.time_to_first_token_s = (observer.get("first_token_ms", 0) - observer.get("inference_start_ms", 0)) / 1000
    stats.prefill_tokens_per_s = float(observer.get("prefill_token_per_sec", 0.0))
    stats.decode_tokens_per_s = float(observer.get("decode_token_per_sec", 0.0))

"""The runner backend: ExecuTorch's own C++ Qualcomm LLM runner (``qnn_llama_runner``, from ExecuTorch's
``examples/qualcomm/oss_scripts/llama``), driven as ExecuTorch's host script drives it, through a transport:
`adb.AdbTransport` (a phone plugged into this machine) or `local.LocalTransport` (this machine: an aarch64 Linux
board, a Windows-on-Snapdragon laptop, or x86 with the HTP emulator).

The runner, its backend library, the QAIRT libraries the transport needs, the .pte and the tokenizer go to the
transport's workspace once; each `generate` writes the prompt as raw token ids (``--tokenized_prompt``: uint64
little-endian, no BOS added), runs the runner and reads its ``outputs.txt`` and ``inference_speed.txt``.

What the runner gives back, read from its sources (``qnn_llama_runner.cpp``, ``runner/runner.cpp``,
``runner/token_generator.cpp``): ``outputs.txt`` holds the ``--tokenized_prompt`` argument (its echo of the prompt)
then each generated token's text, written only when the runner exits; stdout holds a ``PyTorchObserver {json}``
line with token counts and millisecond timestamps. It prints no token ids, so the ids are the generated text
encoded again with the artifact's tokenizer, checked against the runner's token count. It stops at its own end
tokens: the tokenizer's EOS and ``encode("<turn|>")[0]`` (``runner.cpp``, Gemma4), see `stops.runner_stop_ids`.

It samples with its own flags only: greedy (``--temperature 0``) or a temperature; its top-p is fixed and it seeds
itself from the clock, so `check_sampling` refuses a top_p or top_k other than the neutral value and a generator
(a seed), naming the parameter. Its prompt limit is `limits.Limits`' (C - AR of the method that prefills).

Runtime code: imports neither the exporter, the quantizer nor torch.export, and does not load ExecuTorch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimum_qnn.artifacts.manifest import Manifest, resolve_inside
from optimum_qnn.contract import DECODE_METHOD, DRAFT_METHOD, PREFILL_METHOD
from optimum_qnn.errors import InvalidInputError, UnsupportedParameterError
from optimum_qnn.lookahead import lookahead_of
from optimum_qnn.runtime.backends.bundle import (
    BACKEND_LIBRARY, RUNNER_NAME, BundleFile, find_backend_library, find_runner,
)
from optimum_qnn.runtime.backends.device import DeviceError, DeviceSpec
from optimum_qnn.runtime.generation import GenerationStats, Sampling, eos_ids
from optimum_qnn.runtime.limits import Limits
from optimum_qnn.runtime.stops import runner_stop_ids
from optimum_qnn.sdk import check_runtime_can_load

logger = logging.getLogger(__name__)

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


def make_transport(device: DeviceSpec, qnn_sdk_root=None):
    """The transport of a ``runner`` or ``adb[:SERIAL]`` device."""
    if device.kind == "adb":
        from optimum_qnn.runtime.backends.adb import AdbTransport

        return AdbTransport(device.serial, qnn_sdk_root=qnn_sdk_root)
    if device.kind == "runner":
        from optimum_qnn.runtime.backends.local import LocalTransport

        return LocalTransport(qnn_sdk_root=qnn_sdk_root)
    raise DeviceError(f"The runner backend runs on device 'runner', 'adb' or 'adb:SERIAL', not {device}")


class RunnerBackend:
    """An exported variant run by ExecuTorch's ``qnn_llama_runner`` through a transport.

    Args:
        root: the artifact folder (its tokenizer goes beside the .pte).
        variant: the variant folder (``model.pte`` + ``manifest.json``), already verified against its manifest.
        manifest: the variant's manifest.
        device: ``runner``, ``adb`` or ``adb:SERIAL`` (a `DeviceSpec` or its text).
        runner: ExecuTorch's ``qnn_llama_runner`` built for the device; default ``$QNN_LLAMA_RUNNER``.
        qnn_sdk_root: the QAIRT SDK holding the device's libraries; default ``$QNN_SDK_ROOT`` (for ``runner``: this
            machine's QNN libraries, as the host backend finds them).
        shared_buffer: pass ``--shared_buffer`` (zero-copy RPC memory, what a Snapdragon device wants); default on
            for ``adb``, off for ``runner`` on an x86 host (the HTP emulator has no RPC memory).
        transport: a transport object instead of ``device`` (tests).
        allowed_root: see `resolve_inside` (a Hub cache snapshot's blobs folder).
    """

    streams = False  # the runner writes its text when it exits

    def __init__(self, root: Path, variant: Path, manifest: Manifest, *, device: Any = "adb", runner=None,
                 qnn_sdk_root=None, shared_buffer: bool | None = None, transport: Any = None,
                 allowed_root: Path | None = None):
        self.root, self.variant, self.manifest = Path(root), Path(variant), manifest
        self.contract = manifest.runner_contract()
        check_runner_layout(self.variant, self.contract)
        self.stats = GenerationStats()
        self.report: RunnerReport | None = None
        self._encoding = None  # the tokenizer's encoding of the runner's last text (ids and character offsets)
        self.hybrid = any(m.name == PREFILL_METHOD for m in self.contract.methods)
        # A lookahead export runs as ExecuTorch runs it: --eval_mode 2 with the N, W, G its manifest records.
        self.lookahead = manifest.contract.lookahead
        shape = lookahead_of(manifest)
        refusal = shape.runner_refusal() if shape is not None else None
        if refusal:
            raise InvalidInputError(f"Variant {self.variant.name}: {refusal}")
        spec = DeviceSpec.parse(device)
        if spec.kind == "host":
            raise InvalidInputError(
                "RunnerBackend runs on device 'runner', 'adb' or 'adb:SERIAL', not 'host'; for ExecuTorch's Python "
                "runtime use QNNModelForCausalLM.from_pretrained(..., device='host')"
            )
        self.transport = transport or make_transport(spec, qnn_sdk_root)
        self.shared_buffer = self.transport.shared_buffer_default if shared_buffer is None else shared_buffer
        self.variant_dir = self.variant.relative_to(self.root).as_posix().replace("/", "_")
        files = self._bundle(runner, allowed_root)
        self._tokenizer = _load_tokenizer(self.root)
        config = self.root / "tokenizer_config.json"
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
        self.runner_stop_ids = frozenset(runner_stop_ids(eos, self._tokenizer, manifest.tokenizer.eos_ids))
        self.transport.connect()
        self.name = self.transport.name
        self.limits = Limits.of(self.contract, spec.kind)
        self.transport.check_target(manifest)
        self.pushed = self.transport.install(files, self.variant_dir)

    def _bundle(self, runner, allowed_root) -> list[BundleFile]:
        """Everything the device needs, checked on this machine (runner, libraries, QAIRT version, tokenizer)."""
        runner_path = find_runner(runner)
        backend = find_backend_library(runner_path)
        libs, build_id, source = self.transport.qairt_libraries(self.manifest.target.htp_arch)
        check_runtime_can_load(self.manifest.versions.qairt_build_id, build_id, runtime_source=source)
        program = self.manifest.program
        files = [
            BundleFile(runner_path, RUNNER_NAME, executable=True),
            BundleFile(backend, BACKEND_LIBRARY),
            *(BundleFile(lib, lib.name) for lib in libs),
            BundleFile(resolve_inside(self.variant, program.path, allowed_root=allowed_root),
                       f"{self.variant_dir}/model.pte", sha256=program.sha256),
        ]
        for name in _TOKENIZER_FILES:
            path = self.root / name
            if path.is_file():
                files.append(BundleFile(path, f"{self.variant_dir}/tokenizer/{name}"))
            elif name == "tokenizer.json":
                raise DeviceError(f"{self.root} has no tokenizer.json, which the runner needs; export again")
        return files

    # -- generation --------------------------------------------------------------------------------------------

    def generate(self, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling, eos_token_id: Any,
                 streamer: Any, *, reuse_cache: bool = False, cancel: Any = None,
                 speculative: str | None = None) -> list[int]:
        """The new tokens after ``prompt``; fills ``self.stats`` from the runner's own figures.

        A lookahead variant always decodes with lookahead decoding here (the runner's ``--eval_mode 2``), so
        ``speculative`` changes nothing.

        The runner also stops at its own end tokens (`runner_stop_ids`); ``eos_token_id`` can only stop earlier.
        Sampling takes ``temperature`` only (the runner's sampler has fixed top-p and seeds itself from the clock).
        A runner process keeps no cache between calls: ``reuse_cache`` changes nothing (the whole prompt is
        prefilled, ``stats.reused_tokens`` stays 0), and ``cancel`` is asked once, before the process starts.
        """
        ids = prompt.tolist()
        self._check_request(ids, sampling)
        self._encoding = None
        stops = self.runner_stop_ids | eos_ids(eos_token_id, default=())  # the runner's own stop ids always apply
        stats = GenerationStats(prompt_tokens=len(ids), prefilled_tokens=len(ids), stopped_by="max_new_tokens")
        new: list[int] = []
        if cancel is not None and cancel():
            stats.stopped_by = "cancelled"
        elif max_new_tokens > 0:
            seq_len = min(len(ids) + max_new_tokens, self.contract.context_len)
            new = self._run(ids, seq_len, sampling.temperature if sampling.do_sample else 0.0, stats)
            # With --eval_mode 2 the runner accepts all of a step's verified tokens and only then checks --seq_len,
            # so it can overshoot the budget (measured: 27 new ids for 24 asked); keep what was asked, as the host.
            new = new[:seq_len - len(ids)]
            if len(ids) + max_new_tokens > seq_len and len(new) == seq_len - len(ids):
                stats.stopped_by = "context_full"
        cut = next((i + 1 for i, t in enumerate(new) if t in stops), None)
        if cut is not None:
            new, stats.stopped_by = new[:cut], "eos"
        self._keep_text(len(new))
        stats.new_tokens = len(new)
        self.stats = stats
        return new

    def _keep_text(self, kept: int) -> None:
        """Cut the report's text to its first ``kept`` tokens (the ids `generate` returns), at the character where
        the tokenizer's offsets put that token's end: the text and the ids then say the same thing."""
        if self.report is None or self._encoding is None or kept >= len(self._encoding.ids):
            return
        end = self._encoding.offsets[kept - 1][1] if kept else 0
        self.report = dataclasses.replace(self.report, text=self.report.text[:end])

    def _check_request(self, prompt: list[int], sampling: Sampling) -> None:
        """What only the runner refuses (the common checks are `generation.check_generate_args`)."""
        vocab = self.contract.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidInputError(f"Token ids must lie in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        self.limits.check_prompt(len(prompt))  # its prompt processor needs the prompt in its method's cache slots
        self.check_sampling(sampling)

    def check_sampling(self, sampling: Sampling) -> None:
        """Refuse what ExecuTorch's runner cannot do (`UnsupportedParameterError` naming the parameter): it samples
        with a temperature only, its top-p is fixed and it seeds itself from the clock. The neutral values (top_p 1
        or None, top_k 0 or None) and greedy decoding (where a generator changes nothing) pass."""
        if not sampling.do_sample:
            return
        given = [f"{name}={value!r}" for name, value, neutral in (("top_p", sampling.top_p, (None, 1, 1.0)),
                                                                  ("top_k", sampling.top_k, (None, 0)))
                 if value not in neutral]
        if sampling.generator is not None:
            given.append("generator=(a seeded generator)")
        if given:
            name = given[0].split("=")[0]
            raise UnsupportedParameterError(
                f"ExecuTorch's runner (device {self.name!r}) samples with a temperature only: its top-p is fixed and it "
                f"seeds itself, so {given[0]} cannot be honoured; drop {name}, or generate with device='host'",
                param=name, backend=f"runner ({self.name})",
            )

    def runner_args(self, seq_len: int, temperature: float) -> list[str]:
        """The runner's argv for one generation, paths relative to the transport's workspace."""
        v = self.variant_dir
        args = [
            f"./{RUNNER_NAME}",
            "--decoder_model_version", "gemma4",
            "--model_path", f"{v}/model.pte",
            "--tokenizer_path", f"{v}/tokenizer",
            "--tokenized_prompt", f"{v}/prompt.raw",
            *(self.lookahead.runner_args if self.lookahead else ["--eval_mode", "1" if self.hybrid else "0"]),
            "--seq_len", str(seq_len),
            "--temperature", repr(float(temperature)),
            "--output_path", f"{v}/outputs/outputs.txt",
            "--performance_output_path", f"{v}/outputs/inference_speed.txt",
        ]
        if self.shared_buffer:
            args.append("--shared_buffer")
        return args

    def _run(self, prompt: list[int], seq_len: int, temperature: float, stats: GenerationStats) -> list[int]:
        """Run the runner once; returns the generated ids and fills ``stats`` from the runner's own figures."""
        t = self.transport
        outputs = f"{self.variant_dir}/outputs"
        with tempfile.TemporaryDirectory(prefix="optimum-qnn-runner-") as tmp:
            local = Path(tmp)
            (local / "prompt.raw").write_bytes(struct.pack(f"<{len(prompt)}Q", *prompt))
            t.put(local / "prompt.raw", f"{self.variant_dir}/prompt.raw")
            t.remove([f"{outputs}/outputs.txt", f"{outputs}/inference_speed.txt"])
            args = self.runner_args(seq_len, temperature)
            returncode, streams, command = self._stream(args)
            observer = _observer(streams.stdout)
            tail = "".join(streams.stderr).strip()
            if returncode != 0 or observer is None:
                tail = tail or t.log_tail()  # a runner built with ExecuTorch's android PAL logs to logcat
                why = f"exited with status {returncode}" if returncode != 0 else "printed no PyTorchObserver stats"
                raise DeviceError(
                    f"{RUNNER_NAME} on {t.name} {why}. Its last output:\n{tail or '(none)'}\n"
                    "Check that the runner, its backend library and QAIRT's libraries come from matching builds, and "
                    f"that the .pte was exported by this optimum-qnn ({t.weight_sharing_hint})"
                )
            t.get(f"{outputs}/outputs.txt", local / "outputs.txt")
            t.get(f"{outputs}/inference_speed.txt", local / "inference_speed.txt")
            raw = (local / "outputs.txt").read_bytes()
            speed = _float_or_none((local / "inference_speed.txt").read_text().strip())
        echo = f"{self.variant_dir}/prompt.raw".encode()
        text = (raw[len(echo):] if raw.startswith(echo) else raw).decode("utf-8", errors="replace")
        expected = int(observer.get("generated_tokens", 0)) + 1  # the runner does not count the prefill's token
        self._encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids = self._encoding.ids
        if len(ids) != expected:
            logger.warning(
                "The runner generated %d tokens but its text encodes to %d; the returned ids are the text's own "
                "tokenization", expected, len(ids),
            )
        self.report = RunnerReport(command, observer, speed, tail, text)
        _fill_stats(stats, observer)
        return ids

    def _stream(self, args: list[str]) -> tuple[int, _Streams, str]:
        """Run the runner, reading its stdout line by line as it comes and its stderr beside it."""
        proc, command = self.transport.start(args)
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
            if proc.poll() is None:  # interrupted: closing our end ends the runner too
                proc.kill()
                proc.wait()
            reader.join()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        return returncode, streams, command


def check_runner_layout(variant: Path, contract) -> None:
    """Refuse, before anything is pushed or started, a variant whose caches ExecuTorch's C++ runner would misread:
    the runner keeps every cache at ``C - ar`` slots and writes K/V at ``n_past`` (its `KVManager`), so a ring layout
    (sliding caches of ``sliding_window`` slots) would get wrong shapes or wrong columns, and a blocks layout (caches
    cut into several inputs each) a different number of inputs; nor can it run an assistant's drafter, or feed the
    verify call of its kv_forward."""
    layout = contract.cache_layout.value
    if layout != "full":
        what = {"ring": f"sliding layers keep a ring of {contract.ring_len} slots",
                "blocks": f"each long cache is cut into inputs of {contract.block_len} slots"}[layout]
        raise InvalidInputError(
            f"Variant {variant.name} has the {layout!r} cache layout ({what}), which ExecuTorch's qnn_llama_runner "
            "cannot drive: it keeps every cache as one tensor of C - ar slots. Run it with device='host' (or the "
            "onnxruntime backend), or export with --cache-layout full for the runner"
        )
    if any(m.takes_images for m in contract.methods):
        raise InvalidInputError(
            f"Variant {variant.name} takes images (its prefill method has the soft-token inputs image_embeds and "
            "image_mask): ExecuTorch's qnn_llama_runner feeds token ids only. Run it with device='host' (or the "
            "onnxruntime backend), or use the text variant (export without --task image-text-to-text) for the runner"
        )
    if any(m.name == DRAFT_METHOD for m in contract.methods):
        raise InvalidInputError(
            f"Variant {variant.name} was exported with Gemma 4's assistant (method {DRAFT_METHOD}, a kv_forward that "
            f"verifies {contract.method(DECODE_METHOD).ar_len} tokens a call): ExecuTorch's qnn_llama_runner has no "
            "drafter and decodes one token a kv_forward call. Run it with device='host' (or the onnxruntime "
            "backend), or export without --assistant for the runner"
        )


def _load_tokenizer(root: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(root / "tokenizer.json"))


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

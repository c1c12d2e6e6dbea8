"""`QNNModelForCausalLM`: generate text with an exported artifact, on a Snapdragon host or the x86 HTP emulator.

The runtime reads the manifest and drives the .pte's methods through ExecuTorch's runtime. It never imports the
exporter, the quantizer or `torch.export`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from optimum_qnn.artifacts import INDEX_NAME, read_index
from optimum_qnn.contract import RunnerContract
from optimum_qnn.errors import ContextOverflowError, InvalidInputError, OptimumQnnError
from optimum_qnn.manifest import Manifest, ManifestError, read_manifest, resolve_inside, sha256_file
from optimum_qnn.native_output import quiet_runtime
from optimum_qnn.runner import KVSession
from optimum_qnn.runtime_args import PHONE_OPTIONS, check_generate_args, check_sampling, check_selection, eos_ids, prompt_ids

logger = logging.getLogger(__name__)


class VariantNotFoundError(OptimumQnnError):
    """No exported variant matches the requested SoC / quant scheme / context."""


@dataclass
class GenerationStats:
    """Timings of the last `generate` call."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    host_overhead_share: float = 0.0
    stopped_by: str = ""
    step_times: list[float] = field(default_factory=list)


def select_variant(index: dict[str, Any], soc: str | None, quant: str | None, context_len: int | None) -> dict[str, Any]:
    """The index entry matching the request (None matches anything); a miss lists what exists."""
    want = {"soc": soc.upper() if soc else None, "quant": quant, "context_len": context_len}
    hits = [
        v for v in index["variants"]
        if all(val is None or v.get(key) == val for key, val in want.items())
    ]
    if len(hits) == 1:
        return hits[0]
    available = ", ".join(f"{v['soc']}/{v['quant']}/ctx{v['context_len']}/{v['mode']}" for v in index["variants"]) or "none"
    if not hits:
        raise VariantNotFoundError(
            f"No variant for soc={soc}, quant={quant}, context_len={context_len}; available: {available}"
        )
    raise VariantNotFoundError(f"Several variants match soc={soc}, quant={quant}; be more specific. Available: {available}")


def verify_files(
    folder: Path, manifest: Manifest, *, root: Path | None = None, allowed_root: Path | None = None
) -> None:
    """Check the size and sha256 of every file the manifest lists; a mismatch names the file.

    ``folder`` is the variant folder; ``root``, when given, is the artifact root whose shared files (config,
    tokenizer...) the manifest's ``root_files`` list: they are checked too, since a tampered tokenizer or config
    changes what the model generates as surely as a tampered program. A 1.0 manifest lists no root files.
    ``allowed_root``: see `resolve_inside` (the blobs folder of a Hugging Face cache snapshot).
    """
    checks = [(folder, entry) for entry in manifest.files]
    if root is not None and manifest.root_files is not None:
        checks += [(root, entry) for entry in manifest.root_files]
    elif root is not None:
        logger.info("%s: a schema %s manifest lists no root files; config and tokenizer are not verified",
                    folder, manifest.schema_version)
    for base, entry in checks:
        path = resolve_inside(base, entry.path, allowed_root=allowed_root)
        if not path.is_file():
            raise ManifestError(f"{entry.path} is listed in the manifest but missing from {base}")
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            raise ManifestError(
                f"{entry.path} does not match its manifest sha256 (corrupt or tampered file at {path}); "
                "delete it and download or export it again"
            )


class QNNModelForCausalLM:
    """A QNN-exported Gemma4 causal LM, run through ExecuTorch's runtime (QNN HTP delegate).

    Example:

    ```python
    >>> model = QNNModelForCausalLM.from_pretrained("out/", soc="SM8650", quant="fp16")
    >>> model.generate(input_ids, max_new_tokens=32)
    ```
    """

    def __init__(self, root: Path, variant: Path, manifest: Manifest, *, allowed_root: Path | None = None):
        self.root = root
        self.variant = variant
        self.manifest = manifest
        self.contract: RunnerContract = manifest.runner_contract()
        self.stats = GenerationStats()
        pte = resolve_inside(variant, manifest.program.path, allowed_root=allowed_root)
        self._program = _LoadedProgram.get(pte, manifest)
        self._clock = _ExecClock()
        timed = {m.name: _TimedMethod(self._program, m.name, self._clock) for m in self.contract.methods}
        self._session = KVSession(self.contract, timed)

    @property
    def _exec_time(self) -> float:
        return self._clock.total

    @classmethod
    def from_pretrained(
        cls,
        repo_or_dir: str | Path,
        *,
        soc: str | None = None,
        quant: str | None = None,
        context_len: int | None = None,
        revision: str | None = None,
        device: str = "host",
        **device_options: Any,
    ) -> "QNNModelForCausalLM":
        """Load one variant of an artifact folder or Hub repo, verified against its manifest.

        Args:
            repo_or_dir: an artifact folder, or a Hub repo id holding one.
            soc: e.g. ``"SM8750"``; None when the artifact has a single SoC.
            quant: e.g. ``"16a4w_block64"``; None when unambiguous.
            context_len: the exported context length, when several exist.
            revision: Hub revision to download.
            device: ``"host"`` (this machine), or ``"adb"`` / ``"adb:SERIAL"``: a phone, through
                `optimum_qnn.device.PhoneModelForCausalLM` (``device_options``: its ``runner``, ``qnn_sdk_root``...).
        """
        if not isinstance(repo_or_dir, (str, Path)) or not str(repo_or_dir).strip():
            raise InvalidInputError(f"Expected an artifact folder or a Hub repo id; got {repo_or_dir!r}")
        check_selection(soc=soc, quant=quant, context_len=context_len, revision=revision)
        if device != "host":
            from optimum_qnn.device import DeviceSpec

            DeviceSpec.parse(device)  # a bad name fails before any download
            unknown = sorted(set(device_options) - PHONE_OPTIONS)
            if unknown:
                raise InvalidInputError(
                    f"Unknown option(s) of device={device!r}: {', '.join(unknown)}; expected some of: {', '.join(sorted(PHONE_OPTIONS))}"
                )
        elif device_options:
            raise InvalidInputError(f"{', '.join(sorted(device_options))}: options of device='adb', not of the host")
        from optimum_qnn.hub import check_folder_or_repo_id

        check_folder_or_repo_id(str(repo_or_dir), "artifact")
        path = Path(repo_or_dir).expanduser()
        blobs = None
        if path.is_dir():
            root = path
            index = read_index(root)
            entry = select_variant(index, soc, quant, context_len)
        else:
            from optimum_qnn.hub import download_variant

            root, entry = download_variant(str(repo_or_dir), soc=soc, quant=quant, context_len=context_len, revision=revision)
            blobs = root.parent.parent / "blobs"  # <cache>/models--org--name/snapshots/<sha>: files link into blobs/
        if not (root / INDEX_NAME).is_file():
            raise VariantNotFoundError(f"{root} has no {INDEX_NAME}: it is not an optimum-qnn artifact folder")
        variant = resolve_inside(root, entry["path"])
        manifest = read_manifest(variant)
        verify_files(variant, manifest, root=root, allowed_root=blobs)
        if soc is not None and manifest.target.soc != soc.upper():
            raise VariantNotFoundError(f"{variant} targets {manifest.target.soc}, not {soc}")
        if device != "host":
            from optimum_qnn.device import PhoneModelForCausalLM

            return PhoneModelForCausalLM(root, variant, manifest, device=device, allowed_root=blobs, **device_options)
        return cls(root, variant, manifest, allowed_root=blobs)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest.tokenizer.eos_ids)

    @torch.no_grad()
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
        """Generate up to ``max_new_tokens`` after ``input_ids``; returns ``[1, prompt + new]`` ids.

        Stops at an EOS id (default: the manifest's), at ``max_new_tokens``, or at the end of the context
        (``self.stats.stopped_by`` says which). ``streamer`` gets ``put(tensor)`` per new token and ``end()``.
        """
        prompt = prompt_ids(input_ids)
        check_generate_args(max_new_tokens, do_sample, temperature, top_k, top_p, streamer, generator)
        capacity = self._session.capacity
        if prompt.numel() > capacity:
            raise ContextOverflowError(
                f"The prompt has {prompt.numel()} tokens but the exported context holds {capacity}; "
                "shorten it or export with a larger --max-seq-len"
            )
        eos = eos_ids(eos_token_id, default=self.eos_token_ids)
        session = self._session
        session.reset()
        stats = GenerationStats(prompt_tokens=prompt.numel())
        self._clock.total = 0.0
        t0 = time.perf_counter()
        logits = session.feed(prompt)[-1]
        t_first = time.perf_counter()
        stats.time_to_first_token_s = t_first - t0
        stats.prefill_tokens_per_s = prompt.numel() / max(stats.time_to_first_token_s, 1e-9)
        out = prompt.tolist()
        decode_exec = 0.0
        stats.stopped_by = "max_new_tokens"
        for step in range(max_new_tokens):
            token = _pick(logits, do_sample, temperature, top_k, top_p, generator)
            out.append(token)
            stats.new_tokens += 1
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if token in eos:
                stats.stopped_by = "eos"
                break
            if step == max_new_tokens - 1:
                break
            if session.n_past >= capacity:
                stats.stopped_by = "context_full"
                logger.warning("Generation stopped: the exported context of %d tokens is full", capacity)
                break
            before = self._exec_time
            s0 = time.perf_counter()
            logits = session.feed(torch.tensor([token]))[-1]
            stats.step_times.append(time.perf_counter() - s0)
            decode_exec += self._exec_time - before
        if streamer is not None:
            streamer.end()
        decode_time = sum(stats.step_times)
        if stats.step_times:
            stats.decode_tokens_per_s = len(stats.step_times) / decode_time
            stats.host_overhead_share = max(0.0, 1.0 - decode_exec / decode_time)
        self.stats = stats
        return torch.tensor(out, dtype=torch.long).unsqueeze(0)

    def text_generation(self, tokenizer, prompt: str, *, chat: bool = False, **kwargs) -> str:
        """Tokenize ``prompt`` (through the chat template when ``chat``), generate, and decode the new text."""
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a string; got {type(prompt).__name__} (use generate() for token ids)")
        if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
            raise InvalidInputError(
                f"tokenizer must be a Hugging Face tokenizer (AutoTokenizer.from_pretrained(folder)); got {type(tokenizer).__name__}"
            )
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidInputError(
                    "chat=True needs a tokenizer with a chat template, and this one has none: pass chat=False "
                    "(without --chat) or a tokenizer whose tokenizer_config.json has a chat_template"
                )
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a Mapping, not a dict)
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        out = self.generate(torch.tensor(ids), **kwargs)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k, top_p, generator) -> int:
    if not do_sample:
        return int(torch.argmax(logits))
    check_sampling(do_sample, temperature, top_k, top_p)
    scores = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) > top_p  # keep the token that crosses top_p
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class _LoadedProgram:
    """One loaded .pte and its methods, shared by every `QNNModelForCausalLM` of the same file content.

    ExecuTorch's QNN backend caches the delegate handle of each context binary by the signature stamped into it at
    compile time (`QnnExecuTorchBackend::init`, "Use cached delegate handle for current method"): a second load of
    the same .pte gets the first load's handle, and destroying either program destroys the QNN context both use
    (the next call fails with "DelegateHandle has been deleted" and the process crashes). So a .pte is loaded once per
    process and its program lives as long as any model uses it: models hold it strongly, the table below weakly,
    and Python's reference counting frees it with its last model. Copies of one file (same sha256) carry the same
    signatures and share an entry too. Methods run under a lock: the QNN graphs' IO tensors are per context.
    """

    _live: "weakref.WeakValueDictionary[str, _LoadedProgram]" = weakref.WeakValueDictionary()
    _live_lock = threading.Lock()

    def __init__(self, program: Any, method_names: Sequence[str]):
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
    def get(cls, path: Path, manifest: Manifest) -> "_LoadedProgram":
        """The live program of ``path``'s content, or a fresh load of it."""
        key = manifest.program.sha256
        with cls._live_lock:
            loaded = cls._live.get(key)
            if loaded is None:
                names = [m.name for m in manifest.runner_contract().methods]
                with quiet_runtime():  # the QNN backend prints a dozen INFO lines as it opens the program's contexts
                    loaded = cls(_load_program(path, manifest), names)
                cls._live[key] = loaded
            return loaded

    @classmethod
    def live_count(cls) -> int:
        """Programs loaded in this process and still used by a model."""
        return len(cls._live)


def _release(methods: dict[str, Any], held: list[Any]) -> None:
    with quiet_runtime():
        methods.clear()
        held.clear()


class _ExecClock:
    """Seconds spent inside method calls, owned by one model (not by the shared program)."""

    total: float = 0.0


class _TimedMethod:
    """Calls one method of a shared program, timing it on a model's clock.

    It refers to the program and the clock, never to the model, so a model is freed as soon as its last reference
    goes (no reference cycle left for the garbage collector).
    """

    def __init__(self, loaded: _LoadedProgram, name: str, clock: _ExecClock):
        # The method is looked up per call, never held here: the program's finalizer must be able to free it.
        self.loaded, self.name, self.clock = loaded, name, clock

    def __call__(self, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        # The runtime needs contiguous inputs; only the prefill method's K-cache views are not.
        args = [t if t.is_contiguous() else t.contiguous() for t in inputs]
        with self.loaded.lock:
            t0 = time.perf_counter()
            out = self.loaded.methods[self.name].execute(args)
            self.clock.total += time.perf_counter() - t0
        return out


def host_can_run(weight_sharing: bool) -> bool:
    """Whether this host can load a .pte: the x86 HTP emulator cannot load graphs that share weights."""
    import platform

    return not (weight_sharing and platform.machine() == "x86_64")


def _load_program(path: Path, manifest: Manifest):
    """Load the .pte with the QNN backend and the CPU kernels its embedding lookups need."""
    from optimum_qnn.sdk import check_runtime_can_load, ensure_qnn_sdk

    if not host_can_run(manifest.contract.weight_sharing):
        raise OptimumQnnError(
            f"{path} shares weights between its prefill and decode graphs, which the x86 HTP emulator cannot load. "
            "Run it on a Snapdragon device, or re-export with --no-weight-sharing to run it on x86."
        )
    check_pte_structure(path)
    sdk = ensure_qnn_sdk()
    check_runtime_can_load(manifest.versions.qairt_build_id, sdk.build_id, runtime_source=sdk.source)
    import executorch.kernels.quantized  # noqa: F401  (registers quantized_decomposed::embedding_* kernels)

    if manifest.contract.shards > 1:
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

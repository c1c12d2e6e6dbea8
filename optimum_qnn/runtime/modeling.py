"""`QNNModelForCausalLM`: generate text with an exported artifact, through one of the runtime backends.

- ``device="host"``: in this process, through ExecuTorch's Python runtime (``host:executorch``: where its wheel has the
  QNN backend, x86_64 Linux) or onnxruntime-qnn (``host:onnxruntime``: Windows on Snapdragon, Linux boards, and any
  host without ExecuTorch); ``host`` alone picks the first that this host has (`default_host_runtime`);
- ``device="runner"``: ExecuTorch's C++ ``qnn_llama_runner`` on this machine (an aarch64 Linux board or a
  Windows-on-Snapdragon laptop, where no ExecuTorch Python wheel has the QNN backend; on x86, the emulator);
- ``device="adb"`` / ``"adb:SERIAL"``: the same runner on a phone plugged into this machine.

The model checks every argument (`runtime.generation`) before its backend runs; the backend returns the tokens and
its stats. The runtime never imports the exporter, the quantizer or `torch.export`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from optimum_qnn.artifacts.manifest import Manifest, read_manifest, resolve_inside
from optimum_qnn.artifacts.variants import (
    AUTO_SPECULATIVE, FULL_LAYOUT, RING_LAYOUT, MemoryFit, VariantNotFoundError, memory_need_bytes, select_variant,
    verify_files,
)
from optimum_qnn.artifacts.writer import INDEX_NAME, read_index
from optimum_qnn.contract import RunnerContract
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.ops.arrays import like
from optimum_qnn.native_output import quietly
from optimum_qnn.runtime.assistant import assistant_of
from optimum_qnn.runtime.backends.device import DeviceSpec
from optimum_qnn.runtime.generation import (
    RUNNER_OPTIONS, SPECULATIVE, GenerationStats, Sampling, check_generate_args, check_selection, check_speculative,
    prompt_ids,
)
from optimum_qnn.runtime.limits import limits_of
from optimum_qnn.runtime.stops import text_stop_ids
from optimum_qnn.runtime.transformers_api.model_api import TransformersModelMixin

if TYPE_CHECKING:
    from optimum_qnn.runtime.chat import ChatSession

logger = logging.getLogger(__name__)

__all__ = ["QNNModelForCausalLM", "VariantNotFoundError"]


class QNNModelForCausalLM(TransformersModelMixin):
    """A QNN-exported Gemma4 causal LM, run through one of the runtime backends, with the face of a transformers
    model: `generate` takes what transformers' takes, and ``config``, ``generation_config``, ``device``, ``dtype``,
    ``save_pretrained`` and ``pipeline()`` work (`runtime.transformers_api`).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained("out/")
    >>> model = QNNModelForCausalLM.from_pretrained("out/", soc="SM8650", quant="fp16")
    >>> out = model.generate(**tokenizer("The for statement is used to", return_tensors="pt"), max_new_tokens=32)
    >>> tokenizer.decode(out[0])
    ```
    """

    # Which variants `from_pretrained` picks from (`select_variant`): a text variant where one has an image twin.
    takes_images = False

    def __init__(self, root: Path, variant: Path, manifest: Manifest, backend: Any = None, *,
                 allowed_root: Path | None = None, name: str | None = None):
        """A verified variant and the backend that runs it (default: the host backend). ``name``: what a user calls
        it (the served model id, the chat banner); default the artifact folder's name."""
        self.root = root
        self.name = name or Path(root).name
        self.variant = variant
        self.manifest = manifest
        self.contract: RunnerContract = manifest.runner_contract()
        if backend is None:
            backend = host_backend(variant, manifest, DeviceSpec("host"), allowed_root=allowed_root)
        self.backend = backend

    @property
    def stats(self) -> GenerationStats:
        """Timings of the last `generate` call, from the backend that ran it."""
        return self.backend.stats

    @property
    def device_name(self) -> str:
        """Where the tokens are computed: ``host:executorch``, ``host:onnxruntime``, ``runner`` or ``adb:SERIAL``
        (``device`` is where the inputs and outputs live, as on a transformers model)."""
        return self.backend.name

    @classmethod
    @quietly
    def from_pretrained(
        cls,
        repo_or_dir: str | Path,
        *,
        soc: str | None = None,
        quant: str | None = None,
        context_len: int | None = None,
        cache_layout: str | None = None,
        max_memory: float | None = None,
        revision: str | None = None,
        device: str = "host",
        speculative: str | None = None,
        **device_options: Any,
    ) -> "QNNModelForCausalLM":
        """Load one variant of an artifact folder or Hub repo, verified against its manifest.

        Args:
            repo_or_dir: an artifact folder, or a Hub repo id holding one.
            soc: e.g. ``"SM8750"``; None when the artifact has a single SoC.
            quant: e.g. ``"16a4w_block64"``; None when unambiguous.
            context_len: the exported context length (the export's ``--max-seq-len``). None with several: the
                largest whose estimated memory (`artifacts.variants.memory_need_bytes`) fits ``max_memory``; one
                line says which was chosen and why.
            cache_layout: ``"full"`` or ``"ring"``, when the artifact has both. None: the in-process (host)
                backends take the ring (fewer bytes per call, the same output), the runner and adb backends the full
                layout (ExecuTorch's C++ runner reads no other).
            max_memory: GB the variant may take when the context is chosen by memory; default: what this host has
                available, less a margin (10 %, at least 1 GB).
            revision: Hub revision to download.
            device: ``"host"`` (in this process, through this host's default runtime), ``"host:executorch"`` or
                ``"host:onnxruntime"`` (that runtime), ``"runner"`` (ExecuTorch's C++ runner here) or
                ``"adb"`` / ``"adb:SERIAL"`` (that runner on a phone). ``device_options`` go to the runner backend
                (`runtime.backends.runner.RunnerBackend`: ``runner``, ``qnn_sdk_root``, ``shared_buffer``).
            speculative: the speculative decoding the caller will ask `generate` for (``"lookahead"``,
                ``"assistant"``): where the artifact has variants of the same SoC, scheme and context exported for
                different decodings, the one for it (None: the plain one); a variant without it is refused from its
                manifest, before its program is loaded. ``"auto"``: the assistant's variant if there is one, else
                lookahead's, else plain (`default_speculative` then names its decoding: `chat` and `serve` use it).
        """
        if not isinstance(repo_or_dir, (str, Path)) or not str(repo_or_dir).strip():
            raise InvalidInputError(f"Expected an artifact folder or a Hub repo id; got {repo_or_dir!r}")
        check_selection(soc=soc, quant=quant, context_len=context_len, revision=revision, cache_layout=cache_layout,
                        max_memory=max_memory)
        if speculative not in (None, AUTO_SPECULATIVE, *SPECULATIVE):
            raise InvalidInputError(f"speculative must be None, {AUTO_SPECULATIVE!r} or one of: {', '.join(SPECULATIVE)}; "
                                    f"got {speculative!r}")
        spec = DeviceSpec.parse(device)  # a bad name fails before any download
        prefer = RING_LAYOUT if spec.kind == "host" else FULL_LAYOUT
        if spec.kind == "host" and device_options:
            raise InvalidInputError(
                f"{', '.join(sorted(device_options))}: options of device='runner' or 'adb', not of the host"
            )
        unknown = sorted(set(device_options) - RUNNER_OPTIONS)
        if unknown:
            raise InvalidInputError(
                f"Unknown option(s) of device={device!r}: {', '.join(unknown)}; expected some of: "
                f"{', '.join(sorted(RUNNER_OPTIONS))}"
            )
        from optimum_qnn.artifacts.hub import check_folder_or_repo_id

        check_folder_or_repo_id(str(repo_or_dir), "artifact")
        path = Path(repo_or_dir).expanduser()
        blobs = None
        name = path.resolve().name if path.is_dir() else None
        if path.is_dir():
            root = path
            index = read_index(root)
            fit = MemoryFit(lambda e: memory_need_bytes(read_manifest(resolve_inside(root, e["path"]))), max_memory)
            entry = select_variant(index, soc, quant, context_len, cache_layout, prefer_layout=prefer, fit=fit,
                                   speculative=speculative, images=cls.takes_images)
        else:
            from optimum_qnn.artifacts.hub import download_variant

            root, entry = download_variant(str(repo_or_dir), soc=soc, quant=quant, context_len=context_len, revision=revision,
                                           cache_layout=cache_layout, prefer_layout=prefer, max_memory=max_memory,
                                           speculative=speculative, images=cls.takes_images)
            blobs = root.parent.parent / "blobs"  # <cache>/models--org--name/snapshots/<sha>: files link into blobs/
            name = str(repo_or_dir).strip().rstrip("/").rsplit("/", 1)[-1]  # the repo's name, not the snapshot's sha
        if not (root / INDEX_NAME).is_file():
            raise VariantNotFoundError(f"{root} has no {INDEX_NAME}: it is not an optimum-qnn artifact folder")
        variant = resolve_inside(root, entry["path"])
        manifest = read_manifest(variant)
        # Before the files are hashed and the program loaded: the manifest says what the variant can decode with.
        if speculative != AUTO_SPECULATIVE:
            check_speculative(speculative, speculative_kinds(manifest, in_process=spec.kind == "host"), variant.name)
        verify_files(variant, manifest, root=root, allowed_root=blobs)
        if soc is not None and manifest.target.soc != soc.upper():
            raise VariantNotFoundError(f"{variant} targets {manifest.target.soc}, not {soc}")
        if spec.kind == "host":
            backend = host_backend(variant, manifest, spec, allowed_root=blobs)
        else:
            from optimum_qnn.runtime.backends.runner import RunnerBackend

            backend = RunnerBackend(root, variant, manifest, device=spec, allowed_root=blobs, **device_options)
        return cls(root, variant, manifest, backend, allowed_root=blobs, name=name)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest.tokenizer.eos_ids)

    @quietly
    def generate(self, input_ids: Any = None, attention_mask: Any = None, generation_config: Any = None,
                 **kwargs: Any) -> Any:
        """Generate as transformers' ``generate`` does, on this model's backend (`transformers_api.generate`).

        Args:
            input_ids: ``[batch, length]`` ids (a torch tensor, a numpy array, a list of rows; one row may be 1-D).
            attention_mask: the tokenizer's mask; rows are left-padded. Each row runs by itself, its padding stripped
                and put back in the output.
            generation_config: a transformers ``GenerationConfig`` or a dict of its fields, over
                ``self.generation_config`` (the checkpoint's ``generation_config.json``).
            kwargs: its fields (``max_new_tokens``, ``max_length``, ``min_new_tokens``, ``do_sample``,
                ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``,
                ``stop_strings``, ``num_return_sequences``, ``return_dict_in_generate``, ``output_scores``,
                ``output_logits``, ``max_time``), ``streamer``, ``tokenizer`` (for ``stop_strings``),
                ``logits_processor`` and ``stopping_criteria`` (transformers' objects, on a host device), and
                optimum-qnn's ``generator``, ``reuse_cache``, ``cancel`` and ``speculative`` (see `generate_tokens`).
                What the program cannot do (``num_beams > 1``, ``assistant_model``, ...) raises
                `UnsupportedParameterError` naming it.

        Returns:
            ``[batch * num_return_sequences, length + new]`` ids (a torch tensor when ``input_ids`` is one, else
            numpy), or with ``return_dict_in_generate=True`` transformers' ``GenerateDecoderOnlyOutput`` (numpy
            fields in a dict-like output without transformers).
        """
        from optimum_qnn.runtime.transformers_api.generate import hf_generate

        return hf_generate(self, input_ids, attention_mask, generation_config, **kwargs)

    def generate_tokens(
        self,
        input_ids: Any,
        max_new_tokens: int | None = None,
        *,
        sampling: Any = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: Any = None,
        generator: Any = None,
        reuse_cache: bool = False,
        cancel: Callable[[], bool] | None = None,
        speculative: str | None = None,
        image_features: Any = None,
    ) -> Any:
        """One sequence, with optimum-qnn's own defaults (greedy, EOS from the manifest; what ``chat``, ``serve`` and
        ``run`` use): up to ``max_new_tokens`` after ``input_ids`` (a list of ints, a numpy array or a torch tensor);
        returns ``[1, prompt + new]`` ids: a torch tensor when ``input_ids`` is one, else a numpy int64 array.
        ``generator``: a ``numpy.random.Generator`` or a ``torch.Generator`` for repeatable sampling. ``sampling``:
        an object whose ``pick(logits)`` chooses each token (`transformers_api.choosing.RowChooser`), instead of
        ``do_sample``, ``temperature``, ``top_k``, ``top_p`` and ``generator``.

        ``max_new_tokens`` unset: `limits.DEFAULT_MAX_NEW_TOKENS`, at most the room the context leaves after the
        prompt on this backend (`limits.Limits`, the rule of every face); a prompt longer than the backend takes
        raises `ContextOverflowError`.

        Stops at an EOS id (default: the manifest's; the C++ runner also stops at its own end tokens), at
        ``max_new_tokens``, at the end of the context, or when ``cancel()`` returns True (checked before each new
        token; ``self.stats.stopped_by`` says which). ``streamer`` gets ``put(tensor)`` per new token and ``end()``
        (from a runner backend: when its process ends).

        ``reuse_cache=True``: the host backend keeps the K/V of the longest prefix of ``input_ids`` that its caches
        hold from the previous call (a prompt plus its generated tokens) and prefills only the rest;
        ``self.stats.reused_tokens`` says how many. A runner backend keeps nothing between calls.

        ``speculative="lookahead"`` (a variant exported with ``--mode lookahead``; `speculative_choices`): each
        decode call verifies guessed n-grams, as ExecuTorch's runner does with ``--eval_mode 2``; greedy output is
        plain greedy output. ``speculative="assistant"`` (a variant exported with ``--assistant``, on a host backend):
        the drafter drafts K tokens and one decode call verifies them (`runtime.assistant`); greedy output is plain
        greedy output, sampled output is drawn from the target's own distribution. ``self.stats`` reports
        ``tokens_per_target_call``, ``acceptance_rate`` and, with an assistant, ``drafter_calls``.
        """
        prompt = prompt_ids(input_ids)
        limits = limits_of(self)
        limits.check_prompt(len(prompt))
        if max_new_tokens is None:
            max_new_tokens = limits.default_max_new_tokens(len(prompt))
        check_generate_args(max_new_tokens, do_sample, temperature, top_k, top_p, streamer, generator, cancel)
        if not isinstance(reuse_cache, bool):
            raise InvalidInputError(f"reuse_cache must be True or False; got {reuse_cache!r}")
        check_speculative(speculative, self.speculative_choices, self.variant.name)
        if sampling is None:
            sampling = Sampling(do_sample, temperature, top_k, top_p, generator)
        extra = {} if speculative is None else {"speculative": speculative}
        fed = prompt
        if image_features is not None:  # an image variant's soft tokens (`QNNModelForImageTextToText`)
            from optimum_qnn.runtime.soft_tokens import soft_tokens_of

            fed, extra["images"] = soft_tokens_of(self, prompt, image_features)
        new = self.backend.generate(fed, max_new_tokens, sampling, eos_token_id, streamer,
                                    reuse_cache=reuse_cache, cancel=cancel, **extra)
        if streamer is not None:
            if not getattr(self.backend, "streams", False):  # a runner gives its text when it exits
                for token in new:
                    streamer.put(np.array([token]))
            streamer.end()
        return like(input_ids, np.array([prompt.tolist() + new], dtype=np.int64))

    @property
    def speculative_choices(self) -> tuple[str, ...]:
        """The ``speculative`` values `generate` accepts for this variant on this backend (``("lookahead",)``,
        ``("assistant",)`` or ``()``)."""
        return speculative_kinds(self.manifest, in_process=getattr(self.backend, "runs_assistant", False))

    @property
    def default_speculative(self) -> str | None:
        """What `chat` and `serve` decode with: the variant's speculative decoding when it has one, else None."""
        return self.speculative_choices[0] if self.speculative_choices else None

    def chat(self, system: str | None = None, *, tokenizer: Any = None, **generation_defaults: Any) -> "ChatSession":
        """Start a conversation (`runtime.chat.ChatSession`): ``send(text)`` returns each reply, and on the host backend
        a turn prefills only its own tokens.

        Args:
            system: an optional system prompt (kept when the oldest turns are dropped to fit the context).
            tokenizer: default: the artifact's own tokenizer files (with their chat template), read locally.
            generation_defaults: `generate` options for every reply, e.g. ``max_new_tokens=128``.
        """
        from optimum_qnn.runtime.chat import ChatSession

        if tokenizer is None:
            tokenizer = self.tokenizer()
        return ChatSession(self, tokenizer, system, **generation_defaults)

    def clear_cache(self) -> None:
        """Forget the tokens the host backend's caches hold, so no later call reuses them (a runner keeps none)."""
        clear = getattr(self.backend, "clear_cache", None)
        if clear is not None:
            clear()

    def tokenizer(self) -> Any:
        """The artifact's tokenizer (`runtime.tokenizer.ArtifactTokenizer` on the artifact folder's files: no
        transformers needed, nothing downloaded)."""
        from optimum_qnn.runtime.tokenizer import ArtifactTokenizer

        return ArtifactTokenizer(self.root)

    def text_generation(self, tokenizer, prompt: str, *, chat: bool = False, **kwargs) -> str:
        """Tokenize ``prompt`` (through the chat template when ``chat``), generate, and decode the new text.

        With ``chat``, the reply stops at the end of its turn (`stops.text_stop_ids`: Gemma4's ``<turn|>`` too), as
        `chat` and `serve` do, unless ``eos_token_id`` is given."""
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a string; got {type(prompt).__name__} (use generate() for token ids)")
        if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
            raise InvalidInputError(
                f"tokenizer must be a tokenizer (model.tokenizer(), or a Hugging Face one); got {type(tokenizer).__name__}"
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
        kwargs.setdefault("eos_token_id", text_stop_ids(self.manifest.tokenizer.eos_ids, tokenizer, chat))
        out = self.generate_tokens(list(ids), **kwargs)
        return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)




def speculative_kinds(manifest: Manifest, *, in_process: bool) -> tuple[str, ...]:
    """The speculative decodings ``manifest``'s variant was exported for: ``lookahead`` (every backend: ExecuTorch's
    runner runs it with ``--eval_mode 2``) and ``assistant`` (``in_process`` backends only: the C++ runner has no
    drafter)."""
    kinds = ("lookahead",) if manifest.contract.lookahead is not None else ()
    return kinds + (("assistant",) if in_process and assistant_of(manifest) is not None else ())


def host_backend(variant: Path, manifest: Manifest, spec: DeviceSpec, *, allowed_root: Path | None = None) -> Any:
    """The in-process backend of ``spec`` (``host``, ``host:executorch`` or ``host:onnxruntime``)."""
    from optimum_qnn.runtime.backends.device import default_host_runtime

    runtime = spec.runtime
    if runtime is None:
        runtime, why = default_host_runtime()
        logger.info("Running in %s: %s", runtime, why)
    if runtime == "executorch":
        from optimum_qnn.runtime.backends.host import ExecuTorchBackend

        return ExecuTorchBackend(variant, manifest, allowed_root=allowed_root)
    from optimum_qnn.runtime.backends.onnxruntime.backend import OnnxRuntimeBackend

    return OnnxRuntimeBackend(variant, manifest, allowed_root=allowed_root)

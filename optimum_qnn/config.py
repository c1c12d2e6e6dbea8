"""Frozen configuration objects: target SoCs, quantization schemes and the export configuration.

Everything here is plain Python (no torch import) so the CLI and the runtime can read it cheaply.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field

from optimum_qnn.contract import CacheLayout  # re-exported beside the other choices of an export
from optimum_qnn.errors import InvalidInputError, parse_enum
from optimum_qnn.lookahead import Lookahead  # re-exported beside the other choices of an export
from optimum_qnn.size_budget import SizeBudget  # re-exported beside the other choices of an export
from optimum_qnn.socs import Soc, check_supported  # Soc re-exported: config holds every choice of an export


def _choices(enum_cls: type[enum.Enum]) -> str:
    return ", ".join(m.value for m in enum_cls)


_parse_enum = parse_enum


class QuantScheme(enum.Enum):
    """How the HTP part of the graph is quantized: activation bits 'a', weight bits 'w'."""

    FP16 = "fp16"
    A16W16 = "16a16w"
    A16W8 = "16a8w"
    A16W4 = "16a4w"
    A16W4_BLOCK = "16a4w_block"
    A8W8 = "8a8w"

    @classmethod
    def parse(cls, value: object) -> "QuantScheme":
        return _parse_enum(cls, value, "quant scheme")

    @property
    def is_quantized(self) -> bool:
        return self is not QuantScheme.FP16


    @property
    def weight_bits(self) -> int:
        return {
            QuantScheme.FP16: 16,
            QuantScheme.A16W16: 16,
            QuantScheme.A16W8: 8,
            QuantScheme.A16W4: 4,
            QuantScheme.A16W4_BLOCK: 4,
            QuantScheme.A8W8: 8,
        }[self]


class ExportMode(enum.Enum):
    """`kv`: one decode method (ar_len 1). `hybrid`: a prefill method (ar_len N) plus the decode method.
    `lookahead`: hybrid whose decode method takes a tree of guesses (`optimum_qnn.lookahead.Lookahead`'s AR)."""

    KV = "kv"
    HYBRID = "hybrid"
    LOOKAHEAD = "lookahead"

    @property
    def has_prefill(self) -> bool:
        return self is not ExportMode.KV

    @classmethod
    def parse(cls, value: object) -> "ExportMode":
        return _parse_enum(cls, value, "mode")


BLOCK_SIZES = (32, 64)


class WeightRanges(enum.Enum):
    """How the 4-bit weight scales are chosen.

    `minmax`: each channel's (block's) largest weight sets its scale. `output-mse`: per output channel, the clip
    of that range (1.0 down to 0.5) whose rounding error least changes the linear's output on the calibration
    activations (the SeqMSE idea of ExecuTorch's Qualcomm flow, searched per channel; see optimum_qnn.quantization.weight_search).
    """

    MINMAX = "minmax"
    OUTPUT_MSE = "output-mse"

    @classmethod
    def parse(cls, value: object) -> "WeightRanges":
        return _parse_enum(cls, value, "weight range method")


class WeightRounding(enum.Enum):
    """How 4-bit weights are rounded onto their scales.

    `nearest`: each weight to its nearest level. `gptq`: column by column, each column's rounding error pushed onto
    the columns not yet rounded so the errors cancel in the layer's output on the calibration activations
    (optimum_qnn.quantization.gptq). The scales are the same either way.
    """

    NEAREST = "nearest"
    GPTQ = "gptq"

    @classmethod
    def parse(cls, value: object) -> "WeightRounding":
        return _parse_enum(cls, value, "weight rounding method")


@dataclass(frozen=True)
class EmbeddingQuant:
    """Weight-only quantization of the CPU-side embedding tables (`bits,group`, e.g. `4,32`).

    `bits=0` keeps the tables in floating point; `group_size=0` is one group per row. Symmetric by default (the
    convention of ExecuTorch's own embedding quantization): one fp16 scale per group and no zero point, which is what
    ExecuTorch's quantized embedding kernels read with float32 output. `symmetric=False` (`4,32,asym`) adds a zero
    point per group; the kernels then want scales and zero points in the output dtype (float32), 4x the bytes of
    fp16 scales alone (for Gemma-4-E2B's tables at 4 bits in groups of 32: 656 MB against 164 MB).
    """

    bits: int = 4
    group_size: int = 32
    symmetric: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.symmetric, bool):
            raise InvalidInputError(f"Embedding quantization symmetric must be True or False; got {self.symmetric!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.bits, self.group_size)):
            raise InvalidInputError(f"Embedding quantization bits and group size must be integers; got {self.bits!r}, {self.group_size!r}")
        if self.bits not in (0, 4, 8):
            raise InvalidInputError(f"Embedding quantization bits must be one of 0, 4, 8; got {self.bits}")
        if self.group_size < 0:
            raise InvalidInputError(
                f"Embedding quantization group size must be >= 0 (0: one group per row); got {self.group_size}"
            )

    @classmethod
    def parse(cls, text: str) -> "EmbeddingQuant":
        """Parse `"4,32"` (bits, group size), `"8"` (per-row), `"4,32,asym"` (with zero points) or `"none"`."""
        text = text.strip().lower()
        if text in ("none", "0", "fp", "float"):
            return cls(bits=0, group_size=0)
        parts = text.split(",")
        symmetric = True
        if len(parts) in (2, 3) and parts[-1].strip() in ("asym", "sym"):
            symmetric = parts.pop().strip() == "sym"
        try:
            if len(parts) > 2:
                raise ValueError
            bits = int(parts[0])
            group = int(parts[1]) if len(parts) > 1 else 0
        except ValueError:
            raise InvalidInputError(
                f"Cannot parse embedding quantization {text!r}; expected 'BITS,GROUP' such as '4,32', 'BITS' (one "
                "group per row), either followed by ',asym' for zero points, or 'none'"
            ) from None
        return cls(bits=bits, group_size=group, symmetric=symmetric)

    @classmethod
    def default_for(cls, quant: "QuantScheme", widths: tuple[int, ...]) -> "EmbeddingQuant":
        """The tables' quantization when the user chose none: float for an fp16 export; else 4-bit in groups of 32,
        16 or 8 when 32 does not divide every table width (48 is a valid Gemma4 width), else one group per row;
        8-bit per row when 4-bit cannot pack a width (odd)."""
        if not quant.is_quantized:
            return cls(0, 0)
        if any(w % 2 for w in widths):
            return cls(8, 0)
        common = math.gcd(*widths)
        # Groups smaller than 8 would spend more bytes on scales than on weights: one group per row instead.
        return cls(4, next((g for g in (32, 16, 8) if common % g == 0), 0))

    def check_widths(self, widths: tuple[int, ...]) -> None:
        """Refuse, before the model loads, a chosen quantization that cannot split a table of these widths."""
        if not self.bits:
            return
        for width in widths:
            if self.group_size and width % self.group_size:
                fits = [g for g in (16, 32, 64, 128, 256) if all(w % g == 0 for w in widths)]
                raise InvalidInputError(
                    f"--embedding-quant {self}: an embedding table of this model is {width} wide, not a multiple of "
                    f"the group size {self.group_size}; choose "
                    + (f"a group size of {' or '.join(map(str, fits))}, " if fits else "")
                    + f"'{self.bits},0' (one group per row), or leave --embedding-quant out to let the exporter choose"
                )
            if self.bits == 4 and width % 2:
                raise InvalidInputError(
                    f"--embedding-quant {self}: 4-bit tables pack two values per byte and a table of this model is "
                    f"{width} wide (odd); use '8,0' or 'none'"
                )

    def __str__(self) -> str:
        if not self.bits:
            return "none"
        return f"{self.bits},{self.group_size}" + ("" if self.symmetric else ",asym")


# The context an export gets without --max-seq-len (less where the model or the target's HTP allows less). Measured
# at Gemma-4-E2B's full size (benchmarks/contexts.py, rows in benchmarks/contexts.json, docs/exporting.md#context-length):
# the export at 4096 takes the time and memory of one at 1024 (the weights dominate both) and fits a 16 GB machine;
# what grows is the KV cache the HTP reads on every decode step, and at 4096 it is still a small share of the weights
# it reads (an estimate for SM8750 in benchmarks/RESULTS.md). Google's own NPU builds of Gemma-4-E2B hold 4096 too.
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class ShapeConfig:
    """Static shapes of the exported graphs.

    Args:
        max_seq_len: total context length C (past tokens + the tokens of one call); None (the default) lets the
            exporter choose once it has read the model's config: `DEFAULT_CONTEXT`, or less where the model's
            ``max_position_embeddings`` or the target's HTP (`exporter.htp_limits`) allows less.
        prefill_ar_len: tokens per prefill call (hybrid mode); decode always takes 1.
        cache_layout: ``full`` (every cache ``C - ar`` slots: what ExecuTorch's C++ runner reads), ``ring``
            (sliding layers keep ``sliding_window`` slots; for this project's own runtimes) or ``blocks`` (the ring,
            and every other cache cut into column blocks, each an input: the long contexts QNN cannot compile in one
            piece; this project's runtimes only). None (the default): ``full``, or ``blocks`` where the target's HTP
            cannot compile the context in ``full`` (`exporter.htp_limits.choose_layout`).
        cache_block_len: slots per cache block of the ``blocks`` layout; None (the default): the most whose block
            fits every target SoC's TCM (`exporter.htp_limits.block_len_for`).
    """

    max_seq_len: int | None = None
    prefill_ar_len: int = 128
    cache_layout: CacheLayout | None = None
    cache_block_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_seq_len is None:  # chosen by the exporter (`DEFAULT_CONTEXT`); the rest is checked then
            if isinstance(self.prefill_ar_len, bool) or not isinstance(self.prefill_ar_len, int) or self.prefill_ar_len <= 0:
                raise InvalidInputError(f"prefill_ar_len must be a positive integer; got {self.prefill_ar_len!r}")
        elif not isinstance(self.max_seq_len, int) or not isinstance(self.prefill_ar_len, int):
            raise InvalidInputError(
                f"max_seq_len and prefill_ar_len must be integers; got {self.max_seq_len!r} and {self.prefill_ar_len!r}"
            )
        elif self.max_seq_len <= 0 or self.prefill_ar_len <= 0:
            raise InvalidInputError(
                f"max_seq_len and prefill_ar_len must be positive; got {self.max_seq_len} and {self.prefill_ar_len}"
            )
        elif self.max_seq_len < 2:
            raise InvalidInputError(
                f"max_seq_len must be at least 2 (a cache of max_seq_len - 1 tokens plus the current one); got {self.max_seq_len}"
            )
        if self.cache_layout is not None and not isinstance(self.cache_layout, CacheLayout):
            raise InvalidInputError(
                f"cache_layout must be a CacheLayout (CacheLayout.parse('ring')) or None; got {self.cache_layout!r}"
            )
        if self.cache_block_len is not None and (
                isinstance(self.cache_block_len, bool) or not isinstance(self.cache_block_len, int) or self.cache_block_len < 1):
            raise InvalidInputError(f"cache_block_len must be a positive integer of slots, or None; got {self.cache_block_len!r}")
        if self.cache_block_len is not None and self.cache_layout not in (None, CacheLayout.BLOCKS):
            raise InvalidInputError(
                f"cache_block_len {self.cache_block_len} cuts caches in the blocks layout only; this one is {self.cache_layout.value}")


# Drafts per round of an assistant export when --draft-len is not given (docs/assistant.md).
DEFAULT_DRAFT_LEN = 3
# `--task`: the text decoder (the default), or the vision encoder beside it (`ExportConfig.image_tokens`).
TEXT_TASK, IMAGE_TASK = "text-generation", "image-text-to-text"
DEFAULT_IMAGE_TOKENS = 280  # Hugging Face's default budget: 2520 patches an image


@dataclass(frozen=True)
class ExportConfig:
    """Everything that decides what one export produces (one instance per CLI invocation)."""

    socs: tuple[Soc, ...] = (Soc.SM8650,)
    # 16a8w: measured best on the demo model (4-bit schemes lost it there; see the issue notes).
    quant: QuantScheme = QuantScheme.A16W8
    block_size: int = 64
    mode: ExportMode = ExportMode.HYBRID
    shapes: ShapeConfig = field(default_factory=ShapeConfig)
    # None: chosen by `EmbeddingQuant.default_for` once the table widths are known (float tables for fp16).
    embedding_quant: EmbeddingQuant | None = None
    # Hybrid graphs share one copy of the weights inside the HTP context (what a phone wants). The x86 HTP
    # emulator cannot load such a context, so artifacts meant to run on x86 turn it off.
    weight_sharing: bool = True
    # Per-module precision overrides: (module-path regex, scheme) pairs, first match wins, e.g.
    # (("lm_head", QuantScheme.A16W8),) keeps the output projection at 8-bit weights under a 4-bit scheme.
    overrides: tuple[tuple[str, QuantScheme], ...] = ()
    # Split the decoder layers into this many QNN contexts, compiled one after the other: the compiler then holds
    # one shard's weights at a time (lower peak memory for big models); a phone loads them as separate contexts.
    # None: the fewest shards whose estimated peak fits `max_memory`, at least ExecuTorch's per-shard size
    # (optimum_qnn.exporter.memory.choose_memory_plan). Split balanced by parameters (`ParameterCounts.shard_starts`).
    shards: int | None = None
    # Memory budget of the export in GB (2**30 bytes); None: this machine's available memory less a margin. An export
    # whose estimated peak exceeds it is refused before any weight is read.
    max_memory: float | None = None
    # Quantized schemes: masks, caches and logits cross the graph boundary as uint16 (ExecuTorch's Qualcomm flow
    # does the same); True keeps them float32, quantized inside the graph on every call. Ignored for fp16.
    float_io: bool = False
    # 4-bit schemes: keep the linears whose 4-bit rounding most changes the logits (measured on the calibration
    # text) at 8 bits within this budget (optimum_qnn.quantization.mixed_precision). None: every linear at the scheme's width.
    size_budget: SizeBudget | None = None
    weight_ranges: WeightRanges = WeightRanges.MINMAX
    weight_rounding: WeightRounding = WeightRounding.NEAREST
    # The named recipe these settings came from (`RECIPES`), which names the variant; None: named by the scheme.
    recipe: str | None = None
    # N, W and G of `--mode lookahead` (ExecuTorch's --ngram/--window/--gcap); None in the other modes.
    lookahead: Lookahead | None = None
    # Drafts per round of Gemma 4's assistant (default `DEFAULT_DRAFT_LEN` with --assistant) (`--assistant`, docs/assistant.md): kv_forward then verifies the last
    # accepted token and K drafts in one call of K + 1 tokens. None: no assistant.
    draft_len: int | None = None
    # `--task image-text-to-text`: soft tokens per image (`images.SOFT_TOKEN_BUDGETS`); the vision encoder goes into
    # the program beside the decoder, whose prefill takes an image's soft tokens. None: text generation.
    image_tokens: int | None = None

    def __post_init__(self) -> None:
        # Wrong types from Python callers get the same clear error as wrong values from the command line.
        for name, kind in (("socs", tuple), ("quant", QuantScheme), ("mode", ExportMode), ("shapes", ShapeConfig),
                           ("overrides", tuple)):
            if not isinstance(getattr(self, name), kind):
                raise InvalidInputError(
                    f"ExportConfig.{name} must be a {kind.__name__}; got {type(getattr(self, name)).__name__} "
                    f"{getattr(self, name)!r}"
                    + (" (parse strings with QuantScheme.parse / ExportMode.parse)" if kind in (QuantScheme, ExportMode) else "")
                )
        if not all(isinstance(s, Soc) for s in self.socs):
            raise InvalidInputError(f"ExportConfig.socs must hold Soc members (Soc.parse('SM8650')); got {self.socs!r}")
        if self.embedding_quant is not None and not isinstance(self.embedding_quant, EmbeddingQuant):
            raise InvalidInputError(f"ExportConfig.embedding_quant must be an EmbeddingQuant or None; got {self.embedding_quant!r}")
        if self.shards is not None and (not isinstance(self.shards, int) or isinstance(self.shards, bool) or self.shards < 1):
            raise InvalidInputError(f"shards must be at least 1; got {self.shards} (None lets the exporter choose)")
        if self.max_memory is not None and (
            isinstance(self.max_memory, bool) or not isinstance(self.max_memory, (int, float))
            or not math.isfinite(self.max_memory) or self.max_memory <= 0
        ):
            raise InvalidInputError(f"max_memory must be a positive number of GB, e.g. 16 or 7.5; got {self.max_memory!r}")
        if not self.socs:
            raise InvalidInputError("At least one SoC is required; expected some of: " + _choices(Soc))
        shapes = self.shapes
        self._check_lookahead()
        self._check_images()
        if self.mode.has_prefill and shapes.max_seq_len is not None and shapes.prefill_ar_len >= shapes.max_seq_len:
            raise InvalidInputError(
                f"prefill_ar_len ({shapes.prefill_ar_len}) must be smaller than max_seq_len ({shapes.max_seq_len}): "
                "each call's tokens are appended to a cache of max_seq_len - ar_len slots"
            )
        for entry in self.overrides:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise InvalidInputError(f"Each override must be a (regex, QuantScheme) pair; got {entry!r}")
            pattern, scheme = entry
            if not isinstance(scheme, QuantScheme) or scheme is QuantScheme.FP16:
                raise InvalidInputError(f"Override {pattern!r}: expected a quantized scheme, got {scheme!r}")
            _compile_override(pattern)
        if self.overrides and not self.quant.is_quantized:
            raise InvalidInputError("Quantization overrides need a quantized --quant scheme; fp16 has nothing to override")
        if self.size_budget is not None and (not isinstance(self.size_budget, SizeBudget) or self.quant.weight_bits != 4):
            raise InvalidInputError(
                f"--size-budget keeps the most sensitive linears of a 4-bit export at 8 bits; it needs --quant "
                f"16a4w, 16a4w_block or a 4-bit recipe ({', '.join(RECIPES)}), not {self.quant.value}"
            )
        if not isinstance(self.weight_ranges, WeightRanges):
            raise InvalidInputError(f"ExportConfig.weight_ranges must be a WeightRanges (WeightRanges.parse('output-mse')); got {self.weight_ranges!r}")
        if self.weight_ranges is not WeightRanges.MINMAX and self.quant.weight_bits != 4:
            raise InvalidInputError(f"--weight-ranges {self.weight_ranges.value} chooses 4-bit weight scales; it needs a 4-bit --quant, not {self.quant.value}")
        if not isinstance(self.weight_rounding, WeightRounding):
            raise InvalidInputError(f"ExportConfig.weight_rounding must be a WeightRounding (WeightRounding.parse('gptq')); got {self.weight_rounding!r}")
        if self.weight_rounding is not WeightRounding.NEAREST and self.quant.weight_bits != 4:
            raise InvalidInputError(f"--weight-rounding {self.weight_rounding.value} rounds 4-bit weights; it needs a 4-bit --quant, not {self.quant.value}")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise InvalidInputError(f"Unknown recipe {self.recipe!r}; expected one of: {', '.join(RECIPES)}")
        if self.quant is QuantScheme.A16W4_BLOCK and self.block_size not in BLOCK_SIZES:
            raise InvalidInputError(f"Block size must be one of {BLOCK_SIZES}; got {self.block_size}")
        # What the HTP arch of each target lacks is refused here, before anything is loaded (optimum_qnn.socs).
        features = [self.quant.value, *(scheme.value for _, scheme in self.overrides)]
        for soc in self.socs:
            check_supported(soc, features)

    def _check_images(self) -> None:
        """An image variant's budget is one of Hugging Face's and fits its context, its soft tokens enter through
        prefill, and what is not built for images yet is refused by name."""
        if self.image_tokens is None:
            return
        from optimum_qnn.images import SOFT_TOKEN_BUDGETS

        if self.image_tokens not in SOFT_TOKEN_BUDGETS:
            raise InvalidInputError(f"--image-tokens must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))} (Hugging "
                                    f"Face's budgets); got {self.image_tokens!r}")
        if self.mode is not ExportMode.HYBRID:
            raise InvalidInputError(f"An image's soft tokens enter through the prefill method: --task image-text-to-text "
                                    f"needs --mode hybrid, not --mode {self.mode.value}")
        if self.draft_len is not None:
            raise InvalidInputError("--task image-text-to-text with --assistant is not built yet: drop one of them")
        context = self.shapes.max_seq_len
        if context is not None and self.image_tokens + 3 > context:  # BOS, BOI, the soft tokens, EOI
            raise InvalidInputError(
                f"An image of --image-tokens {self.image_tokens} takes {self.image_tokens + 3} positions with BOS, BOI "
                f"and EOI, more than --max-seq-len {context} holds: raise --max-seq-len or lower --image-tokens"
            )

    def _check_lookahead(self) -> None:
        """`lookahead` is set exactly in lookahead mode, its AR fits the context, and the ring layout is refused."""
        if self.mode is not ExportMode.LOOKAHEAD:
            if self.lookahead is not None:
                raise InvalidInputError(
                    f"--ngram, --window and --gcap shape lookahead decoding; they need --mode lookahead, not --mode "
                    f"{self.mode.value} (add --mode lookahead, or drop them)"
                )
            return
        if not isinstance(self.lookahead, Lookahead):
            raise InvalidInputError(f"--mode lookahead needs ExportConfig.lookahead, a Lookahead(ngram, window, gcap); got {self.lookahead!r}")
        ar, shapes = self.lookahead.ar_len, self.shapes
        if shapes.max_seq_len is not None and ar >= shapes.max_seq_len:  # None: checked once the exporter chose it
            raise InvalidInputError(
                f"Lookahead decoding with --ngram {self.lookahead.ngram} --window {self.lookahead.window} --gcap "
                f"{self.lookahead.gcap} takes {ar} tokens per decode call, not below --max-seq-len {shapes.max_seq_len}: "
                "lower them or raise --max-seq-len"
            )
        if shapes.prefill_ar_len == ar:
            raise InvalidInputError(
                f"--prefill-ar-len {ar} equals the lookahead decode call's {ar} tokens; the two graphs must differ in "
                "length (the prefill graph applies the sliding window by index, the tree's mask by position): choose another --prefill-ar-len"
            )
        if shapes.cache_layout not in (None, CacheLayout.FULL):
            raise InvalidInputError(
                f"--mode lookahead keeps the full cache layout (its tree's mask has no ring form); drop --cache-layout {shapes.cache_layout.value}")

    @property
    def decode_ar_len(self) -> int:
        """Tokens per decode call: 1, a lookahead export's AR, or an assistant's K + 1 (its verify call)."""
        if self.lookahead is not None:
            return self.lookahead.ar_len
        return 1 if self.draft_len is None else self.draft_len + 1

    def check_shards(self, num_layers: int) -> None:
        """A given --shards must leave each shard a decoder layer at least. Where the shards begin is chosen from
        the model's parameters (`optimum_qnn.exporter.parameters.ParameterCounts.shard_starts`)."""
        if self.shards is not None and self.shards > num_layers:
            raise InvalidInputError(f"--shards {self.shards} exceeds the model's {num_layers} decoder layers")

    @property
    def has_plan_stage(self) -> bool:
        """Whether the export plans its 4-bit weights on the float module before calibration: a mixed-precision
        plan, output-MSE ranges and GPTQ rounding do (`ptq._plan_weights`)."""
        return (self.size_budget is not None or self.weight_ranges is WeightRanges.OUTPUT_MSE
                or self.weight_rounding is WeightRounding.GPTQ)

    @property
    def quant_tag(self) -> str:
        """Variant name part for the quant scheme, e.g. `16a4w_block64`, or the recipe's name."""
        if self.recipe is not None:
            return self.recipe
        if self.quant is QuantScheme.A16W4_BLOCK:
            return f"{self.quant.value}{self.block_size}"
        return self.quant.value


def _compile_override(pattern: object) -> re.Pattern:
    """An override's module-path regex, compiled; a bad one is named with the reason, before any work starts."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidInputError(f"An override pattern must be a non-empty regex string; got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InvalidInputError(
            f"--quant-override pattern {pattern!r} is not a valid regular expression ({e}); escape special characters "
            "with a backslash, e.g. 'layers\\.0\\.' or 'lm_head'"
        ) from None


# Named recipes: a scheme plus the options that measured best together (benchmarks/QUANT_NOTES.md). `16a4w_e2b` is the
# 4-bit phone recipe: 4-bit LPBQ weights (block 64), output-MSE weight ranges, and the most logit-sensitive quarter of
# the linear weights (ranked by random-probe sensitivity) at 8 bits. Measured on the demo and benchmark Gemma4s and
# exported at Gemma-4-E2B's full size (QUANT_NOTES.md section 9). GPTQ rounding measured worse on held-out text.
RECIPES: dict[str, dict[str, object]] = {
    "16a4w_e2b": dict(
        quant=QuantScheme.A16W4_BLOCK, block_size=64, size_budget=SizeBudget(share=0.25),
        weight_ranges=WeightRanges.OUTPUT_MSE,
    ),
}


def recipe_fields(name: str) -> dict[str, object]:
    """The ExportConfig fields of a named recipe (`ExportConfig(**recipe_fields("16a4w_e2b"), socs=...)`)."""
    if name not in RECIPES:
        raise InvalidInputError(f"Unknown recipe {name!r}; expected one of: {', '.join(RECIPES)}")
    return {**RECIPES[name], "recipe": name}

"""The memory an export will need, estimated from the model's config alone, before any weight is read.

An export that does not fit is killed by the kernel, at Gemma-4-E2B's size after about 25 minutes. The estimate lets
the exporter choose the fewest lowering shards that fit the memory it has, and not fewer than ExecuTorch's per-shard
size (`choose_memory_plan`), and refuse in a second, with the figure and the fix, when nothing fits.

What it estimates: the anonymous memory of the export (its RSS less file-backed pages, plus the private memory of
its compile workers), the part the kernel cannot take back. The rest of its RSS is file pages it reads through a
mapping and the kernel drops under pressure and reads again: the checkpoint's bf16 matrices (calibration reads
every one), the quantized embedding tables and, from the quantize stage on, the quantized HTP weights (both moved
to a file mapping on the output's file system: `weights.map_to_file`), and the .pte being inspected. Measured on
the full-size Gemma-4-E4B in a 16 GB memory cgroup (ac3395b): the calibrate stage's RSS reached 14.2 GB with 5.1 GB
anonymous, and the export completed with the cgroup at its limit, the kernel reclaiming page cache. A budget is
compared with this estimate; the margin it is taken with (10 %, at least 1 GB) leaves room for the file pages a
stage is using at the moment (one layer's bf16 weights, one shard's quantized weights).

How it is computed: the parameters of each part of the model (token table, per-layer embedding table, decoder
layers) are counted on a meta-device model built from the config (no weights), and each stage's peak is a linear
function of their stored bytes, fitted to exports measured on this project's 2-core, 24 GB machine with the current
pipeline (bf16 weights kept in the checkpoint's pages and handed back as each is quantized,
`optimum_qnn.quantization.weights`; block weights quantized in row chunks, once for both graphs; tables and
quantized weights in file mappings; shard compiles in worker processes, whose private memory the lowering's figure
includes; the program streamed to a file, and inspected through a mapping), all in benchmarks/memory_rows.json:

- the demo Gemma4 (examples/tiny_gemma4.py, 16a8w, hybrid, context 128): the load stage is the process with torch,
  transformers and ExecuTorch imported (`_BASE`); the lowering stage is that plus the QNN libraries and compiler on
  a graph of negligible size (`_LOWER_BASE`);
- Gemma-4-E2B widths at 2 and 7 layers in one shard per layer (benchmarks/e2b_width.py), the full-size Gemma-4-E2B
  (benchmarks/e2b_full.py, the published multimodal checkpoint) in 3, 4 and 7 shards, and the full-size Gemma-4-E4B
  (the same, `--model e4b`) in 7: 16a4w_block, hybrid, context 1024, prefill 128, 4-bit symmetric tables. The 7- and
  3-shard E2B rows and the E4B row are what the exporter chose with no memory flags in a 16 GB memory cgroup, each
  with the fit of the rows before it.

Per stage, peak = `_BASE` + a x (token table GB at the stored dtype) + b x (everything else, GB stored), least
squares through the E2B and E4B rows (benchmarks/memory_fit.py; the token table's coefficient carries the fixed costs of
a 262144-word vocabulary, the lm_head's quantization and vocabulary-wide logits, and varies with the hidden width only
between the E2B and E4B rows). The
lowering stage is `_LOWER_BASE` + a resident term + what the QNN compilers hold for the shards they compile,
`_SHARD_BYTES_PER_PARAM` bytes per parameter of the largest shard (the last shard carries the lm_head; the rows split
the layers evenly, `starts` in each row). That is what the lowering needs, one compile at a time; the compile
workers run two side by side only while the budget has room for both (`parallel_compile`), so with balanced shards
the measured peak may exceed this estimate, within the budget. The fit
reproduces every one of these figures within `FIT_MAX_ERROR_GB`, and underestimates none by more than
`FIT_ERROR_GB`, the margin the shard count is chosen with (tests/test_memory.py asserts both). A single shard
compiles in the exporter's own process, and the stages after it keep what the compiler took (measured on an earlier
pipeline). Before the E4B row joined, the fit of the rows before it estimated E4B's lowering at 13.4 GB and its
quantize stage at 7.2 (measured 13.7 and 8.1); before the 3-shard E2B row joined, its lowering at 12.5 (measured
13.0; benchmarks/RESULTS.md): the rows reach other widths and larger shards only by extrapolation, and each new
measured export joins them.

What the rows did not vary is computed, not measured: weights wider than 4 bits add their extra bytes per HTP
parameter, float or 8-bit embedding tables theirs, and `--evaluate` keeps the float32 Hugging Face model resident.
The context is counted where it shows (`cache_bytes`, from the runner contract the config makes): the methods'
example inputs, whose zero KV caches are float32 and the context's size, are held from the export to the lowering's
re-export (Gemma-4-E4B at 32768: 2.1 GB); and a shard's compile grows with the cache inputs its graphs take, by
`_COMPILE_BYTES_PER_CACHE_BYTE` per byte. Before c70592c the example inputs were held twice and to the end of the
export: Gemma-4-E4B at 32768 in the 16 GB cgroup, estimated at 9.4 GB with the context left out, was killed for
memory in its last shard's compile (benchmarks/contexts.json). The prefill length is taken as measured (128). When
nothing fits, the refusal names the largest power-of-two context that does. Every figure this module returns is an
estimate; every message that shows one says so. GB here is 2**30 bytes, as in the exporter's stage table.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.config import EmbeddingQuant, ExportConfig, QuantScheme, WeightRanges, WeightRounding
from optimum_qnn.contract import CacheLayout
from optimum_qnn.errors import InvalidInputError
# The host's memory is core (the runtime reads it too); its names stay importable from here.
from optimum_qnn.host_memory import (  # noqa: F401
    GB_BYTES,
    MARGIN_FRACTION,
    MIN_MARGIN_GB,
    CgroupFiles,
    available_memory,
    default_budget_gib,
    parse_max_memory,
)
from optimum_qnn.exporter.parameters import (
    ParameterCounts,
    HTP_CONTEXT_LIMIT_GB,
    SHARD_PARAMS,
    check_loadable,
    fewest_loadable_shards,
    fewest_shards_per_call,
)


# The fit described in the module docstring (GB of anonymous memory; coefficients in GB per GB of stored weights).
_BASE = 0.28  # the demo row's load stage: 285 MiB anonymous (443 MiB RSS)
_LOWER_BASE = 0.63  # the demo row's lower stage: 642 MiB anonymous (872 MiB RSS)
# stage: (per GB of token table, per GB of the rest), both at the stored dtype; least squares over the E2B rows of
# benchmarks/memory_rows.json (benchmarks/memory_fit.py)
_STAGE_FIT = {
    "load": (0.0, 0.0),  # the checkpoint is mapped, not read: the base process
    "swap": (0.741, 0.134),
    "export": (0.229, 0.007),
    "calibrate": (2.635, 0.129),
    "quantize": (1.148, 0.466),
    "lower": (0.0, 0.0),  # computed below from `_LOWER_RESIDENT` and `_SHARD_BYTES_PER_PARAM`
    "inspect": (0.968, 0.458),
    "write": (0.943, 0.351),
}
# The lowering: resident state (what the passes and the context binaries compiled so far hold; the weights are in a
# file mapping) per GB of stored weights, plus the compilers' working set per parameter of the largest shard; fitted
# the same way above `_LOWER_BASE`.
_LOWER_RESIDENT = 0.108
_SHARD_BYTES_PER_PARAM = 10.101
# The measured rows quantized HTP weights to 4 bits and the embedding tables to 4 bits, symmetric, groups of 32.
_MEASURED_WEIGHT_BITS = 4
_MEASURED_TABLE_BYTES = 4 / 8 + 2 / 32  # 4-bit symmetric in groups of 32, an fp16 scale per group
# The shard count is chosen with this much room under the budget: the fit's largest underestimate of a measured stage
# (benchmarks/memory_fit.py: 0.50 GB, Gemma-4-E4B's quantize stage).
FIT_ERROR_GB = 0.5  # the largest underestimate of a measured stage, rounded up: the margin a shard choice keeps
FIT_MAX_ERROR_GB = 0.5  # the largest error either way (an overestimate only costs a shard more)
# What the context adds to a shard's compile, per byte of the KV cache inputs its graphs take (its own layers' caches
# and the earlier shards' caches its KV-reusing layers join, every method): the one measured shard the per-parameter
# figure underestimated, Gemma-4-E2B at 32768 (blocks layout, 4 shards; benchmarks/contexts.json, the compile log):
# shard 1's worker grew 6882 MiB where its 646 M parameters give 6224, with 395 MiB of uint16 cache inputs, 1.67 per
# byte, rounded up. Gemma-4-E4B at 8192 and 32768 (7 shards) stayed under the per-parameter figure in every shard.
_COMPILE_BYTES_PER_CACHE_BYTE = 1.7




@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak RSS per stage, in GB, of one export configuration (a fit, not a measurement)."""

    stages: dict[str, float]
    shards: int
    starts: tuple[int, ...] = ()  # the decoder layers that begin shards 2..N

    @property
    def peak(self) -> float:
        return max(self.stages.values())

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stages.get)

    @property
    def lowering(self) -> float:
        return self.stages["lower"]


def estimate(counts: ParameterCounts, config: ExportConfig, shards: int, *, evaluate: bool = False,
             starts: tuple[int, ...] | None = None) -> MemoryEstimate:
    """Estimated per-stage peak RSS (GB) of exporting a model of these parameter counts in ``shards`` shards, split
    where ``starts`` says (by default `ParameterCounts.shard_starts`, as the exporter splits)."""
    stored = counts.stored_bytes / GB_BYTES
    table, rest = counts.token_table * stored, (counts.total - counts.token_table) * stored
    quantized = config.quant.is_quantized
    # What the rows did not vary, computed from the widths (bytes per parameter beyond the measured 4-bit ones).
    weight_extra = _weight_extra_bytes(counts, config)
    # Unresolved (None): what `EmbeddingQuant.default_for` picks, 4-bit when quantized, else float; float is stored.
    tables = config.embedding_quant or (EmbeddingQuant(4, 32) if quantized else EmbeddingQuant(0, 0))
    table_extra = counts.tables * max(0.0, _table_bytes_per_param(tables) - _MEASURED_TABLE_BYTES) / GB_BYTES
    float_model = counts.total * 4 / GB_BYTES if evaluate else 0.0  # the float32 Hugging Face model kept for --evaluate
    starts = counts.shard_starts(shards) if starts is None else starts
    examples, shard_caches = cache_bytes(counts, config, starts)
    shard = (counts.largest_shard(starts) * (_SHARD_BYTES_PER_PARAM + weight_extra)
             + _COMPILE_BYTES_PER_CACHE_BYTE * max(shard_caches, default=0)) / GB_BYTES
    stages = {}
    for name, (a, b) in _STAGE_FIT.items():
        if not quantized and name in ("calibrate", "quantize"):
            continue
        held = 0.0 if name == "load" else table_extra + float_model  # the load holds the stored tables, as measured
        if name in ("quantize", "lower", "inspect", "write"):
            held += counts.htp * weight_extra / GB_BYTES
        if name == "lower":
            stages[name] = _LOWER_BASE + _LOWER_RESIDENT * (table + rest) + shard + held
            continue
        if name in ("export", "calibrate", "quantize"):
            held += examples / GB_BYTES  # the methods' example inputs, let go when the lowering re-exported them
        stages[name] = _BASE + a * table + b * rest + held
        if shards == 1 and name in ("inspect", "write"):
            # One shard compiles in this process (no worker), and what the compiler took stays with it (measured on
            # an earlier pipeline: 7 layers in one shard wrote at 6.84 GB, in seven at 5.31).
            stages[name] += shard
    if config.has_plan_stage:
        # Before calibration, on the float module: the calibrate stage's working set is an upper bound of the
        # forward passes; GPTQ's Hessians are held until the 4-bit weights are rounded.
        stages = {"plan": stages["calibrate"] + plan_gib(counts, config), **stages}
        stages["calibrate"] += hessian_gib(counts) if config.weight_rounding is WeightRounding.GPTQ else 0.0
    return MemoryEstimate({k: round(v, 2) for k, v in stages.items()}, shards, starts)


def cache_bytes(counts: ParameterCounts, config: ExportConfig, starts: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """What the KV caches weigh at this export's context, from the config: the bytes of the methods' example inputs'
    caches (float32 zeros, summed over the methods), and per shard the bytes of the cache inputs its graphs take (its
    layers' own caches and those its KV-reusing layers read from an earlier shard, at the graphs' IO element size,
    summed over the methods). (0, ()) when the context is not resolved or the layers are unknown: the fit's rows
    (context 1024) then stand for it."""
    context = config.shapes.max_seq_len
    if context is None or not counts.cache_layers:
        return 0, ()
    from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, RunnerContract
    from optimum_qnn.exporter.htp_limits import call_lengths, integer_io_bytes

    ar_lens = dict(zip((DECODE_METHOD, PREFILL_METHOD), call_lengths(config)))
    try:
        contract = RunnerContract.build(counts.cache_layers, vocab_size=counts.vocab_size or 1, context_len=context,
                                        ar_lens=ar_lens, sliding_window=counts.sliding_window,
                                        cache_layout=config.shapes.cache_layout or CacheLayout.FULL,
                                        block_len=config.shapes.cache_block_len)
    except ValueError:  # a layout that cannot be built: the preflight refuses it with its reason
        return 0, ()
    layers = counts.cache_layers
    per_layer = {}  # cache-owning layer -> its cache inputs' elements, summed over the methods
    for layer in layers:
        if layer.owns_cache:
            names = {n for m in contract.methods for kind in ("k", "v") for n in contract.cache_input_names(kind, layer, m.name)}
            per_layer[layer.index] = sum(math.prod(t.shape) for m in contract.methods for t in m.inputs if t.name in names)
    io_element = integer_io_bytes(config) or 4
    bounds = (0, *starts, len(layers))
    shards = tuple(
        sum(per_layer[source] for source in {l.kv_source for l in layers[lo:hi]}) * io_element
        for lo, hi in zip(bounds, bounds[1:])
    )
    return sum(per_layer.values()) * 4, shards


def _weight_extra_bytes(counts: ParameterCounts, config: ExportConfig) -> float:
    """Bytes per HTP parameter beyond the measured 4-bit ones: a wider scheme's, and the 8-bit linears a size budget
    keeps (its share of the parameters, or as many as its gigabytes hold; measured on Gemma-4-E4B with the
    `16a4w_e2b` recipe, whose quarter at 8 bits the estimate had left out: lowering 17.6 GB, estimated 17.1 without
    it and 17.9 with it)."""
    extra = max(0, config.quant.weight_bits - _MEASURED_WEIGHT_BITS) / 8
    budget = config.size_budget
    if budget is not None and config.quant.weight_bits < 8:
        wider = (8 - config.quant.weight_bits) / 8
        if budget.share is not None:
            extra += budget.share * wider
        else:
            extra += min(wider, max(0.0, budget.gigabytes * GB_BYTES / counts.htp - config.quant.weight_bits / 8))
    return extra


def hessian_gib(counts: ParameterCounts) -> float:
    """GB of the float64 input Hessians that GPTQ rounding holds (every linear's, at most)."""
    return counts.hessian_elements * 8 / GB_BYTES


def plan_gib(counts: ParameterCounts, config: ExportConfig) -> float:
    """GB the plan holds beyond a forward pass, one step after the other: the sensitivity probes (each linear's
    4-bit output change and its gradient, float32, plus about as much again for the activations autograd keeps), then
    the output-MSE search's input rows (float32), then GPTQ's Hessians. At most PLAN_SAMPLES x PLAN_SAMPLE_TOKENS
    tokens (`ptq`), counted in full."""
    from optimum_qnn.quantization.ptq import PLAN_SAMPLE_TOKENS, PLAN_SAMPLES

    tokens = PLAN_SAMPLES * PLAN_SAMPLE_TOKENS
    probes = 3 * tokens * counts.linear_outputs * 4 / GB_BYTES if config.size_budget is not None else 0.0
    rows = tokens * counts.linear_inputs * 4 / GB_BYTES if config.weight_ranges is WeightRanges.OUTPUT_MSE else 0.0
    hessians = hessian_gib(counts) if config.weight_rounding is WeightRounding.GPTQ else 0.0
    return max(probes, rows, hessians)


def _table_bytes_per_param(quant: EmbeddingQuant) -> float:
    """Bytes per embedding table parameter once quantized: the values, and per group an fp16 scale (symmetric) or
    float32 scale and zero point; a float table is held in float32 (the lookups' output dtype)."""
    if not quant.bits:
        return 4.0
    group = quant.group_size or 256  # one group per row: at least as wide as the narrowest E2B-like table
    return quant.bits / 8 + (2 if quant.symmetric else 8) / group


@dataclass(frozen=True)
class MemoryPlan:
    """The shard count chosen for the lowering and what the export is estimated to need with it."""

    estimate: MemoryEstimate
    budget_gib: float | None
    budget_source: str  # "--max-memory", "MemAvailable ... less margin", "cgroup memory limit ... less margin", or "unknown"
    auto: bool
    loadable_floor: int = 1  # the fewest shards the HTP can load (`fewest_loadable_shards`)
    call_floor: int = 1  # the fewest that keep each HTP call within ExecuTorch's per-shard size (`fewest_shards_per_call`)

    def summary(self) -> str:
        """The one line the exporter prints."""
        est = self.estimate
        chosen = "chosen for" if self.auto else "given;"
        budget = f"budget {self.budget_gib:.1f} GB ({self.budget_source})" if self.budget_gib is not None else "no budget known"
        if self.auto and self.loadable_floor > 1:
            budget += f" and the HTP's {HTP_CONTEXT_LIMIT_GB:.0f} GB context (at least {self.loadable_floor})"
        if self.auto and self.call_floor > max(1, self.loadable_floor):
            budget += f", at least {self.call_floor} for ExecuTorch's per-shard size ({SHARD_PARAMS / 1e6:.0f} M parameters)"
        return (f"Memory: {est.shards} shard(s) {chosen} {budget}; estimated peak {est.peak:.1f} GB ({est.peak_stage}), "
                f"lowering {est.lowering:.1f} GB (anonymous memory, which the kernel cannot reclaim; an estimate "
                "fitted to measured exports, not a measurement)")


def choose_memory_plan(counts: ParameterCounts, config: ExportConfig, *, evaluate: bool = False,
                       meminfo: Path = Path("/proc/meminfo"), cgroups: CgroupFiles | None = None) -> MemoryPlan:
    """The fewest shards whose estimated peak fits the budget, whose contexts the HTP can load
    (`fewest_loadable_shards`) and whose HTP calls stay within ExecuTorch's per-shard size (`fewest_shards_per_call`);
    ``config.shards`` when the user gave one. An `InvalidInputError` with the estimate and the fix when the export
    cannot fit or would not load.

    Fewest, because every shard is one more HTP graph call per token on the phone; not fewer than ExecuTorch's
    per-shard size, because one call over about 10 ms costs more (STOCK_RUNNER.md). The balanced shards this gives
    are also what compiles side by side: at Gemma-4-E2B's size, 4 shards of 536-586 M parameters where 3 even ones
    left the lm_head's 1186 M to compile alone."""
    if config.max_memory is not None:
        budget, source = config.max_memory, "--max-memory"
    else:
        available, source = available_memory(meminfo, cgroups)
        budget = default_budget_gib(available)
        source = f"{source} less margin" if available is not None else source
    num_layers = len(counts.layers)
    floor = fewest_loadable_shards(counts, config)
    if config.shards is not None:
        check_loadable(counts, config, config.shards, floor)
        plan = MemoryPlan(estimate(counts, config, config.shards, evaluate=evaluate), budget, source, auto=False)
    else:
        per_call = fewest_shards_per_call(counts)
        least = max(floor, per_call)
        candidates = [estimate(counts, config, n, evaluate=evaluate) for n in range(least, num_layers + 1)]
        # The whole export's peak, not the lowering's alone: with one shard the compile runs in this process, and
        # the stages after it keep what the compiler took.
        fitting = ([c for c in candidates if budget is None or c.peak + FIT_ERROR_GB <= budget]
                   or [c for c in candidates if c.peak <= budget])
        # Nothing fits: the lowest estimate (the fewest shards among equals), for the refusal to quote.
        best = fitting[0] if fitting else min(candidates, key=lambda c: (c.peak, c.shards))
        plan = MemoryPlan(best, budget, source, auto=True, loadable_floor=floor, call_floor=per_call)
    if budget is not None and plan.estimate.peak > budget:
        raise InvalidInputError(_refusal(plan, counts, config, evaluate, num_layers))
    return plan


def _refusal(plan: MemoryPlan, counts: ParameterCounts, config: ExportConfig, evaluate: bool, num_layers: int) -> str:
    est = plan.estimate
    stages = ", ".join(f"{k} {v:.1f}" for k, v in est.stages.items())
    fixes = [f"run on a machine with more free memory, or raise the budget with --max-memory (at least "
             f"{math.ceil(est.peak * 10) / 10:.1f} GB, if the machine has it)"]
    if not plan.auto and estimate(counts, config, num_layers, evaluate=evaluate).peak < est.peak - 0.05:
        fixes.append("leave --shards out to let the exporter choose, or give more shards (fewer layers per QNN compile)")
    # The flags that lower the estimate, each with the peak it would leave: at the shard count given, or else at one
    # shard per layer (the lowest).
    shards = est.shards if not plan.auto else num_layers
    alternatives = []
    if config.quant.weight_bits > 4:
        alternatives.append(("--quant 16a4w_block", dataclasses.replace(config, quant=QuantScheme.A16W4_BLOCK), evaluate))
    if config.embedding_quant is None or config.embedding_quant.bits != 4:
        alternatives.append(("--embedding-quant 4,0 (4-bit tables, one group per row)",
                             dataclasses.replace(config, embedding_quant=EmbeddingQuant(4, 0)), evaluate))
    if evaluate:
        alternatives.append(("dropping --evaluate (it keeps the float32 model resident)", config, False))
    if config.weight_rounding is WeightRounding.GPTQ:
        alternatives.append((
            f"--weight-rounding nearest (GPTQ holds every 4-bit linear's input Hessian, {hessian_gib(counts):.1f} GB "
            "at this model's widths)",
            dataclasses.replace(config, weight_rounding=WeightRounding.NEAREST), evaluate))
    if config.size_budget is not None or config.weight_ranges is WeightRanges.OUTPUT_MSE:
        plain = dataclasses.replace(config, recipe=None, size_budget=None, weight_ranges=WeightRanges.MINMAX,
                                    weight_rounding=WeightRounding.NEAREST)
        alternatives.append((f"--quant {config.quant.value} with no plan (no sensitivity probes, min-max ranges)",
                             plain, evaluate))
    for flag, variant, evaluates in alternatives:
        peak = estimate(counts, variant, shards, evaluate=evaluates).peak
        if peak < est.peak - 0.05:
            fixes.append(f"{flag}: estimated peak {peak:.1f} GB")
    shorter = _shorter_context(counts, config, shards, evaluate, plan.budget_gib)
    if shorter is not None:
        fixes.append(f"--max-seq-len {shorter[0]} (the caches' share of the estimate shrinks with the context): "
                     f"estimated peak {shorter[1]:.1f} GB")
    if len(fixes) == 1:
        fixes.append("no flag of this exporter lowers this estimate")
    return (f"This export needs an estimated {est.peak:.1f} GB at its peak ({est.peak_stage} stage, {est.shards} "
            f"shard(s)), more than the budget of {plan.budget_gib:.1f} GB ({plan.budget_source}); it would be killed "
            f"for memory, so it stops before loading any weight. Estimated per-stage peaks in GB (fitted to measured "
            f"exports, {_count(counts.total)} parameters): {stages}. To fix: " + "; ".join(fixes))


def _shorter_context(counts: ParameterCounts, config: ExportConfig, shards: int, evaluate: bool,
                     budget: float) -> tuple[int, float] | None:
    """The largest power-of-two context below this export's (1024 at least) whose estimate fits ``budget``, with its
    peak; None when the context is not what it takes. The blocks layout is kept while the context is longer than a
    block, the full layout taken below."""
    shapes = config.shapes
    if shapes.max_seq_len is None or not counts.cache_layers:
        return None
    context = 1 << (shapes.max_seq_len - 1).bit_length() - 1  # the power of two below
    while context >= 1024 and context > shapes.prefill_ar_len:
        layout, block = shapes.cache_layout, shapes.cache_block_len
        if block is not None and block >= context - shapes.prefill_ar_len:
            layout, block = CacheLayout.FULL, None
        shorter = dataclasses.replace(config, shapes=dataclasses.replace(
            shapes, max_seq_len=context, cache_layout=layout, cache_block_len=block))
        peak = estimate(counts, shorter, shards, evaluate=evaluate).peak
        if peak <= budget:  # what `choose_memory_plan` takes when no shard count leaves its margin
            return context, peak
        context //= 2
    return None


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"

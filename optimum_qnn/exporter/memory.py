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
Context length and prefill length are taken as measured (1024 and 128). Every figure this module returns is an
estimate; every message that shows one says so. GB here is 2**30 bytes, as in the exporter's stage table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.config import EmbeddingQuant, ExportConfig, QuantScheme, WeightRanges, WeightRounding
from optimum_qnn.errors import InvalidInputError

GB_BYTES = 2**30

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
# Held back from MemAvailable when the user gives no --max-memory: other processes grow, and the estimate is a fit.
MARGIN_FRACTION, MIN_MARGIN_GB = 0.10, 1.0
# The shard count is chosen with this much room under the budget: the fit's largest underestimate of a measured stage
# (benchmarks/memory_fit.py: 0.50 GB, Gemma-4-E4B's quantize stage).
FIT_ERROR_GB = 0.5  # the largest underestimate of a measured stage, rounded up: the margin a shard choice keeps
FIT_MAX_ERROR_GB = 0.5  # the largest error either way (an overestimate only costs a shard more)

_STORED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

# The HTP loads a context of at most 4 GB: its weights, activations and spill-fill buffers. ExecuTorch's Qualcomm LLM
# README ("Memory Limit Errors (4 GB HTP Limit)", examples/qualcomm/oss_scripts/llama) shows a context whose size
# estimate was 4025634048 bytes failing to load ("Failed to find available PD ... context create from binary
# failed") and gives more shards as the fix. One shard's weights are kept within 3 GB, a GB left for the rest.
HTP_CONTEXT_LIMIT_GB = 4.0
HTP_CONTEXT_WEIGHTS_GB = 3.0
# The parameters of one shard when the exporter chooses the count: ExecuTorch's own Gemma-4-E2B build splits its
# 2.28 B HTP parameters in 4 (`Gemma4_E2B.num_sharding` in examples/qualcomm/oss_scripts/llama), 570 M a shard, each
# one HTP call per token; its developers keep a call under about 10 ms (pytorch/executorch#7466, STOCK_RUNNER.md).
# Rounded up to 600 M: at E2B's widths, 4 balanced shards of at most 586 M.
SHARD_PARAMS = 600_000_000


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters per part of a Gemma4 text model, counted from its config on the meta device (no weights)."""

    token_table: int
    per_layer_table: int
    layers: tuple[int, ...]  # per decoder layer
    other: int  # norms, the per-layer input projection, an untied lm_head
    stored_bytes: int  # bytes per parameter in the checkpoint (bf16: 2)
    # Sum over the HTP linears of in_features squared: the elements of their input Hessians (`X^T X`), which GPTQ
    # rounding gathers for every 4-bit linear at once (float64).
    hessian_elements: int = 0
    linears: int = 0  # HTP linears
    linear_inputs: int = 0  # sum of their in_features: the plan's input rows for output-MSE ranges hold these
    linear_outputs: int = 0  # sum of their out_features: the sensitivity probes hold outputs of these widths

    @classmethod
    def from_config(cls, text_config) -> "ParameterCounts":
        import torch
        from transformers import Gemma4ForCausalLM

        with torch.device("meta"):
            model = Gemma4ForCausalLM(text_config)
        token = per_layer = other = 0
        linears = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
        in_features = [mod.in_features for mod in linears]
        layers = [0] * text_config.num_hidden_layers
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue  # a tied lm_head is the token table
            seen.add(id(p))
            if "embed_tokens_per_layer" in name:
                per_layer += p.numel()
            elif "embed_tokens" in name:
                token += p.numel()
            elif ".layers." in name:
                layers[int(name.split(".layers.")[1].split(".")[0])] += p.numel()
            else:
                other += p.numel()
        dtype = str(getattr(text_config, "dtype", None) or "bfloat16").removeprefix("torch.")
        return cls(token, per_layer, tuple(layers), other, _STORED_BYTES.get(dtype, 2),
                   sum(n * n for n in in_features), len(in_features), sum(in_features),
                   sum(mod.out_features for mod in linears))

    def as_dict(self) -> dict[str, int]:
        return {"token_table": self.token_table, "per_layer_table": self.per_layer_table, "layers": sum(self.layers),
                "other": self.other}

    @property
    def total(self) -> int:
        return self.token_table + self.per_layer_table + sum(self.layers) + self.other

    @property
    def tables(self) -> int:
        return self.token_table + self.per_layer_table

    @property
    def htp(self) -> int:
        """Parameters compiled into the HTP graph: the decoder layers, the rest, and the lm_head (vocab x hidden)."""
        return sum(self.layers) + self.other + self.token_table

    def shard_sizes(self, shard_starts: tuple[int, ...]) -> list[int]:
        """Parameters of each shard, compiled into one HTP context each: the layers between shard starts, the first
        with the per-layer input projection, the last with the lm_head."""
        bounds = (0, *shard_starts, len(self.layers))
        sizes = [sum(self.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        sizes[0] += self.other
        sizes[-1] += self.token_table
        return sizes

    def largest_shard(self, shard_starts: tuple[int, ...]) -> int:
        """Parameters of the largest shard the QNN compiler holds at once (`shard_sizes`)."""
        return max(self.shard_sizes(shard_starts))

    def shard_starts(self, shards: int) -> tuple[int, ...]:
        """The decoder layers that begin shards 2..N of ``shards``, chosen so that the largest shard is as small as
        contiguous layers allow, and the others about as even as that leaves them.

        Even layer counts are not even work: the lm_head (vocabulary x hidden) rides in the last shard, and the KV-
        sharing layers of E2B and E4B have double-wide MLPs. At Gemma-4-E2B's widths, 35 layers in 3 even groups
        gave shards of 462, 632 and 1186 M parameters; the last one's compile took 8.5 GB and 180 s alone, and its
        HTP call on the phone reads more than half of a token's weights (tests/test_memory.py has the balanced sizes)."""
        n = len(self.layers)
        if not 1 <= shards <= n:
            raise InvalidInputError(f"--shards {shards} must be between 1 and the model's {n} decoder layers")
        end = _balanced_splits(self.layers, self.other, self.token_table)
        starts, i = [], 0
        for k in range(shards, 1, -1):
            i = end[k][i]
            starts.append(i)
        return tuple(starts)


@functools.lru_cache(maxsize=8)
def _balanced_splits(layers: tuple[int, ...], first: int, last: int) -> list[list[int]]:
    """end[k][i]: where the first of k shards made of layers i.. ends, in the split `ParameterCounts.shard_starts`
    takes, for every k (one table: the plan weighs every shard count). ``first`` and ``last``: parameters the first
    and the last shard carry beyond their layers."""
    n = len(layers)
    prefix = [0]
    for layer in layers:
        prefix.append(prefix[-1] + layer)

    def size(i: int, j: int) -> int:  # the shard of layers i..j-1
        return prefix[j] - prefix[i] + (first if i == 0 else 0) + (last if j == n else 0)

    # best[k][i]: (the largest shard, the sum of the shards' squares) of the split of layers i.. into k shards kept,
    # compared largest first. The largest is the smallest any split has (exact); the squares then even out the
    # others (a heuristic: one split is kept per suffix). By the largest alone, 7 E2B shards could split as 462, 440,
    # 452, 325, 64, 64 and 473 M; with the squares, 274, 260, 298, 325, 325, 325 and 473.
    best = [[(math.inf, math.inf)] * (n + 1) for _ in range(n + 1)]
    end = [[n] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        best[1][i] = (size(i, n), size(i, n) ** 2)
    for k in range(2, n + 1):
        for i in range(n - k + 1):
            for j in range(i + 1, n - k + 2):
                largest, squares = best[k - 1][j]
                cost = (max(size(i, j), largest), size(i, j) ** 2 + squares)
                if cost <= best[k][i]:
                    best[k][i], end[k][i] = cost, j
    return end


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
    shard = counts.largest_shard(starts) * (_SHARD_BYTES_PER_PARAM + weight_extra) / GB_BYTES
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


def htp_weight_bytes(config: ExportConfig) -> float:
    """Bytes per HTP weight at most: the scheme's width, or an override's wider one, or 8 bits where a size budget
    may keep a linear at 8."""
    bits = [config.quant.weight_bits] + [scheme.weight_bits for _, scheme in config.overrides or ()]
    if config.size_budget is not None:
        bits.append(8)
    return max(bits) / 8


def shard_weights_gb(counts: ParameterCounts, config: ExportConfig, shards: int) -> float:
    """GB of weights in the largest of ``shards`` HTP contexts (an upper bound: `htp_weight_bytes`)."""
    return counts.largest_shard(counts.shard_starts(shards)) * htp_weight_bytes(config) / GB_BYTES


def fewest_loadable_shards(counts: ParameterCounts, config: ExportConfig) -> int:
    """The fewest shards whose every context keeps its weights within `HTP_CONTEXT_WEIGHTS_GB`: fewer would build a
    .pte the HTP cannot load."""
    layers = len(counts.layers)
    return next((n for n in range(1, layers + 1) if shard_weights_gb(counts, config, n) <= HTP_CONTEXT_WEIGHTS_GB),
                layers)


def fewest_shards_per_call(counts: ParameterCounts) -> int:
    """The fewest shards that keep each within `SHARD_PARAMS`, or that make the largest as small as any count makes
    it (a shard holds at least one layer: the lm_head's shard never gets smaller than the lm_head and a layer)."""
    layers = len(counts.layers)
    target = max(SHARD_PARAMS, counts.largest_shard(counts.shard_starts(layers)))
    return next(n for n in range(1, layers + 1) if counts.largest_shard(counts.shard_starts(n)) <= target)


def _check_loadable(counts: ParameterCounts, config: ExportConfig, shards: int, floor: int) -> None:
    if shards >= floor:
        return
    raise InvalidInputError(
        f"--shards {shards} puts up to {shard_weights_gb(counts, config, shards):.1f} GB of weights "
        f"({config.quant.value}) in one HTP context, and the HTP loads a context of at most "
        f"{HTP_CONTEXT_LIMIT_GB:.0f} GB with its activations and buffers: the .pte would not load on the device. "
        f"Give --shards {floor} or more, or leave --shards out to let the exporter choose"
    )


@dataclass(frozen=True)
class CgroupFiles:
    """Where this process's control groups are described (`/proc/self/cgroup`) and mounted."""

    membership: Path = Path("/proc/self/cgroup")
    root: Path = Path("/sys/fs/cgroup")


def _table_bytes_per_param(quant: EmbeddingQuant) -> float:
    """Bytes per embedding table parameter once quantized: the values, and per group an fp16 scale (symmetric) or
    float32 scale and zero point; a float table is held in float32 (the lookups' output dtype)."""
    if not quant.bits:
        return 4.0
    group = quant.group_size or 256  # one group per row: at least as wide as the narrowest E2B-like table
    return quant.bits / 8 + (2 if quant.symmetric else 8) / group


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroups: CgroupFiles | None = None) -> tuple[float | None, str]:
    """The memory this process can still take, in GB, and what limits it: the machine's MemAvailable, or the
    memory limit of a control group it runs in (a container, a systemd slice, a CI job) when that leaves less.
    (None, "unknown") where neither is reported."""
    machine = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                machine = int(line.split()[1]) * 1024 / GB_BYTES
                break
    except (OSError, ValueError, IndexError):
        pass
    group = _cgroup_headroom(cgroups or CgroupFiles())
    if group is not None and (machine is None or group < machine):
        return group, f"cgroup memory limit, {group:.1f} GB free"
    return machine, "unknown" if machine is None else f"MemAvailable {machine:.1f} GB"


def _cgroup_headroom(files: CgroupFiles) -> float | None:
    """The smallest headroom over the memory cgroups this process belongs to and their ancestors, in GB; None
    without a limit. Headroom: the limit less the usage, plus the group's clean file cache (active and inactive),
    which the kernel reclaims before it kills, as MemAvailable counts a machine's page cache. Counting the inactive
    part alone, the compile gate of a full-size Gemma-4-E2B lowering in a 16 GB cgroup (--shards 4) saw 4020 MiB
    where the budget left 8035, and compiled the lm_head's shard alone for 159 s: the export's own file mappings (the
    quantized weights, the tables) and the checkpoint it read stay on the active list while they are in use."""
    try:
        membership = files.membership.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in membership:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2 (unified hierarchy), mounted at the root or under "unified"
            base = files.root if (files.root / "cgroup.controllers").exists() else files.root / "unified"
            limit_name, usage_name = "memory.max", "memory.current"
            cache_names, unclean_names = ("active_file", "inactive_file"), ("file_dirty", "file_writeback")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = files.root / "memory"
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache_names, unclean_names = ("total_active_file", "total_inactive_file"), ("total_dirty", "total_writeback")
        else:
            continue
        folder = base / path.strip().lstrip("/")
        while True:
            try:
                limit = (folder / limit_name).read_text().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 says "no limit" with a huge number
                    usage = int((folder / usage_name).read_text())
                    stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
                    cache = sum(int(stat.get(name, 0)) for name in cache_names)
                    clean = max(0, cache - sum(int(stat.get(name, 0)) for name in unclean_names))
                    headrooms.append((int(limit) - usage + clean) / GB_BYTES)
            except (OSError, ValueError):
                pass
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return max(0.0, min(headrooms)) if headrooms else None


def default_budget_gib(available: float | None) -> float | None:
    """The budget when the user sets none: what is available, less a margin (10 %, at least 1 GB)."""
    if available is None:
        return None
    return max(0.0, available - max(MIN_MARGIN_GB, MARGIN_FRACTION * available))


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
        _check_loadable(counts, config, config.shards, floor)
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
    if len(fixes) == 1:
        fixes.append("no flag of this exporter lowers this estimate")
    return (f"This export needs an estimated {est.peak:.1f} GB at its peak ({est.peak_stage} stage, {est.shards} "
            f"shard(s)), more than the budget of {plan.budget_gib:.1f} GB ({plan.budget_source}); it would be killed "
            f"for memory, so it stops before loading any weight. Estimated per-stage peaks in GB (fitted to measured "
            f"exports, {_count(counts.total)} parameters): {stages}. To fix: " + "; ".join(fixes))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def parse_max_memory(text: str | float) -> float:
    """``--max-memory GB``: a positive number of GB."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"--max-memory must be a positive number of GB, e.g. 16 or 7.5; got {text!r}")
    return value

"""A Gemma4 text model's parameters per part, counted from its config alone (no weights), and how its decoder is cut
into HTP contexts (shards): where the shards begin, how many the HTP can load, and how many keep each HTP call within
ExecuTorch's per-shard size. `memory` estimates an export's memory from these counts, and `memory.choose_memory_plan`
weighs these floors against that estimate."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.host_memory import GB_BYTES  # 2**30 bytes, as in the exporter's stage table

if TYPE_CHECKING:
    from optimum_qnn.config import ExportConfig

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
    # How the layers attend (`gemma4_layer_specs`), the window and the vocabulary: the KV caches' sizes at a context
    # (`memory.cache_bytes`); empty when counted from parameters alone.
    cache_layers: tuple = ()
    sliding_window: int | None = None
    vocab_size: int = 0

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
        from optimum_qnn.models.gemma4.modules import gemma4_layer_specs

        dtype = str(getattr(text_config, "dtype", None) or "bfloat16").removeprefix("torch.")
        window = text_config.sliding_window if "sliding_attention" in text_config.layer_types else None
        return cls(token, per_layer, tuple(layers), other, _STORED_BYTES.get(dtype, 2),
                   sum(n * n for n in in_features), len(in_features), sum(in_features),
                   sum(mod.out_features for mod in linears), gemma4_layer_specs(text_config), window,
                   text_config.vocab_size)

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
        end = balanced_splits(self.layers, self.other, self.token_table)
        starts, i = [], 0
        for k in range(shards, 1, -1):
            i = end[k][i]
            starts.append(i)
        return tuple(starts)


@functools.lru_cache(maxsize=8)
def balanced_splits(layers: tuple[int, ...], first: int, last: int) -> list[list[int]]:
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


def check_loadable(counts: ParameterCounts, config: ExportConfig, shards: int, floor: int) -> None:
    """Refuses a given ``shards`` below ``floor`` (`fewest_loadable_shards`), with the fix."""
    if shards >= floor:
        return
    raise InvalidInputError(
        f"--shards {shards} puts up to {shard_weights_gb(counts, config, shards):.1f} GB of weights "
        f"({config.quant.value}) in one HTP context, and the HTP loads a context of at most "
        f"{HTP_CONTEXT_LIMIT_GB:.0f} GB with its activations and buffers: the .pte would not load on the device. "
        f"Give --shards {floor} or more, or leave --shards out to let the exporter choose"
    )

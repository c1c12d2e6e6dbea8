"""Static, QNN-friendly twins of the Gemma4 text modules, registered as swaps of the Hugging Face classes.

Mirrors transformers 5.23.0 ``models/gemma4/modeling_gemma4.py`` (Gemma4RMSNorm, Gemma4TextAttention,
Gemma4TextDecoderLayer, Gemma4TextModel, Gemma4ForCausalLM). Every factory adopts the Hugging Face
parameters and buffers themselves (same tensor objects); only RoPE gets new, derived tables.

The static graph differs from Hugging Face's in three ways, none of which changes the math:
- KV caches are explicit inputs; each call returns only the new K/V slice (K transposed, see ops/attention.py);
- masks are additive inputs (one for full, one for sliding layers), positions are an input;
- RoPE cos/sin are precomputed tables indexed by position.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma4 import modeling_gemma4 as hf

from optimum_qnn.contract import AttentionKind, LayerSpec, column_blocks
from optimum_qnn.errors import UnsupportedModelError
from optimum_qnn.ops.attention import blocked_gqa, matmul_operand, static_gqa
from optimum_qnn.ops.mask import window_band
from optimum_qnn.ops.rope import apply_rope, gather_rope
from optimum_qnn.ops.softcap import softcap
from optimum_qnn.swap import SWAPS, SwapContext

# Classes that are already static-friendly and are kept as they are (coverage test reads this).
SWAPS.pass_through(hf.Gemma4TextMLP, "gated GELU-tanh MLP: plain Linear layers, already static")
SWAPS.pass_through(
    hf.Gemma4TextScaledWordEmbedding, "lookup times a constant; the exporter replaces it with a CPU-side quantized lookup"
)

# Classes that exist in the Gemma4 text decoder but cannot be exported yet: the factory of the decoder layer
# refuses a config that uses them, so they never reach the static graph.
UNSUPPORTED = {
    hf.Gemma4TextRouter: "Mixture-of-Experts routing (enable_moe_block=True) is not supported yet",
    hf.Gemma4TextExperts: "Mixture-of-Experts experts (enable_moe_block=True) are not supported yet",
}


@dataclass(frozen=True)
class StaticOptions:
    """Build options handed to the factories through the swap context."""

    max_context_len: int
    # The graph will be PT2E-quantized: a few ops take the form the HTP computes correctly at that precision.
    quantized: bool = False
    # Tokens per call of each method: a call longer than the sliding window closes its own out-of-window columns
    # inside the graph (``ops.mask.window_band``).
    ar_lens: tuple[int, ...] = (1,)
    # Slots of a sliding layer's ring cache (the window; `CacheLayout.RING`), or None for full-length caches. Only
    # the window band's width depends on it: the layers attend over whatever columns their caches and mask bring.
    ring_len: int | None = None
    # Slots per cache block (`CacheLayout.BLOCKS`): every cache that is no ring enters as blocks of at most this many
    # columns, and attention reads them block by block (`ops.attention.blocked_gqa`). None: one input per cache.
    block_len: int | None = None
    # Also return the final hidden state (after the norm): what an MTP drafter beside the target reads
    # (docs/assistant.md). Only variants built with an assistant have it, so the runner contract stays as it was.
    hidden_output: bool = False
    # Every method also takes soft tokens (an image's embeddings, `contract.IMAGE_INPUTS`), merged into the token
    # embeddings where ``image_mask`` is 1 as Gemma4Model merges an image's features. The prefill reads them; decode
    # gets zeros, and takes them so that its graph is the prefill's op for op, which the quantization's shared
    # observers need (`quantization.shared.copy_observer_state` pairs the two graphs' observers by node name).
    image_inputs: bool = False


class StaticRMSNorm(nn.Module):
    """Gemma4RMSNorm as ``aten.rms_norm`` (the HTP has a native RmsNorm op).

    Gemma4 multiplies by the weight itself (not ``1 + w`` as Gemma 1-3) and computes in fp32; a norm without scale
    (``v_norm``) has no weight.
    """

    def __init__(self, weight: nn.Parameter | None, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise a 3-D view: QNN lowering (executorch 1.5.1) computes RmsNorm on 4-D tensors with more than one
        # row per head over the wrong axis (it lays 4-D tensors out channel-last), e.g. q/k norms of a prefill.
        flat = x.reshape(1, -1, x.shape[-1])
        if x.dtype == torch.float32:  # the exported graphs: no casts in them (the quantizer has no rule for casts)
            return F.rms_norm(flat, (x.shape[-1],), self.weight, self.eps).view(x.shape)
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(flat.float(), (x.shape[-1],), w, self.eps).view(x.shape).to(x.dtype)


@SWAPS.register(hf.Gemma4RMSNorm)
def _swap_rmsnorm(module: hf.Gemma4RMSNorm, ctx: SwapContext) -> StaticRMSNorm:
    return StaticRMSNorm(module.weight if module.with_scale else None, module.eps)


class RopeTables(nn.Module):
    """cos/sin tables for positions ``[0, max_context_len)``, one pair per layer type.

    Computed by the Hugging Face rotary module itself, so sliding (full RoPE) and full layers ("proportional"
    partial RoPE, zero-padded frequencies) are reproduced bit for bit.
    """

    def __init__(self, hf_rotary: hf.Gemma4TextRotaryEmbedding, max_context_len: int):
        super().__init__()
        positions = torch.arange(max_context_len).unsqueeze(0)
        probe = torch.zeros(1, dtype=torch.float32)
        self.kinds: list[str] = []
        for layer_type in hf_rotary.layer_types:
            cos, sin = hf_rotary(probe, positions, layer_type)
            self.register_buffer(f"{layer_type}_cos", cos[0].contiguous(), persistent=False)
            self.register_buffer(f"{layer_type}_sin", sin[0].contiguous(), persistent=False)
            self.kinds.append(layer_type)

    def forward(self, input_pos: torch.Tensor, kind: AttentionKind) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_rope(getattr(self, f"{kind.value}_cos"), getattr(self, f"{kind.value}_sin"), input_pos)


@SWAPS.register(hf.Gemma4TextRotaryEmbedding)
def _swap_rotary(module: hf.Gemma4TextRotaryEmbedding, ctx: SwapContext) -> RopeTables:
    return RopeTables(module, ctx.options.max_context_len)


# The class is its own factory: it is built from the Hugging Face module and the swap context.
@SWAPS.register(hf.Gemma4TextAttention)
class StaticGemma4Attention(nn.Module):
    """Gemma4TextAttention over explicit caches.

    A cache-owning layer projects K/V for the current tokens, appends them to its cache inputs and returns the
    new slice. A KV-reusing layer (KV sharing) has no K/V weights and attends to the full K/V of the layer it
    reuses. Which of the two a layer is gets decided when it is built.
    """

    def __init__(self, attn: hf.Gemma4TextAttention, ctx: SwapContext):
        super().__init__()
        cfg = attn.config
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_attention_heads // attn.num_key_value_groups
        self.scaling = attn.scaling
        self.reuses_kv = attn.is_kv_shared_layer
        self.q_proj = attn.q_proj
        self.q_norm = ctx.swap(attn.q_norm, "q_norm")
        self.o_proj = attn.o_proj
        if not self.reuses_kv:
            self.k_proj = attn.k_proj
            # attention_k_eq_v: full layers have no v_proj and take V from the raw key projection.
            self.v_proj = attn.v_proj
            self.k_norm = ctx.swap(attn.k_norm, "k_norm")
            self.v_norm = ctx.swap(attn.v_norm, "v_norm")

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        k_in: torch.Tensor | list[torch.Tensor],
        v_in: torch.Tensor | list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns (output, K over all C columns, V over all C columns, new K slice, new V slice).

        ``k_in``/``v_in`` are this layer's caches (``[1, kv, hd, C-ar]`` / ``[1, kv, C-ar, hd]``) when it owns one,
        or the full K/V (``[1, kv, hd, C]`` / ``[1, kv, C, hd]``) of the layer it reuses, or that layer's (cache,
        new columns) to join here (its source is in another shard). In the blocks layout caches are lists of column
        blocks instead, and so are the K/V returned: the blocks, then the call's own columns.
        """
        ar = x.shape[1]
        q = self.q_proj(x).view(1, ar, self.num_heads, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)
        if self.reuses_kv:
            k_full, v_full, k_new, v_new = k_in, v_in, None, None
            if isinstance(k_in, tuple):  # (the source's cache, its new columns): joined here, in this layer's shard
                k_full, v_full = join_cache(k_in[0], v_in[0], k_in[1], v_in[1])
        else:
            k = self.k_proj(x).view(1, ar, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(1, ar, self.num_kv_heads, self.head_dim) if self.v_proj is not None else k
            k = apply_rope(self.k_norm(k), cos, sin)
            v = self.v_norm(v)
            # K is kept transposed ([.., head_dim, T]) so Q @ K needs no transpose of the whole cache.
            k_new = k.permute(0, 2, 3, 1)
            v_new = v.transpose(1, 2)
            k_full, v_full = join_cache(k_in, v_in, k_new, v_new)
        if isinstance(k_full, list):
            out = blocked_gqa(q, k_full, v_full, mask, self.scaling)
        else:
            out = static_gqa(q, k_full, v_full, mask, self.scaling)
        return self.o_proj(out), k_full, v_full, k_new, v_new




def join_cache(k_in, v_in, k_new: torch.Tensor, v_new: torch.Tensor):
    """A cache's K and V over all C columns: the cache (a tensor, or a list of its column blocks) then the call's own
    columns (``k_new`` ``[1, kv, hd, ar]``, ``v_new`` ``[1, kv, ar, hd]``)."""
    if isinstance(k_in, list):  # the blocks layout: never joined, so no tensor holds a whole cache
        return [matmul_operand(k) for k in k_in] + [k_new], [matmul_operand(v) for v in v_in] + [v_new]
    return torch.cat([k_in, k_new], dim=-1), torch.cat([v_in, v_new], dim=-2)

# The class is its own factory: it is built from the Hugging Face module and the swap context.
@SWAPS.register(hf.Gemma4TextDecoderLayer)
class StaticGemma4DecoderLayer(nn.Module):
    """Gemma4TextDecoderLayer: attention, MLP, the per-layer-embedding gate and ``layer_scalar``."""

    def __init__(self, layer: hf.Gemma4TextDecoderLayer, ctx: SwapContext):
        super().__init__()
        if layer.enable_moe_block:
            raise UnsupportedModelError(
                f"Gemma4 layer {layer.layer_idx} uses a Mixture-of-Experts block (enable_moe_block=True), "
                "which optimum-qnn does not support yet. Export a dense Gemma4 model (e.g. gemma-4-e2b, gemma-4-e4b)."
            )
        self.attention = AttentionKind(layer.self_attn.layer_type)
        self.self_attn = ctx.swap(layer.self_attn, "self_attn")
        self.mlp = ctx.swap(layer.mlp, "mlp")
        self.input_layernorm = ctx.swap(layer.input_layernorm, "input_layernorm")
        self.post_attention_layernorm = ctx.swap(layer.post_attention_layernorm, "post_attention_layernorm")
        self.pre_feedforward_layernorm = ctx.swap(layer.pre_feedforward_layernorm, "pre_feedforward_layernorm")
        self.post_feedforward_layernorm = ctx.swap(layer.post_feedforward_layernorm, "post_feedforward_layernorm")
        self.register_buffer("layer_scalar", layer.layer_scalar)
        self.has_per_layer_input = bool(layer.hidden_size_per_layer_input)
        if self.has_per_layer_input:
            self.act_fn = layer.act_fn
            self.per_layer_input_gate = layer.per_layer_input_gate
            self.per_layer_projection = layer.per_layer_projection
            self.post_per_layer_input_norm = ctx.swap(layer.post_per_layer_input_norm, "post_per_layer_input_norm")

    def forward(
        self,
        h: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        k_in: torch.Tensor,
        v_in: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        attn, k_full, v_full, k_new, v_new = self.self_attn(self.input_layernorm(h), cos, sin, mask, k_in, v_in)
        h = h + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.has_per_layer_input:
            gate = self.act_fn(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar, k_full, v_full, k_new, v_new



# The class is its own factory: it is built from the Hugging Face module and the swap context.
@SWAPS.register(hf.Gemma4TextModel)
class StaticGemma4TextModel(nn.Module):
    """Gemma4TextModel over the runner contract's inputs; returns final hidden states and the new K/V slices."""

    def __init__(self, model: hf.Gemma4TextModel, ctx: SwapContext):
        super().__init__()
        cfg = model.config
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            raise UnsupportedModelError(
                "Gemma4 configs with use_bidirectional_attention='all' are encoders, not causal decoders; "
                "optimum-qnn exports causal text generation only."
            )
        self.layer_specs = gemma4_layer_specs(cfg)
        self.embed_tokens = ctx.swap(model.embed_tokens, "embed_tokens")
        self.layers = nn.ModuleList([ctx.swap(layer, f"layers.{i}") for i, layer in enumerate(model.layers)])
        self.norm = ctx.swap(model.norm, "norm")
        self.rope = ctx.swap(model.rotary_emb, "rotary_emb")
        self.num_layers = cfg.num_hidden_layers
        # The layers that begin a shard (the exporter's split, `exporter.parameters.ParameterCounts.shard_starts`).
        self.shard_starts: tuple[int, ...] = ()
        self.ple_dim = model.hidden_size_per_layer_input
        if self.ple_dim:
            self.embed_tokens_per_layer = ctx.swap(model.embed_tokens_per_layer, "embed_tokens_per_layer")
            self.per_layer_model_projection = model.per_layer_model_projection
            self.per_layer_projection_norm = ctx.swap(model.per_layer_projection_norm, "per_layer_projection_norm")
            self.per_layer_model_projection_scale = model.per_layer_model_projection_scale
            self.per_layer_input_scale = model.per_layer_input_scale
        # ExecuTorch's runner applies the window to past columns only; a call longer than the window closes its own
        # out-of-window columns here, so any runner's mask gives the Hugging Face attention (ops.mask.window_band).
        # A ring layout's sliding mask spans ring_len + ar columns (the ring, then the call's own tokens).
        self.window_bands: set[int] = set()
        if any(spec.attention is AttentionKind.SLIDING for spec in self.layer_specs):
            ring = ctx.options.ring_len
            for ar in sorted(set(ctx.options.ar_lens)):
                if ar > cfg.sliding_window:
                    band = window_band(ar, ctx.options.max_context_len if ring is None else ring + ar, cfg.sliding_window)
                    self.register_buffer(f"window_band_{ar}", band, persistent=False)
                    self.register_buffer(f"window_closed_{ar}", band < 0, persistent=False)
                    self.window_bands.add(ar)

    def per_layer_inputs(self, tokens: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The PLE signal ``[1, ar, layers, ple_dim]``: token lookup plus normalised projection, times 2**-0.5."""
        ar = tokens.shape[1]
        lookup = self.embed_tokens_per_layer(tokens).view(1, ar, self.num_layers, self.ple_dim)
        proj = self.per_layer_model_projection(embeds) * self.per_layer_model_projection_scale
        proj = self.per_layer_projection_norm(proj.view(1, ar, self.num_layers, self.ple_dim))
        return (proj + lookup) * self.per_layer_input_scale

    def forward(
        self,
        tokens: torch.Tensor,
        atten_mask: torch.Tensor,
        sliding_atten_mask: torch.Tensor,
        input_pos: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        image_embeds: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        h = self.embed_tokens(tokens)
        if image_embeds is not None:
            # Gemma4Model's merge: soft tokens as they are (unscaled) where the mask is 1, the scaled token embedding
            # elsewhere; the host puts the pad id at the soft tokens' places, so the PLE lookup below reads pad's row
            # there and the PLE projection reads the merged embeddings, as Hugging Face computes them. Exact in
            # float: 0 * x + 1 * y is y.
            h = h * (1.0 - image_mask) + image_embeds * image_mask
        ple = self.per_layer_inputs(tokens, h) if self.ple_dim else None
        # One lookup per attention kind, in layer order: a set's order follows the string hash (PYTHONHASHSEED), and
        # the traced graph's node order, hence the HTP context's bytes, would differ from one process to the next.
        rope = {kind: self.rope(input_pos, kind) for kind in dict.fromkeys(spec.attention for spec in self.layer_specs)}
        if tokens.shape[1] in self.window_bands:
            # `where`, not `minimum`: the HTP has no 8-bit ElementWiseMinimum (QNN cannot create q::Minimum_u8_simple,
            # so an 8a8w prefill graph failed to compile); a select keeps the mask's range at every precision.
            band = getattr(self, f"window_band_{tokens.shape[1]}")
            sliding_atten_mask = torch.where(getattr(self, f"window_closed_{tokens.shape[1]}"), band, sliding_atten_mask)
        masks = {AttentionKind.FULL: atten_mask, AttentionKind.SLIDING: sliding_atten_mask}
        # Per (shard, cache-owning layer): its K/V over all C columns as that shard's layers read them.
        full_kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        k_out: list[torch.Tensor] = []
        v_out: list[torch.Tensor] = []
        for spec, layer in zip(self.layer_specs, self.layers):
            shard = bisect.bisect_right(self.shard_starts, spec.index)
            if spec.owns_cache:
                k_in, v_in = k_caches[spec.cache_index], v_caches[spec.cache_index]
            else:
                if (shard, spec.kv_source) in full_kv:
                    k_in, v_in = full_kv[shard, spec.kv_source]
                else:
                    # The source layer is in an earlier shard: this layer joins the source's cache (a graph input)
                    # and its new columns again, in its own shard. What crosses between the shards is then the new
                    # columns, not all C columns as float32 (Gemma-4-E2B at 32768 in 4 shards: 128 MiB into each
                    # later shard per decode call); the join is the owner's own ops on the same tensors.
                    source = self.layer_specs[spec.kv_source].cache_index
                    k_in = (k_caches[source], k_out[source])
                    v_in = (v_caches[source], v_out[source])
            cos, sin = rope[spec.attention]
            per_layer = ple[:, :, spec.index, :] if ple is not None else None
            h, k_full, v_full, k_new, v_new = layer(h, per_layer, cos, sin, masks[spec.attention], k_in, v_in)
            if spec.owns_cache:
                full_kv[shard, spec.index] = (k_full, v_full)
                k_out.append(k_new)
                v_out.append(v_new)
            else:  # the first reader of this shard leaves the K/V it joined to the next ones
                full_kv.setdefault((shard, spec.kv_source), (k_full, v_full))
        return self.norm(h), k_out, v_out



class StaticGemma4ForCausalLM(nn.Module):
    """The exported graph: ``forward(tokens, atten_mask, sliding_atten_mask, input_pos, *k_caches, *v_caches)``
    returns ``(logits, *k_new, *v_new)`` in the order of the runner contract, then the final hidden state when built
    with ``hidden_output``."""

    def __init__(self, model: nn.Module, lm_head: nn.Linear, final_logit_softcapping: float | None, ctx: SwapContext):
        super().__init__()
        self.quantized = ctx.options.quantized
        self.model = ctx.swap(model, "model")
        # Tied to embed_tokens.weight in every Gemma4 checkpoint: adopting the module keeps the tie.
        self.lm_head = lm_head
        self.final_logit_softcapping = final_logit_softcapping
        self.num_caches = sum(spec.owns_cache for spec in self.model.layer_specs)
        self.hidden_output = ctx.options.hidden_output
        self.context_len = ctx.options.max_context_len
        self.block_len = ctx.options.block_len
        # Which caches enter as blocks: in the blocks layout, every one that is no ring.
        ring = ctx.options.ring_len is not None
        self.blocked = [self.block_len is not None and not (ring and spec.attention is AttentionKind.SLIDING)
                        for spec in self.model.layer_specs if spec.owns_cache]
        # Every call takes the soft-token inputs, last (`contract.IMAGE_INPUTS`), in an image variant.
        self.image_inputs = ctx.options.image_inputs

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return self.model.layer_specs

    def forward(
        self,
        tokens: torch.Tensor,
        atten_mask: torch.Tensor,
        sliding_atten_mask: torch.Tensor,
        input_pos: torch.Tensor,
        *caches: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        images: tuple[torch.Tensor, ...] = ()
        if self.image_inputs:
            caches, images = caches[:-2], caches[-2:]
        k_caches, v_caches = self._grouped(caches, tokens.shape[1])
        h, k_new, v_new = self.model(tokens, atten_mask, sliding_atten_mask, input_pos, k_caches, v_caches, *images)
        logits = self.lm_head(h)
        if self.final_logit_softcapping is not None:
            logits = softcap(logits, self.final_logit_softcapping, quantized=self.quantized)
        # The hidden state goes last: every runner reads logits and the new K/V by their positions.
        return (logits, *k_new, *v_new, h) if self.hidden_output else (logits, *k_new, *v_new)

    def _grouped(self, caches: tuple[torch.Tensor, ...], ar: int) -> tuple[list, list]:
        """The flat cache inputs as one entry per cache-owning layer, K then V: a tensor, or a list of its blocks
        (the runner contract's order: `contract.column_blocks` of this call's ``C - ar`` slots)."""
        blocks = len(column_blocks(self.context_len - ar, self.block_len)) if self.block_len is not None else 1
        sizes = [blocks if b else 1 for b in self.blocked]
        if len(caches) != 2 * sum(sizes):
            raise ValueError(f"expected {2 * sum(sizes)} cache inputs for a call of {ar} tokens; got {len(caches)}")
        grouped, start = [], 0
        for size, b in zip(sizes * 2, self.blocked * 2):
            grouped.append(list(caches[start:start + size]) if b else caches[start])
            start += size
        n = len(sizes)
        return grouped[:n], grouped[n:]


@SWAPS.register(hf.Gemma4ForCausalLM)
def _swap_causal_lm(module: hf.Gemma4ForCausalLM, ctx: SwapContext) -> StaticGemma4ForCausalLM:
    return StaticGemma4ForCausalLM(module.model, module.lm_head, module.config.final_logit_softcapping, ctx)


@SWAPS.register(hf.Gemma4ForConditionalGeneration)
def _swap_multimodal(module: hf.Gemma4ForConditionalGeneration, ctx: SwapContext) -> StaticGemma4ForCausalLM:
    # Only the text decoder is exported; the vision and audio towers are left out of the static graph.
    text_cfg = module.config.get_text_config()
    return StaticGemma4ForCausalLM(module.model.language_model, module.lm_head, text_cfg.final_logit_softcapping, ctx)


def gemma4_layer_specs(cfg) -> tuple[LayerSpec, ...]:
    """Per-layer attention kind, head_dim, KV heads and KV source, read from a Gemma4TextConfig.

    A KV-reusing layer (``kv_sharing_modes[i] == "reuse"``) attends to the K/V of the last earlier layer of its
    type that stores them (mode ``"store"``), exactly as ``shared_kv_states`` does in transformers.
    """
    modes = cfg.kv_sharing_modes
    specs: list[LayerSpec] = []
    store_of: dict[str, int] = {}
    cache_index = 0
    for i, layer_type in enumerate(cfg.layer_types):
        try:
            kind = AttentionKind(layer_type)
        except ValueError:
            raise UnsupportedModelError(
                f"Gemma4 layer {i} has attention type {layer_type!r}; expected one of: "
                + ", ".join(k.value for k in AttentionKind)
            ) from None
        layer_cfg = cfg.per_layer_config[i]
        if modes[i] == "reuse":
            specs.append(LayerSpec(i, kind, layer_cfg.head_dim, layer_cfg.num_key_value_heads, store_of[layer_type], None))
            continue
        if modes[i] == "store":
            store_of[layer_type] = i
        specs.append(LayerSpec(i, kind, layer_cfg.head_dim, layer_cfg.num_key_value_heads, i, cache_index))
        cache_index += 1
    return tuple(specs)

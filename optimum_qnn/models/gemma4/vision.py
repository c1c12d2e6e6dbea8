"""Static, QNN-friendly twins of Gemma 4's vision tower and its projection into the text model, registered as swaps.

Mirrors transformers 5.23.0 ``models/gemma4/modeling_gemma4.py`` (Gemma4VisionModel, Gemma4VisionPatchEmbedder,
Gemma4VisionEncoder(Layer), Gemma4VisionAttention, Gemma4VisionRotaryEmbedding, Gemma4VisionPooler,
Gemma4ClippableLinear, Gemma4MultimodalEmbedder). The factories adopt Hugging Face's parameters and buffers.

One graph per image budget (`ImageGeometry`): ``max_patches`` patches in, ``soft_tokens`` rows out. What depends on
the image's shape is computed on the host by `optimum_qnn.images.encoder_inputs` and enters as inputs:

    pixel_values    [1, P, 3*p*p]  float   the processor's patches (padding: zeros)
    position_x      [1, P]         int32   patch column (padding: 0)
    position_y      [1, P]         int32   patch row (padding: 0)
    valid           [1, P, 1]      float   1 for the image's patches, 0 for padding
    attention_mask  [1, 1, 1, P]   float   0 / MASK_MIN over keys (padding keys closed)
    pooling         [1, S, P]      float   the k x k average of each soft token (``1/k**2`` weights)

and the output is ``[1, S, text_hidden]``: the image's soft tokens in the text model's space, its first
``num_soft_tokens`` rows real, the rest padding the host drops. Hugging Face's data-dependent steps (the clamp and
the ``where`` on padding, the one-hot pooling built from the largest x, the boolean strip of pooled padding) are
these inputs; the math between them is Hugging Face's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.gemma4 import modeling_gemma4 as hf

from optimum_qnn.images import ImageGeometry
from optimum_qnn.errors import UnsupportedModelError
from optimum_qnn.ops.attention import static_gqa
from optimum_qnn.ops.rope import apply_rope, gather_rope
from optimum_qnn.swap import SWAPS, SwapContext, SwapReport, check_swapped

# The graph's inputs, in order (the names a manifest and a host session use).
ENCODER_INPUTS = ("pixel_values", "position_x", "position_y", "valid", "attention_mask", "pooling")
ENCODER_OUTPUT = "image_embeds"

@SWAPS.register(hf.Gemma4ClippableLinear)
class StaticClippableLinear(nn.Module):
    """A linear whose input and output are clamped to ranges stored in the checkpoint.

    The bounds become constants of the graph (Python floats read from the checkpoint's scalar buffers): QNN has no
    clamp with tensor bounds, and with them each of the tiny tower's 28 clamps stayed on the CPU, cutting the graph
    into 17 QNN partitions. Infinite bounds (a tower without clipping) are left out: the clamp is a no-op there.
    """

    def __init__(self, module: hf.Gemma4ClippableLinear, ctx: SwapContext):
        super().__init__()
        self.linear = module.linear
        self.bounds: dict[str, tuple[float | None, float | None]] = {}
        for side in ("input", "output"):
            ends = []
            for end in ("min", "max"):
                buffer = getattr(module, f"{side}_{end}", None) if module.use_clipped_linears else None
                ends.append(float(buffer) if buffer is not None and torch.isfinite(buffer).all() else None)
            self.bounds[side] = (ends[0], ends[1])

    def _clamp(self, x: torch.Tensor, side: str) -> torch.Tensor:
        low, high = self.bounds[side]
        return x if low is None and high is None else torch.clamp(x, low, high)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._clamp(self.linear(self._clamp(x, "input")), "output")


@SWAPS.register(hf.Gemma4VisionMLP)
class StaticVisionMLP(nn.Module):
    """Gemma4VisionMLP, its clippable linears swapped: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, mlp: hf.Gemma4VisionMLP, ctx: SwapContext):
        super().__init__()
        self.act_fn = mlp.act_fn
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, ctx.swap(getattr(mlp, name), name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@SWAPS.register(hf.Gemma4VisionPatchEmbedder)
class StaticPatchEmbedder(nn.Module):
    """Patches projected, plus the x and y position embeddings of each patch (zero on padding)."""

    def __init__(self, module: hf.Gemma4VisionPatchEmbedder, ctx: SwapContext):
        super().__init__()
        self.input_proj = module.input_proj
        self.position_embedding_table = module.position_embedding_table

    def forward(self, pixel_values: torch.Tensor, x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        hidden = self.input_proj(2 * (pixel_values - 0.5))  # Gemma 4 scales pixels to [-1, 1] in the model
        table = self.position_embedding_table
        positions = torch.index_select(table[0], 0, x.reshape(-1)) + torch.index_select(table[1], 0, y.reshape(-1))
        # `valid` is 0/1: the product is Hugging Face's `where(padding, 0, ...)` without a boolean input.
        return hidden + positions.view(hidden.shape) * valid


@SWAPS.register(hf.Gemma4VisionRotaryEmbedding)
class VisionRopeTables(nn.Module):
    """cos/sin of one axis for patch positions ``[0, soft_tokens * k)`` (the longest side a budget allows).

    Axial RoPE rotates the first half of a head's channels by the patch's x and the second half by its y, with the
    same frequencies; the tables hold one half (``head_dim // 2`` columns), computed by the Hugging Face module
    itself at positions (n, n), so they are bit for bit what it computes per patch.
    """

    def __init__(self, module: hf.Gemma4VisionRotaryEmbedding, ctx: SwapContext):
        super().__init__()
        geometry: ImageGeometry = ctx.options
        n = geometry.soft_tokens * geometry.pooling_kernel_size
        positions = torch.arange(n).view(1, n, 1).expand(1, n, 2)
        cos, sin = module(torch.zeros(1, dtype=torch.float32), positions)
        half = cos.shape[-1] // 2
        self.register_buffer("cos", cos[0, :, :half].contiguous(), persistent=False)
        self.register_buffer("sin", sin[0, :, :half].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """((cos, sin) of x, (cos, sin) of y), each ``[1, P, 1, head_dim // 2]``."""
        return gather_rope(self.cos, self.sin, x), gather_rope(self.cos, self.sin, y)


def apply_axial_rope(t: torch.Tensor, rope: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> torch.Tensor:
    """``t`` ``[1, P, heads, head_dim]`` rotated as ``apply_multidimensional_rope`` does with two axes: each half of
    the channels by its own axis, ``rotate_half`` inside the half."""
    (cos_x, sin_x), (cos_y, sin_y) = rope
    half = cos_x.shape[-1]
    return torch.cat([apply_rope(t[..., :half], cos_x, sin_x), apply_rope(t[..., half:2 * half], cos_y, sin_y)], dim=-1)


@SWAPS.register(hf.Gemma4VisionAttention)
class StaticVisionAttention(nn.Module):
    """Bidirectional attention over all P patches; padding keys closed by the mask input; scaling 1.0 (q/k norms)."""

    def __init__(self, attn: hf.Gemma4VisionAttention, ctx: SwapContext):
        super().__init__()
        cfg = attn.config
        if cfg.num_attention_heads * attn.head_dim != attn.q_proj.linear.out_features or attn.head_dim % 4:
            raise UnsupportedModelError(
                f"Gemma 4 vision attention with head_dim {attn.head_dim} and {cfg.num_attention_heads} heads: "
                "axial RoPE needs a head_dim divisible by 4"
            )
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = attn.scaling
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "v_norm"):
            setattr(self, name, ctx.swap(getattr(attn, name), name))

    def forward(self, h: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        p = h.shape[1]
        q = apply_axial_rope(self.q_norm(self.q_proj(h).view(1, p, self.num_heads, self.head_dim)), rope)
        k = apply_axial_rope(self.k_norm(self.k_proj(h).view(1, p, self.num_kv_heads, self.head_dim)), rope)
        v = self.v_norm(self.v_proj(h).view(1, p, self.num_kv_heads, self.head_dim))
        # K transposed ([1, kv, head_dim, P]) as static_gqa takes it, the text layers' layout.
        out = static_gqa(q.transpose(1, 2), k.permute(0, 2, 3, 1), v.transpose(1, 2), mask, self.scaling)
        return self.o_proj(out)


@SWAPS.register(hf.Gemma4VisionEncoderLayer)
class StaticVisionEncoderLayer(nn.Module):
    """Gemma4VisionEncoderLayer: norms around attention and the MLP, residuals."""

    def __init__(self, layer: hf.Gemma4VisionEncoderLayer, ctx: SwapContext):
        super().__init__()
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, ctx.swap(getattr(layer, name), name))

    def forward(self, h: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


@SWAPS.register(hf.Gemma4VisionEncoder)
class StaticVisionEncoder(nn.Module):
    """The encoder layers, with RoPE looked up once for all of them."""

    def __init__(self, encoder: hf.Gemma4VisionEncoder, ctx: SwapContext):
        super().__init__()
        self.rotary_emb = ctx.swap(encoder.rotary_emb, "rotary_emb")
        layers = encoder.layers[: encoder.config.num_hidden_layers]
        self.layers = nn.ModuleList([ctx.swap(layer, f"layers.{i}") for i, layer in enumerate(layers)])

    def forward(self, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rope = self.rotary_emb(x, y)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return h


@SWAPS.register(hf.Gemma4VisionPooler)
class StaticVisionPooler(nn.Module):
    """The k x k average of each soft token as one matmul with the host's pooling matrix, times sqrt(hidden)."""

    def __init__(self, pooler: hf.Gemma4VisionPooler, ctx: SwapContext):
        super().__init__()
        self.root_hidden_size = pooler.root_hidden_size

    def forward(self, h: torch.Tensor, pooling: torch.Tensor) -> torch.Tensor:
        # Padding patches have zero weight in every row, so they need no masking first (Hugging Face zeroes them).
        return torch.matmul(pooling, h) * self.root_hidden_size


@SWAPS.register(hf.Gemma4VisionModel)
class StaticVisionModel(nn.Module):
    """Gemma4VisionModel over the static inputs: patch embedding, encoder, pooling, standardization."""

    def __init__(self, model: hf.Gemma4VisionModel, ctx: SwapContext):
        super().__init__()
        cfg = model.config
        geometry: ImageGeometry = ctx.options
        if (cfg.patch_size, cfg.pooling_kernel_size) != (geometry.patch_size, geometry.pooling_kernel_size):
            raise UnsupportedModelError(
                f"The vision tower's patch_size {cfg.patch_size} and pooling_kernel_size {cfg.pooling_kernel_size} "
                f"differ from the image geometry's ({geometry.patch_size}, {geometry.pooling_kernel_size}); build the "
                "geometry from the model's vision config"
            )
        if geometry.soft_tokens * geometry.pooling_kernel_size > cfg.position_embedding_size:
            raise UnsupportedModelError(
                f"{geometry.soft_tokens} soft tokens allow {geometry.soft_tokens * geometry.pooling_kernel_size} "
                f"patches on a side, past the tower's {cfg.position_embedding_size} position embeddings; choose a "
                "smaller budget"
            )
        self.patch_embedder = ctx.swap(model.patch_embedder, "patch_embedder")
        self.encoder = ctx.swap(model.encoder, "encoder")
        self.pooler = ctx.swap(model.pooler, "pooler")
        self.standardize = bool(cfg.standardize)
        if self.standardize:
            self.std_bias = model.std_bias
            self.std_scale = model.std_scale

    def forward(self, pixel_values, x, y, valid, attention_mask, pooling) -> torch.Tensor:
        h = self.encoder(self.patch_embedder(pixel_values, x, y, valid), x, y, attention_mask)
        pooled = self.pooler(h, pooling)
        if self.standardize:
            pooled = (pooled - self.std_bias) * self.std_scale
        return pooled


@SWAPS.register(hf.Gemma4MultimodalEmbedder)
class StaticMultimodalEmbedder(nn.Module):
    """Soft tokens into the text model's space: a norm without scale, then a projection."""

    def __init__(self, module: hf.Gemma4MultimodalEmbedder, ctx: SwapContext):
        super().__init__()
        self.embedding_pre_projection_norm = ctx.swap(module.embedding_pre_projection_norm, "embedding_pre_projection_norm")
        self.embedding_projection = module.embedding_projection

    def forward(self, soft_tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(soft_tokens))


class StaticImageEncoder(nn.Module):
    """The exported vision graph: ``forward(*ENCODER_INPUTS)`` returns ``image_embeds`` ``[1, S, text_hidden]``.

    Example:

    ```python
    >>> from optimum_qnn.images import ImageGeometry, preprocess, encoder_inputs
    >>> encoder, report = StaticImageEncoder.from_hf(hf_model, ImageGeometry(soft_tokens=280))
    >>> batch = preprocess("cat.jpg", encoder.geometry)
    >>> inputs = encoder_inputs(batch.pixel_values[0], batch.image_position_ids[0], encoder.geometry)
    >>> embeds = encoder(*map(torch.from_numpy, inputs.as_tuple()))[0, : inputs.num_soft_tokens]
    ```
    """

    def __init__(self, vision_tower: nn.Module, embed_vision: nn.Module, geometry: ImageGeometry):
        super().__init__()
        self.geometry = geometry
        self.vision_tower = vision_tower
        self.embed_vision = embed_vision

    @classmethod
    def from_hf(cls, model: nn.Module, geometry: ImageGeometry) -> tuple["StaticImageEncoder", SwapReport]:
        """Swap the vision tower and ``embed_vision`` of a `Gemma4ForConditionalGeneration` (or a `Gemma4Model`, or
        a `VisionParts` from `loading.load_vision_parts`). The Hugging Face modules are not modified.

        Raises:
            UnsupportedModelError: the model has no vision tower, or its geometry differs from ``geometry``.
        """
        inner = getattr(model, "model", model)
        tower, embed = getattr(inner, "vision_tower", None), getattr(inner, "embed_vision", None)
        if tower is None or embed is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no vision tower (vision_config is None): images need a Gemma 4 checkpoint "
                "with one, e.g. google/gemma-4-e2b or google/gemma-4-e4b"
            )
        ctx = SwapContext(SWAPS, geometry)
        encoder = cls(ctx.swap(tower, "vision_tower"), ctx.swap(embed, "embed_vision"), geometry)
        check_swapped(encoder, SWAPS)
        return encoder.eval(), ctx.report

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Inputs of the graph's static shapes (a blank image's), for export."""
        from optimum_qnn.images import encoder_inputs

        g = self.geometry
        positions = torch.full((g.max_patches, 2), -1, dtype=torch.int64)
        side = g.pooling_kernel_size
        positions[: side * side] = torch.tensor([(i % side, i // side) for i in range(side * side)])
        inputs = encoder_inputs(torch.zeros(g.max_patches, g.patch_pixels).numpy(), positions.numpy(), g)
        return tuple(torch.from_numpy(a) for a in inputs.as_tuple())

    def forward(self, pixel_values, position_x, position_y, valid, attention_mask, pooling) -> torch.Tensor:
        soft = self.vision_tower(pixel_values, position_x, position_y, valid, attention_mask, pooling)
        return self.embed_vision(soft)


def geometry_of(vision_config, soft_tokens: int) -> ImageGeometry:
    """The `ImageGeometry` of a Gemma 4 vision config at a budget of ``soft_tokens``."""
    return ImageGeometry(soft_tokens=soft_tokens, patch_size=vision_config.patch_size,
                         pooling_kernel_size=vision_config.pooling_kernel_size)


__all__ = ["ENCODER_INPUTS", "ENCODER_OUTPUT", "StaticImageEncoder", "geometry_of"]

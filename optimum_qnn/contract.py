"""The runner contract: the exact IO of every exported method, defined once.

The same object produces the export example inputs, drives the host-side KV management and is written into the
runner manifest. See docs/runner_contract.md for the prose version.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from optimum_qnn.errors import parse_enum
from optimum_qnn.ops.arrays import as_numpy, like
from optimum_qnn.ops.mask import MASK_MIN

if TYPE_CHECKING:  # pragma: no cover
    import torch

PREFILL_METHOD = "prefill_forward"
DECODE_METHOD = "kv_forward"
# An MTP drafter (Gemma 4's assistant) beside the target: see docs/assistant.md.
DRAFT_METHOD = "draft_forward"
# The extra last output of a target built for an assistant: its final hidden state, what the drafter reads.
HIDDEN_OUTPUT = "hidden"
# The last inputs of an image variant's prefill method: soft tokens [1, ar, hidden] (an image's embeddings, as the
# vision encoder gives them) and where they go [1, ar, 1] (1 at an image placeholder, else 0).
IMAGE_INPUTS = ("image_embeds", "image_mask")


class AttentionKind(enum.Enum):
    SLIDING = "sliding_attention"
    FULL = "full_attention"


class CacheLayout(enum.Enum):
    """How the sliding-window layers keep their K/V between calls.

    ``full``: every cache-owning layer has ``C - ar`` slots, slot j holding position j (ExecuTorch's layout: its
    ``qnn_llama_runner`` reads exactly this). ``ring``: a sliding layer has ``sliding_window`` slots, position p in
    slot ``p % sliding_window``; it never reads further back than its window, so the rest of a full-length cache
    only crossed the host on every call. Full-attention layers keep ``C - ar`` slots in both layouts.
    ``blocks``: sliding layers keep the ring (where their window is shorter than the context), and every other cache
    is split into column blocks of at most ``block_len`` slots, each block an input of its own
    (``k_cache_{i}_block{b}`` / ``v_cache_{i}_block{b}``): QNN's HTP compiler takes a uint16 graph input in one piece
    of TCM, so no block may exceed it (`exporter.htp_limits`), and a long context then compiles.
    """

    FULL = "full"
    RING = "ring"
    BLOCKS = "blocks"

    @classmethod
    def parse(cls, value: object) -> "CacheLayout":
        return parse_enum(cls, value, "cache layout")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a method: name, static shape and dtype name (``float32``, ``int64``, ``int32``,
    ``uint16``). A quantized tensor (integer graph IO) carries its encoding: ``real = (q - zero_point) * scale``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    scale: float | None = None
    zero_point: int | None = None

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def quantize(self, x: "np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
        """``x`` in this tensor's integer encoding (numpy, or torch when ``x`` is a torch tensor)."""
        info = np.iinfo(self.dtype)
        real = as_numpy(x).astype(np.float32)
        q = np.clip(np.round(real / np.float32(self.scale) + np.float32(self.zero_point)), info.min, info.max)
        return like(x, q.astype(self.dtype))

    def dequantize(self, q: "np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
        """The real values of ``q`` (float32; numpy, or torch when ``q`` is a torch tensor)."""
        real = (as_numpy(q).astype(np.float32) - np.float32(self.zero_point)) * np.float32(self.scale)
        return like(q, real)


@dataclass(frozen=True)
class LayerSpec:
    """How one decoder layer attends and where its K/V come from.

    Args:
        index: decoder layer index.
        attention: sliding or full attention (which mask input the layer reads).
        head_dim: this layer's head dim.
        kv_heads: this layer's number of KV heads.
        kv_source: index of the layer whose K/V this layer attends to (itself when it owns a cache).
        cache_index: position of this layer among the cache-owning layers, or None for a KV-reusing layer.
    """

    index: int
    attention: AttentionKind
    head_dim: int
    kv_heads: int
    kv_source: int
    cache_index: int | None

    @property
    def owns_cache(self) -> bool:
        return self.cache_index is not None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    ar_len: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def cache_len(self) -> int:
        """Slots of this method's full-length caches (context_len - ar_len): how many tokens may precede a call. A
        ring cache of a sliding layer is shorter (`RunnerContract.ring_len`)."""
        return self.inputs[1].shape[-1] - self.ar_len

    @property
    def takes_images(self) -> bool:
        """Whether this method takes soft tokens (`IMAGE_INPUTS`, its last two inputs)."""
        return len(self.inputs) >= 2 and self.inputs[-1].name == IMAGE_INPUTS[1]

    @property
    def image_width(self) -> int | None:
        """The width of one soft token this method takes (its ``image_embeds`` input's last dimension: the decoder's
        hidden size), or None for a method that takes none."""
        return self.inputs[-2].shape[-1] if self.takes_images else None


def column_blocks(cache_len: int, block_len: int | None) -> list[tuple[int, int]]:
    """The ``[start, end)`` slot ranges of a cache of ``cache_len`` slots cut into blocks of ``block_len`` (the last
    one shorter; one block when ``block_len`` is None). A method with a longer call reads the first ``C - ar``
    slots, so its last block is shorter, or its blocks fewer, than the decode method's."""
    step = block_len or max(cache_len, 1)
    return [(start, min(start + step, cache_len)) for start in range(0, cache_len, step)]


def cache_input_names(kind: str, layer: LayerSpec, blocks: int | None) -> list[str]:
    """The inputs holding ``layer``'s ``kind`` ("k" or "v") cache: one, or one per block in the blocks layout."""
    if blocks is None:
        return [f"{kind}_cache_{layer.index}"]
    return [f"{kind}_cache_{layer.index}_block{b}" for b in range(blocks)]


@dataclass(frozen=True)
class RunnerContract:
    """Static IO of every method of one export, plus the facts a runner needs to drive it.

    Inputs, in order: ``tokens`` int64 [1, ar]; ``atten_mask`` and ``sliding_atten_mask`` float [1, 1, ar, C];
    ``input_pos`` int32 [1, ar]; one ``k_cache_{i}`` [1, kv_heads, head_dim, C - ar] per cache-owning layer i
    (K stored transposed); one ``v_cache_{i}`` [1, kv_heads, C - ar, head_dim] per cache-owning layer.
    Outputs: ``logits`` [1, ar, vocab]; ``k_new_{i}`` [1, kv_heads, head_dim, ar]; ``v_new_{i}`` [1, kv_heads, ar, head_dim].
    A variant built with an assistant (docs/assistant.md) also outputs ``hidden`` [1, ar, hidden_size], last.

    With ``cache_layout`` ring, a sliding layer's caches hold ``ring_len`` (= sliding_window) slots instead of
    ``C - ar``, and ``sliding_atten_mask`` is ``[1, 1, ar, ring_len + ar]`` (ring slots, then the call's own tokens).
    With ``blocks``, the sliding layers keep that ring where it is shorter than the context, and each other cache is
    several inputs, ``k_cache_{i}_block{b}`` ``[1, kv_heads, head_dim, <= block_len]`` then the next block's (and
    likewise for V): slots ``[b * block_len, (b + 1) * block_len)`` of the same ``C - ar`` (`column_blocks`).
    """

    context_len: int
    vocab_size: int
    sliding_window: int | None
    layers: tuple[LayerSpec, ...]
    methods: tuple[MethodSpec, ...]
    mask_attend: float = 0.0
    mask_masked: float = MASK_MIN
    extra: dict[str, Any] = field(default_factory=dict)
    cache_layout: CacheLayout = CacheLayout.FULL
    block_len: int | None = None  # slots per cache block in the blocks layout

    @classmethod
    def build(
        cls,
        layers: tuple[LayerSpec, ...],
        *,
        vocab_size: int,
        context_len: int,
        ar_lens: dict[str, int],
        sliding_window: int | None,
        cache_layout: CacheLayout = CacheLayout.FULL,
        hidden_size: int | None = None,
        block_len: int | None = None,
        image_size: int | None = None,
    ) -> "RunnerContract":
        """Derive every method's IO from the layer layout. ``ar_lens`` maps method name -> tokens per call;
        ``hidden_size``: every method also outputs ``hidden`` [1, ar, hidden_size], last (variants with an assistant);
        ``block_len``: slots per cache block, for (and only for) the blocks layout; ``image_size``: every method also
        takes soft tokens of that width, last (`IMAGE_INPUTS`: an image variant; the host sends them through prefill,
        decode gets zeros, and takes them so its graph is the prefill's op for op)."""
        ring = check_ring(cache_layout, layers, context_len, sliding_window)
        check_block_len(cache_layout, block_len)
        if image_size is not None and PREFILL_METHOD not in ar_lens:
            raise ValueError("soft tokens (an image's embeddings) enter through the prefill method; this contract has none")
        methods = tuple(
            _method_spec(name, ar, layers, vocab_size, context_len, ring, hidden_size, block_len,
                         image_size)
            for name, ar in ar_lens.items()
        )
        check_same_blocks(context_len, ar_lens, block_len)
        return cls(context_len, vocab_size, sliding_window, layers, methods, cache_layout=cache_layout,
                   block_len=block_len)

    @property
    def ring_len(self) -> int | None:
        """Slots of a sliding layer's ring cache (the window), or None when no layer keeps a ring."""
        return ring_length(self.cache_layout, self.layers, self.context_len, self.sliding_window)

    def is_blocked(self, layer: LayerSpec) -> bool:
        """Whether ``layer``'s caches are split into column blocks (the blocks layout, a cache that is no ring)."""
        return self.cache_layout is CacheLayout.BLOCKS and not self.is_ring(layer)

    def is_ring(self, layer: LayerSpec) -> bool:
        return self.ring_len is not None and layer.attention is AttentionKind.SLIDING

    def cache_input_names(self, kind: str, layer: LayerSpec, method: str = DECODE_METHOD) -> list[str]:
        """The inputs of ``method`` that hold ``layer``'s ``kind`` ("k" or "v") cache, in order."""
        if not self.is_blocked(layer):
            return cache_input_names(kind, layer, None)
        return cache_input_names(kind, layer, len(column_blocks(self.method(method).cache_len, self.block_len)))

    def cache_slots(self, layer: LayerSpec, method: str = DECODE_METHOD) -> int:
        """Slots of ``layer``'s caches in ``method``: the ring's for a sliding layer of a ring layout, else C - ar."""
        if self.is_ring(layer):
            return self.ring_len
        return self.method(method).cache_len

    @property
    def cache_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.owns_cache)

    @property
    def kv_io_bits(self) -> int:
        """Bits of the caches at the graph boundary: 32 for float IO (ExecuTorch's `get_kv_io_bit_width` sentinel)."""
        caches = [t for t in self.methods[0].inputs if t.name.startswith("k_cache_")]
        if not caches or not caches[0].quantized:
            return 32
        return np.iinfo(caches[0].dtype).bits

    def with_quantized_io(self, encodings: dict[str, tuple[float, int, str]]) -> "RunnerContract":
        """This contract with integer IO: every tensor named in ``encodings`` (name -> scale, zero point, dtype)
        becomes that dtype in every method, and the mask values become the masks' quantized 0 and `MASK_MIN`."""
        def spec(t: TensorSpec) -> TensorSpec:
            if t.name not in encodings:
                return t
            scale, zero_point, dtype = encodings[t.name]
            return TensorSpec(t.name, t.shape, dtype, float(scale), int(zero_point))

        methods = tuple(
            MethodSpec(m.name, m.ar_len, tuple(map(spec, m.inputs)), tuple(map(spec, m.outputs))) for m in self.methods
        )
        contract = replace(self, methods=methods)
        mask = contract.methods[0].inputs[1]
        if mask.quantized:
            values = mask.quantize(np.array([self.mask_attend, self.mask_masked], dtype=np.float32)).tolist()
            contract = replace(contract, mask_attend=float(values[0]), mask_masked=float(values[1]))
        return contract

    def method(self, name: str) -> MethodSpec:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(f"Unknown method {name!r}; this export has: {', '.join(m.name for m in self.methods)}")


    def example_inputs(self, method: str) -> tuple["torch.Tensor", ...]:
        """Inputs of ``method`` for an empty cache: zero caches, position 0.., masks for n_past=0."""
        import torch

        from optimum_qnn.ops.mask import attention_mask, ring_mask

        spec = self.method(method)
        ar = spec.ar_len
        tensors: list[torch.Tensor] = []
        for t in spec.inputs:
            if t.name == "tokens":
                tensors.append(torch.zeros(t.shape, dtype=torch.int64))
            elif t.name == "atten_mask":
                tensors.append(torch.from_numpy(attention_mask(ar, self.context_len, 0)))
            elif t.name == "sliding_atten_mask" and self.ring_len is not None:
                tensors.append(torch.from_numpy(ring_mask(ar, self.ring_len, 0, window=self.sliding_window)))
            elif t.name == "sliding_atten_mask":
                tensors.append(torch.from_numpy(attention_mask(ar, self.context_len, 0, window=self.sliding_window)))
            elif t.name == "input_pos":
                tensors.append(torch.arange(ar, dtype=torch.int32).view(1, ar))
            else:
                tensors.append(torch.zeros(t.shape, dtype=getattr(torch, t.dtype)))
        return tuple(tensors)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for layer in d["layers"]:
            layer["attention"] = layer["attention"].value
        d["cache_layout"] = self.cache_layout.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunnerContract":
        layers = tuple(LayerSpec(**{**layer, "attention": AttentionKind(layer["attention"])}) for layer in d["layers"])
        methods = tuple(
            MethodSpec(
                m["name"],
                m["ar_len"],
                tuple(_tensor_spec(t) for t in m["inputs"]),
                tuple(_tensor_spec(t) for t in m["outputs"]),
            )
            for m in d["methods"]
        )
        return cls(
            d["context_len"], d["vocab_size"], d["sliding_window"], layers, methods,
            d.get("mask_attend", 0.0), d.get("mask_masked", MASK_MIN), dict(d.get("extra", {})),
            # Manifests written before the ring layout existed hold full-length caches.
            CacheLayout(d.get("cache_layout", CacheLayout.FULL.value)),
            d.get("block_len"),
        )


def _tensor_spec(t: dict[str, Any]) -> TensorSpec:
    return TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t.get("scale"), t.get("zero_point"))


def check_ring(layout: CacheLayout, layers: tuple[LayerSpec, ...], context_len: int, window: int | None) -> int | None:
    """The ring length of ``layout`` for these layers (None in the full layout), refusing a ring that cannot help.

    Raises:
        ValueError: a ring without sliding layers, or whose window is not shorter than the full caches.
    """
    if not isinstance(layout, CacheLayout):
        raise ValueError(f"cache_layout must be a CacheLayout; got {layout!r}")
    if layout is CacheLayout.FULL:
        return None
    if layout is CacheLayout.BLOCKS:  # the ring where it helps; every other cache is blocks
        return ring_length(layout, layers, context_len, window)
    if window is None or not any(l.attention is AttentionKind.SLIDING and l.owns_cache for l in layers):
        raise ValueError("The ring cache layout keeps sliding-window layers' caches at the window; this model has none")
    if window >= context_len - 1:
        raise ValueError(
            f"The ring cache layout gives sliding layers {window} slots (their window), which is not fewer than the "
            f"{context_len - 1} of a full-length cache at context {context_len}: use the full layout"
        )
    return window


def ring_length(layout: CacheLayout, layers: tuple[LayerSpec, ...], context_len: int, window: int | None) -> int | None:
    """The ring's slots in ``layout`` (the window), or None when no sliding layer keeps a ring: the full layout, or a
    blocks layout whose model has no sliding cache or a window not shorter than a full-length cache."""
    if layout is CacheLayout.RING:
        return window
    if layout is CacheLayout.BLOCKS and window is not None and window < context_len - 1 and any(
            l.attention is AttentionKind.SLIDING and l.owns_cache for l in layers):
        return window
    return None


def check_block_len(layout: CacheLayout, block_len: int | None) -> None:
    """A block length goes with the blocks layout, and only with it.

    Raises:
        ValueError: a block length without the blocks layout, or the blocks layout without a positive one.
    """
    if layout is CacheLayout.BLOCKS:
        if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 1:
            raise ValueError(f"The blocks cache layout needs block_len, a positive integer of slots; got {block_len!r}")
    elif block_len is not None:
        raise ValueError(f"block_len {block_len} splits caches in the blocks layout only; this one is {layout.value}")


def check_same_blocks(context_len: int, ar_lens: dict[str, int], block_len: int | None) -> None:
    """Every method must read its caches in the same number of blocks: the graphs then have one topology, which one
    set of quantization parameters for all of them needs (`quantization.shared`), and block b is the same host
    buffer in every method. The last block of the ``C - 1`` slots must hold at least the longest call's tokens.

    Raises:
        ValueError: naming the methods whose block counts differ.
    """
    if block_len is None:
        return
    counts = {name: len(column_blocks(context_len - ar, block_len)) for name, ar in ar_lens.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"block_len {block_len} cuts the caches of the methods into different numbers of blocks at context "
            f"{context_len} ({', '.join(f'{n}: {c}' for n, c in counts.items())}); the last block of the "
            f"{context_len - 1} slots must hold at least {max(ar_lens.values())} (`exporter.htp_limits.block_len_for` "
            "chooses such a length)"
        )


def _method_spec(name: str, ar: int, layers: tuple[LayerSpec, ...], vocab: int, context_len: int,
                 ring: int | None = None, hidden_size: int | None = None, block_len: int | None = None,
                 image_size: int | None = None) -> MethodSpec:
    if not 0 < ar < context_len:
        raise ValueError(f"ar_len {ar} of method {name} must be in [1, {context_len - 1}]")
    owners = [layer for layer in layers if layer.owns_cache]

    def slots(layer: LayerSpec) -> int:
        return ring if ring is not None and layer.attention is AttentionKind.SLIDING else context_len - ar

    sliding_cols = ring + ar if ring is not None else context_len
    inputs = [
        TensorSpec("tokens", (1, ar), "int64"),
        TensorSpec("atten_mask", (1, 1, ar, context_len), "float32"),
        TensorSpec("sliding_atten_mask", (1, 1, ar, sliding_cols), "float32"),
        TensorSpec("input_pos", (1, ar), "int32"),
    ]
    def blocked(layer: LayerSpec) -> bool:  # the blocks layout cuts every cache that is no ring
        return block_len is not None and not (ring is not None and layer.attention is AttentionKind.SLIDING)

    def pieces(layer: LayerSpec) -> list[int]:
        """Slots of each input holding the layer's cache: one, or the blocks of a cache that is no ring."""
        if not blocked(layer):
            return [slots(layer)]
        return [end - start for start, end in column_blocks(slots(layer), block_len)]

    def names(kind: str, layer: LayerSpec) -> list[str]:
        return cache_input_names(kind, layer, len(pieces(layer)) if blocked(layer) else None)

    inputs += [TensorSpec(name, (1, l.kv_heads, l.head_dim, n), "float32")
               for l in owners for name, n in zip(names("k", l), pieces(l))]
    inputs += [TensorSpec(name, (1, l.kv_heads, n, l.head_dim), "float32")
               for l in owners for name, n in zip(names("v", l), pieces(l))]
    outputs = [TensorSpec("logits", (1, ar, vocab), "float32")]
    outputs += [TensorSpec(f"k_new_{l.index}", (1, l.kv_heads, l.head_dim, ar), "float32") for l in owners]
    outputs += [TensorSpec(f"v_new_{l.index}", (1, l.kv_heads, ar, l.head_dim), "float32") for l in owners]
    if hidden_size is not None:
        outputs.append(TensorSpec(HIDDEN_OUTPUT, (1, ar, hidden_size), "float32"))
    if image_size is not None:
        inputs += [TensorSpec(IMAGE_INPUTS[0], (1, ar, image_size), "float32"), TensorSpec(IMAGE_INPUTS[1], (1, ar, 1), "float32")]
    return MethodSpec(name, ar, tuple(inputs), tuple(outputs))


def draft_method(contract: RunnerContract, sources: dict[AttentionKind, LayerSpec], hidden_size: int) -> MethodSpec:
    """The IO of one MTP drafter step beside ``contract``'s target (docs/assistant.md).

    Inputs, in order: ``tokens`` int64 [1, 1]; ``hidden`` float [1, 1, hidden_size] (the target's last hidden state,
    or the drafter's previous ``hidden_out``); ``atten_mask`` and ``sliding_atten_mask`` float [1, 1, 1, slots] (the
    cache columns only, `ops.mask.draft_mask`); ``input_pos`` int32 [1, 1]; then the K caches and the V caches of the
    target's source layers (``sources``, full then sliding), named and shaped as in the target's decode method, so the
    host hands the drafter the very buffers the target reads. Outputs: ``logits`` [1, 1, vocab]; ``hidden_out``
    [1, 1, hidden_size].
    """
    if contract.cache_layout is CacheLayout.BLOCKS:
        raise ValueError("A drafter reads its target's caches as one tensor each; the blocks cache layout cuts them "
                         "into several inputs: export the target with --cache-layout full or ring")
    decode = {t.name: t for t in contract.method(DECODE_METHOD).inputs}
    layers = [sources[AttentionKind.FULL], sources[AttentionKind.SLIDING]]
    k = [decode[f"k_cache_{layer.index}"] for layer in layers]
    v = [decode[f"v_cache_{layer.index}"] for layer in layers]
    inputs = [
        TensorSpec("tokens", (1, 1), "int64"),
        TensorSpec("hidden", (1, 1, hidden_size), "float32"),
        TensorSpec("atten_mask", (1, 1, 1, k[0].shape[-1]), "float32"),
        TensorSpec("sliding_atten_mask", (1, 1, 1, k[1].shape[-1]), "float32"),
        TensorSpec("input_pos", (1, 1), "int32"),
        *k,
        *v,
    ]
    outputs = [TensorSpec("logits", (1, 1, contract.vocab_size), "float32"),
               TensorSpec("hidden_out", (1, 1, hidden_size), "float32")]
    return MethodSpec(DRAFT_METHOD, 1, tuple(inputs), tuple(outputs))

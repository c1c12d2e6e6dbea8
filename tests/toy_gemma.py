"""A toy Gemma4-like decoder for the quantization tests (test_quantization, test_quantization_shared): CPU embedding
lookups (token table 4-bit, per-layer table 8-bit) in front; one decoder layer with RMSNorm (weights), q/k norms, a
scale-free v norm, GQA (4 query heads, 1 KV head) over an explicit KV cache with a float additive mask, a GELU-tanh
gated MLP and a per-layer-input gate; final norm, lm_head and logit softcapping. Calibration feeds real cache contents
(the eager model's own K/V of a prefix), as the export pipeline does."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from optimum_qnn.config import EmbeddingQuant
from optimum_qnn.ops.attention import static_gqa
from optimum_qnn.ops.mask import attention_mask
from optimum_qnn.quantization.embedding import QuantizedEmbedding
from optimum_qnn.quantization.kernels import row_gather_lookups

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, PLE_DIM = 1024, 256, 4, 1, 64, 512, 64
CONTEXT = 64
PREFILL_AR = 8


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.double(), actual.double()
    noise = (reference - actual).pow(2).sum()
    return math.inf if noise == 0 else (10 * torch.log10(reference.pow(2).sum() / noise)).item()


class ToyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.q_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.k_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.pre_feedforward_layernorm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.gate_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.up_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=False)  # 512 inputs: the emulator-crash shape at block 64
        self.post_feedforward_layernorm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.per_layer_input_gate = nn.Linear(HIDDEN, PLE_DIM, bias=False)
        self.per_layer_projection = nn.Linear(PLE_DIM, HIDDEN, bias=False)
        self.post_per_layer_input_norm = nn.RMSNorm(HIDDEN, eps=1e-6)

    def forward(self, x, per_layer, mask, k_cache, v_cache):
        ar = x.shape[1]
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h).view(1, ar, HEADS, HEAD_DIM)).transpose(1, 2)
        k = self.k_norm(self.k_proj(h).view(1, ar, KV_HEADS, HEAD_DIM))
        v = F.rms_norm(self.v_proj(h).view(1, ar, KV_HEADS, HEAD_DIM), (HEAD_DIM,), eps=1e-6).transpose(1, 2)
        k_t = k.permute(0, 2, 3, 1)  # keys stored transposed: [1, kv_heads, head_dim, ar]
        attn = static_gqa(q, torch.cat([k_cache, k_t], -1), torch.cat([v_cache, v], 2), mask)
        x = x + self.post_attention_layernorm(self.o_proj(attn))
        h = self.pre_feedforward_layernorm(x)
        mlp = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        x = x + self.post_feedforward_layernorm(mlp)
        gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer
        x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x, k_t, v


class ToyGemma(nn.Module):
    """input_ids (int64), mask [1, 1, ar, C], k_cache [1, 1, hd, C - ar], v_cache [1, 1, C - ar, hd] ->
    softcapped logits [1, ar, V], new k [1, 1, hd, ar], new v [1, 1, ar, hd]."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # Tables stored in bf16, as in the checkpoints: QuantizedEmbedding quantizes from that dtype.
        tokens_table = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16) * 0.05
        per_layer_table = torch.randn(VOCAB, PLE_DIM, dtype=torch.bfloat16) * 0.1
        self.embed_tokens = QuantizedEmbedding(tokens_table, EmbeddingQuant(4, 32))
        self.embed_per_layer = QuantizedEmbedding(per_layer_table, EmbeddingQuant(8, 64))
        self.layer = ToyLayer()
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)

    def forward(self, input_ids, mask, k_cache, v_cache):
        x = self.embed_tokens(input_ids) * HIDDEN**0.5
        per_layer = self.embed_per_layer(input_ids) * PLE_DIM**0.5
        x, k, v = self.layer(x, per_layer, mask, k_cache, v_cache)
        logits = self.lm_head(self.norm(x))
        return torch.tanh(logits / 30.0) * 30.0, k, v


def call_inputs(model: ToyGemma, tokens: torch.Tensor, n_past: int, ar_len: int) -> tuple[torch.Tensor, ...]:
    """Inputs of one static call at position n_past, its cache holding the model's own K/V of tokens[:n_past]."""
    k_cache = torch.zeros(1, KV_HEADS, HEAD_DIM, CONTEXT - ar_len)
    v_cache = torch.zeros(1, KV_HEADS, CONTEXT - ar_len, HEAD_DIM)
    if n_past:
        empty_k, empty_v = torch.zeros(1, KV_HEADS, HEAD_DIM, 0), torch.zeros(1, KV_HEADS, 0, HEAD_DIM)
        with torch.no_grad():
            _, k, v = model(tokens[:, :n_past], torch.from_numpy(attention_mask(n_past, n_past, 0)), empty_k, empty_v)
        k_cache[..., :n_past] = k
        v_cache[:, :, :n_past] = v
    ids = tokens[:, n_past : n_past + ar_len]
    return ids, torch.from_numpy(attention_mask(ar_len, CONTEXT, n_past)), k_cache, v_cache


@dataclass
class Toy:
    model: ToyGemma
    calibration: dict[int, list[tuple[torch.Tensor, ...]]]  # ar_len -> batches
    test_inputs: tuple[torch.Tensor, ...]
    reference: tuple[torch.Tensor, ...]

    def export(self, ar_len: int) -> torch.export.ExportedProgram:
        return torch.export.export(self.model, self.calibration[ar_len][0], strict=True)

    def calibrate(self, ar_len: int):
        def run(prepared: nn.Module) -> None:
            with row_gather_lookups():  # as the exporter calibrates
                for batch in self.calibration[ar_len]:
                    prepared(*batch)

        return run


def make_toy() -> Toy:
    """The toy, its calibration batches (real cache contents) and one decode call's inputs with its eager outputs."""
    model = ToyGemma().eval()
    gen = torch.Generator().manual_seed(1)
    # Enough tokens that the test token's activations fall inside the calibrated ranges (the per-layer gate
    # depends on the token itself): 96 decode tokens, 128 prefill tokens.
    seqs = [torch.randint(0, VOCAB, (1, CONTEXT), generator=gen) for _ in range(8)]
    calibration = {
        1: [call_inputs(model, s, n, 1) for s in seqs for n in range(0, CONTEXT - 1, 5)],
        PREFILL_AR: [call_inputs(model, s, n, PREFILL_AR) for s in seqs[:4] for n in (0, 16, 32, 56)],
    }
    test_seq = torch.randint(0, VOCAB, (1, CONTEXT), generator=gen)
    test_inputs = call_inputs(model, test_seq, 37, 1)
    # Eager lookups as the exporter runs them (calibration): in float32 products, as ExecuTorch's kernel on the
    # device computes them (the Python reference op rounds fp16-scaled products to fp16).
    with torch.no_grad(), row_gather_lookups():
        reference = model(*test_inputs)
    return Toy(model, calibration, test_inputs, reference)

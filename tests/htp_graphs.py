"""Small graphs and a runner shared by the lowering tests (test_lowering, test_edge_lowering, test_htp_pitfalls,
test_parallel_compile, test_partitions, test_by_reference)."""

from __future__ import annotations

import torch
from torch import nn


def run_method(pte, method: str, inputs) -> list[torch.Tensor]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)  # keep the Program alive while its method runs
    return list(program.load_method(method).execute(list(inputs)))


def quantized_mlp(calibration_steps: int) -> tuple[nn.Module, torch.Tensor, torch.fx.GraphModule]:
    """A float MLP, an input, and its 16a8w PT2E graph (QnnQuantizer) calibrated on random inputs and the input."""
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    x = torch.randn(4, 32)
    quantizer = QnnQuantizer(soc_model=QcomChipset.SM8650)
    quantizer.set_default_quant_config(QuantDtype.use_16a8w, is_linear_per_channel=True)
    prepared = prepare_pt2e(torch.export.export(model, (x,), strict=True).module(), quantizer)
    for _ in range(calibration_steps):
        prepared(torch.randn(4, 32))
    prepared(x)
    return model, x, convert_pt2e(prepared)


class _Layer(nn.Module):
    """RMSNorm -> linear -> gelu -> linear, residual: one shard's worth of HTP ops."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.Parameter(torch.rand(dim) + 0.5)
        self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.down(nn.functional.gelu(self.up(h), approximate="tanh"))


class Stack(nn.Module):
    """`layers.N` like the Gemma4 static model, so `shard_starts` cut it between layers."""

    def __init__(self, layers: int = 3, dim: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack_and_inputs():
    torch.manual_seed(0)
    return Stack().eval(), {"prefill_forward": (torch.randn(1, 4, 64),), "kv_forward": (torch.randn(1, 1, 64),)}


def lower_stack(workers: int):
    from optimum_qnn.config import Soc
    from optimum_qnn.exporter.lowering import lower_to_pte

    module, inputs = stack_and_inputs()
    programs = {name: (module, example) for name, example in inputs.items()}
    return lower_to_pte(programs, Soc.SM8650, fp16=True, shard_starts=(1, 2), weight_sharing=False, workers=workers)

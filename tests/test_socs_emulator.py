"""One SoC of each HTP arch (v68 to v81) on the x86 HTP emulator, and what each arch lacks refused or failing as the
SoC table (optimum_qnn.socs.ARCH_LIMITS) says.

The emulator inside onnxruntime-qnn 2.5.0's libQnnHtp.so (QAIRT 2.49.40) compiles and runs a context binary of every
arch from v68 to v81: the x86 package ships no per-arch skel files (those are in its aarch64 / win_arm64 wheels).

One tiny random Gemma4 (tests/gemma4_tiny.py), kv mode, context 32, float graph IO, is loaded and calibrated once per
scheme (8a8w for v68/v69, 16a8w for v73+) and lowered per SoC; each SoC's .pte must give the greedy tokens of the
converted (PT2E fake-quant) graph that was lowered. The arch limits are measured below by lowering a small graph for a
v68 / v69 SoC with the feature ExportConfig refuses, and showing QNN's own failure.
"""

from __future__ import annotations

import pytest
import torch

from optimum_qnn.config import Soc

# One SoC per arch (the boards and laptop the issue names where the arch has one), with the quantized scheme it runs:
# 16-bit activations need v73+ (optimum_qnn.socs.ARCH_LIMITS), so v68 and v69 run 8a8w.
ARCH_SOCS = {68: Soc.QCM6490, 69: Soc.SM8450, 73: Soc.SC8380XP, 75: Soc.SM8650, 79: Soc.SM8750, 81: Soc.SM8845}
SCHEMES = {"8a8w": (68, 69), "16a8w": (73, 75, 79, 81)}
PROMPT = [2, 17, 99, 5, 201, 64]
NEW_TOKENS = 8


def _scheme_of(arch: int) -> str:
    return next(scheme for scheme, archs in SCHEMES.items() if arch in archs)


@pytest.fixture(scope="module")
def exports(random_model_dir, tmp_path_factory, qnn_sdk):
    """arch -> (the export of its SoC at its scheme, the simulation's greedy tokens), built on first use: one arch per
    export, so that each arch's case stands alone."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig
    from optimum_qnn.exporter import pipeline

    built = {}

    def get(arch: int):
        if arch in built:
            return built[arch]
        captured = {}
        original = pipeline._quantize

        def keep(static, programs, *args, **kwargs):
            graphs = original(static, programs, *args, **kwargs)
            captured["tokens"] = simulated_tokens(static.contract, graphs)  # before lowering touches the graphs
            return graphs

        config = ExportConfig(
            socs=(ARCH_SOCS[arch],), quant=QuantScheme.parse(_scheme_of(arch)), mode=ExportMode.KV,
            shapes=ShapeConfig(32, 4), embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False, float_io=True,
        )
        pipeline._quantize = keep
        try:
            result = pipeline.export(random_model_dir, tmp_path_factory.mktemp(f"v{arch}"), config)
        finally:
            pipeline._quantize = original
        built[arch] = result, captured["tokens"]
        return built[arch]

    return get


def greedy(session, n: int) -> list[int]:
    logits = session.feed(torch.tensor(PROMPT))
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = session.feed(torch.tensor(out[-1:]))
    return out


def simulated_tokens(contract, graphs) -> list[int]:
    """Greedy tokens of the converted (PT2E fake-quant) graphs, run through the runner contract as the .pte is."""
    from optimum_qnn.session import KVSession

    methods = {name: (lambda inputs, g=g: g(*inputs)) for name, g in graphs.items()}
    with torch.no_grad():
        return greedy(KVSession(contract, methods), NEW_TOKENS)


# Measured (2026-12-02, random tiny model, prompt PROMPT): v73 SC8380XP 16a8w emulator == simulation
# [102, 155, 84, 161, 103, 31, 179, 40] (3 min 51 s with the cores shared); v75 SM8650, v79 SM8750
# (5 min 6 s for both) and v81 SM8845 (3 min 56 s) the same tokens, equal. v68 QCM6490 and v69 SM8450 at 8a8w both gave
# [64, 178, 222, 17, 219, 235, 3, 102] on the emulator (the same on both archs) against [102, 155, 84, 212, ...] from the
# 8a8w simulation (that run simulated after lowering, in one export for both SoCs; this fixture simulates before
# lowering, one export per arch, not re-run for them yet): the HTP's 8-bit activations part from PT2E's from the first token on this random model (8a8w is
# also the scheme furthest from its fake-quant graph in tests/test_quantization.py, 14-16.5 dB). Not a faked pass:
# the two cases are expected failures until a peaked (trained) model or a closer 8-bit simulation makes them agree.
_EIGHT_BIT_GAP = pytest.mark.xfail(
    strict=True, reason="8a8w: emulator greedy tokens differ from the PT2E simulation from the first token (measured)"
)


@pytest.mark.slow  # an export per arch: 4-10 min each when the 2 cores are shared
@pytest.mark.parametrize("arch", [pytest.param(a, marks=[_EIGHT_BIT_GAP] if _scheme_of(a) == "8a8w" else [])
                                  for a in ARCH_SOCS], ids=[f"v{a}" for a in ARCH_SOCS])
def test_each_arch_runs_on_the_emulator_with_the_simulation_s_tokens(arch, exports):
    from optimum_qnn.artifacts.inspection import inspect_pte
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    scheme = _scheme_of(arch)
    result, expected = exports(arch)
    soc = ARCH_SOCS[arch]
    variant = next(v for v in result.variants if read_manifest(v).target.soc == soc.value)
    assert read_manifest(variant).target.htp_arch == arch and soc.value.lower() in variant.parts
    # What inspect reads from the context binary itself (QNN's SoC model id, the HTP arch), and the model card's row.
    contexts = inspect_pte(next(variant.glob("*.pte"))).contexts
    assert {(c.soc, c.htp_arch) for c in contexts} == {(soc.value, arch)}
    assert f"| {soc.value} | v{arch} |" in (result.output / "README.md").read_text()
    model = QNNModelForCausalLM.from_pretrained(result.output, soc=soc.value, quant=scheme)
    ids = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, len(PROMPT):].tolist()
    print(f"v{arch} {soc.value} {scheme}: emulator {ids}, PT2E simulation {expected}")
    assert ids == expected


# --- what an arch lacks: ExportConfig refuses it; lowering it anyway fails in QNN itself ---------------------------


class _Block(torch.nn.Module):
    """Two linears: with `attention` the product of their outputs (an activation-by-activation MatMul, as Q.K^T),
    else an MLP (64 -> 128, GELU, 128 -> 64)."""

    def __init__(self, attention: bool):
        super().__init__()
        self.attention = attention
        self.q, self.k = torch.nn.Linear(64, 64 if attention else 128), torch.nn.Linear(64 if attention else 128, 64)

    def forward(self, x):
        if self.attention:
            return torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        return self.k(torch.nn.functional.gelu(self.q(x)))


def _lower(soc: Soc, scheme: str, attention: bool = False):
    from optimum_qnn.config import QuantScheme
    from optimum_qnn.exporter.lowering import lower_to_pte
    from optimum_qnn.quantization.pt2e import make_quantizer, quantize

    torch.manual_seed(0)
    x = torch.randn(1, 8, 64)
    program = torch.export.export(_Block(attention).eval(), (x,), strict=True)
    quant = QuantScheme.parse(scheme)
    graph = quantize(program, lambda p: p(x), make_quantizer(quant, soc=soc)) if quant.is_quantized else program.module()
    return lower_to_pte({"forward": (graph, (x,))}, soc, fp16=not quant.is_quantized)


@pytest.mark.parametrize("soc, scheme, attention, qnn_error", [
    (Soc.QCM6490, "16a8w", True, "aten.matmul.default.*was not decomposed or delegated"),
    (Soc.SM8450, "16a8w", True, "aten.matmul.default.*was not decomposed or delegated"),
    (Soc.QCM6490, "16a16w", False, "QNN returned an empty context binary"),
    (Soc.SM8450, "16a16w", False, "QNN returned an empty context binary"),
], ids=["v68-16bit-act-matmul", "v69-16bit-act-matmul", "v68-16a16w", "v69-16a16w"])
def test_a_feature_the_arch_lacks_fails_in_qnn_as_the_table_says(soc, scheme, attention, qnn_error, qnn_sdk):
    """ExportConfig refuses each of these; lowered anyway (below ExportConfig), QNN fails as measured."""
    from optimum_qnn.socs import arch_supports

    assert not arch_supports(soc.htp_arch, scheme)
    with pytest.raises((AssertionError, RuntimeError), match=qnn_error):
        _lower(soc, scheme, attention)


def test_v68_cannot_run_an_fp16_mlp_on_the_htp(qnn_sdk):
    """Two outcomes were measured for the same graph: QNN's op validation refuses the fp16 linears (1x1 convs) and
    GELU, which then run on the CPU (4 partitions); or it accepts them and graph finalize fails ('no properties
    registered for q::QNN_Gelu', then 'Failed to generate Qnn context binary'). Either way no fp16 MLP on a v68 HTP."""
    try:
        lowered = _lower(Soc.QCM6490, "fp16")
    except AssertionError as e:
        assert "Failed to generate Qnn context binary" in str(e)
    else:
        on_cpu = lowered.delegation["forward"].on_cpu
        assert on_cpu.get("aten.convolution.default") == 2 and on_cpu.get("aten.gelu.default") == 1, on_cpu
    assert _lower(Soc.SM8450, "fp16").delegation["forward"].on_cpu == {}  # v69 runs it all


def test_the_same_matmul_lowers_at_8a8w_on_v68_and_at_16a8w_on_v73(qnn_sdk):
    for soc, scheme in ((Soc.QCM6490, "8a8w"), (Soc.SC8380XP, "16a8w")):
        assert _lower(soc, scheme, attention=True).delegation["forward"].on_cpu == {}

"""Several SoCs' variants loaded in one process through ExecuTorch's runtime on the x86 HTP emulator (issue 51).

The emulator cannot create a v81 context while an older arch's context is live (QNN: "lack of HMX threads"; see
optimum_qnn.program.EMULATOR_HMX_ARCH): `LoadedProgram.get` refuses that load with a clear error instead of ExecuTorch's
bare load_method failure, and every other order runs. Loads run in a child process, so a crash fails the test rather
than killing pytest.
"""

from __future__ import annotations

import pytest

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.program import check_emulator_can_add

SOCS = ("SM8750", "SM8850")  # v79, v81

CHILD = r"""
import gc, sys, torch
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.runtime.modeling import QNNModelForCausalLM

folder = sys.argv[1]
ids = torch.tensor([[2, 5, 7]])

def load(soc):
    return QNNModelForCausalLM.from_pretrained(folder, soc=soc, device="host:executorch")

def gen(model):
    return model.generate(ids, max_new_tokens=3, do_sample=False)[0, 3:].tolist()

old = load("SM8750")
print("v79", gen(old), flush=True)
try:
    load("SM8850")
except OptimumQnnError as e:
    print("refused:", e, flush=True)
del old
gc.collect()
new = load("SM8850")  # runs once the older program is freed
print("v81", gen(new), flush=True)
old = load("SM8750")  # and an older arch after a live v81 runs
print("v79 after v81", gen(old), gen(new), flush=True)
"""


@pytest.fixture(scope="module")
def two_arch_export(random_model_dir, tmp_path_factory, qnn_sdk):
    """The random Gemma4, fp16 kv mode, context 32, without weight sharing (the emulator cannot load it), for a v79
    and a v81 SoC."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(
        socs=tuple(Soc.parse(s) for s in SOCS), quant=QuantScheme.FP16, mode=ExportMode.KV,
        shapes=ShapeConfig(32, 4), embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
    )
    return export(random_model_dir, tmp_path_factory.mktemp("two-arch"), config)


def test_v81_after_an_older_arch_is_refused_and_other_orders_run(two_arch_export, run_python):
    proc = run_python("-c", CHILD, str(two_arch_export.output), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 1 and "v81" in refused[0] and "v79" in refused[0] and "host:onnxruntime" in refused[0]
    tokens = {line.split(" [")[0]: line[len(line.split(" [")[0]) + 1:] for line in lines if line.startswith("v")}
    assert tokens["v79"] == tokens["v81"], lines  # the same fp16 graph on both archs
    assert tokens["v79 after v81"] == f"{tokens['v79']} {tokens['v79']}", lines


def test_check_is_as_narrow_as_the_measured_cause():
    with pytest.raises(OptimumQnnError, match="lack of HMX threads"):
        check_emulator_can_add(81, [79], "x.pte", machine="x86_64")
    check_emulator_can_add(81, [81], "x.pte", machine="x86_64")  # v81 next to v81
    check_emulator_can_add(79, [81], "x.pte", machine="x86_64")  # older after v81
    check_emulator_can_add(81, [], "x.pte", machine="x86_64")
    check_emulator_can_add(81, [73, 79], "x.pte", machine="aarch64")  # a real HTP has no emulator limit

"""optimum_qnn.artifacts.inspection: the QNN context binaries of a .pte read back with the QNN System library, and the
weight-shared (phone) build checked against the non-shared (emulator) build of the same export."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.artifacts.inspection import (
    ContextReport,
    GraphReport,
    PteReport,
    QnnInspectError,
    compare_builds,
)
from optimum_qnn.artifacts.inspection.pte import qnn_delegates, strip_context_header
from optimum_qnn.artifacts.inspection.qnn_system import Encoding, TensorInfo

# --- pure: the delegate payload, the comparison ---------------------------------------------------------------


def _payload(binary: bytes, pad_to: int = 256, magic: int = 0x5678ABCD) -> bytes:
    header = struct.pack("<IqQ", magic, 1234, len(binary))
    return header + b"\0" * (pad_to - len(header)) + binary


@pytest.mark.parametrize("pad_to", [256, 20])  # executorch 1.5.1 aligns the binary to 256 bytes; older releases did not
def test_strip_context_header(pad_to):
    binary = bytes(range(200)) * 3
    assert strip_context_header(_payload(binary, pad_to)) == binary


def test_strip_context_header_refuses_other_payloads():
    with pytest.raises(QnnInspectError, match="not the context binary magic 0x5678abcd"):
        strip_context_header(_payload(b"x" * 64, magic=0x1234ABCD))  # the QCIR (online prepare) protocol
    with pytest.raises(QnnInspectError, match="says 4096 bytes of context binary but holds"):
        strip_context_header(struct.pack("<IqQ", 0x5678ABCD, 1, 4096) + b"\0" * 236 + b"x" * 64)  # truncated
    with pytest.raises(QnnInspectError, match="too short"):
        strip_context_header(b"\xcd\xab\x78\x56")


def test_not_a_pte_is_refused_with_the_project_error():
    with pytest.raises(QnnInspectError, match="is not an ExecuTorch program") as info:
        qnn_delegates(b"PK\3\4" + b"\0" * 100, "model.zip")
    assert isinstance(info.value, OptimumQnnError)


def _tensor(name: str, scale: float | None = 0.5) -> TensorInfo:
    encoding = None if scale is None else Encoding("scale_offset", scale, -32768, scale_min=scale, scale_max=scale)
    return TensorInfo(name, "ufixed16" if scale else "float32", [1, 8, 64], encoding)


def _report(shared: bool, *, size: int, pool: int, scale: float = 0.5, graphs=("prefill_forward", "kv_forward")):
    contexts = [ContextReport(
        delegates=["kv_forward[0]", "prefill_forward[0]"], size=size, build_id="v2.49.40.260810104044", soc="SM8650",
        htp_arch=75, weight_sharing=shared, shared_weights_bytes=pool, const_bytes=1000 if shared else pool * 2,
        context_blob_size=size, graphs=[
            GraphReport(g, [_tensor("x"), _tensor("mask", None)], [_tensor("logits", scale)], 500, pool) for g in graphs
        ],
    )]
    return PteReport("model.pte", size + 4096, contexts)


def test_compare_builds_same_graphs_weights_once():
    check = compare_builds(_report(True, size=1_800_000, pool=1_400_000), _report(False, size=3_200_000, pool=0))
    assert check.same_graphs and check.differences == []
    assert (check.saved_bytes, check.shared_weights_bytes) == (1_400_000, 1_400_000)
    assert check.weights_stored_once


def test_compare_builds_reports_a_changed_encoding_and_graph_set():
    check = compare_builds(_report(True, size=1_800_000, pool=1_400_000, scale=0.25), _report(False, size=3_200_000, pool=0))
    assert not check.same_graphs
    assert check.differences == [
        "context 0 graph prefill_forward output logits: ufixed16 [1, 8, 64] scale=0.25 offset=-32768 vs logits: "
        "ufixed16 [1, 8, 64] scale=0.5 offset=-32768",
        "context 0 graph kv_forward output logits: ufixed16 [1, 8, 64] scale=0.25 offset=-32768 vs logits: "
        "ufixed16 [1, 8, 64] scale=0.5 offset=-32768",
    ]
    other = compare_builds(_report(True, size=1, pool=1, graphs=("prefill_forward",)), _report(False, size=2, pool=0))
    assert other.differences == ["context 0: graphs ['prefill_forward'] vs ['prefill_forward', 'kv_forward']"]


def test_compare_builds_notices_weights_stored_twice():
    # A "shared" build no smaller than the other: its pool is not what it saves.
    check = compare_builds(_report(True, size=3_100_000, pool=1_400_000), _report(False, size=3_200_000, pool=0))
    assert check.same_graphs and not check.weights_stored_once


def test_encoding_summaries():
    assert Encoding("scale_offset", 0.0123, -128).summary() == "scale=0.0123 offset=-128"
    per_channel = Encoding("bw_axis_scale_offset", 0.01, 0, bitwidth=4, axis=3, count=64, scale_min=0.001, scale_max=0.02)
    assert per_channel.summary() == "4-bit bw_axis_scale_offset x64 axis 3, scales 0.001..0.02"


# --- a real hybrid 16a8w export of the demo model, shared and not ---------------------------------------------

CTX, PREFILL = 64, 8


@pytest.fixture(scope="module")
def sharing_export(demo_model_dir, tmp_path_factory, qnn_sdk):
    """One 16a8w hybrid export with weight sharing and `check_weight_sharing`: calibrated once, lowered twice. The
    non-shared lowering the export compares against is also written to disk, so the test reads both files itself."""
    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    import optimum_qnn.artifacts.inspection as inspection
    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    work = tmp_path_factory.mktemp("sharing")
    unshared_pte = work / "unshared.pte"
    real = inspection.export_time_inspection

    def keep_unshared(buffer, lower_unshared=None):
        def lower():
            data = lower_unshared()
            unshared_pte.write_bytes(data)
            return data

        return real(buffer, lower if lower_unshared else None)

    calib = work / "calib.txt"
    calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:4]))
    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.A16W8, mode=ExportMode.HYBRID, shapes=ShapeConfig(CTX, PREFILL),
        embedding_quant=EmbeddingQuant(8, 0), weight_sharing=True,
    )
    mp = pytest.MonkeyPatch()
    mp.setattr(inspection, "export_time_inspection", keep_unshared)
    try:
        result = export(
            demo_model_dir, work / "out", config, calibration=CalibrationSource(file=calib, limit=4),
            check_weight_sharing=True,
        )
    finally:
        mp.undo()
    print(result.stage_table())
    (variant,) = result.variants
    return variant, unshared_pte


@pytest.mark.slow  # two QNN lowerings of the demo model: about 4.5 min on an idle 2-core machine
def test_shared_and_unshared_builds_hold_the_same_graphs(sharing_export):
    from optimum_qnn.artifacts.inspection import inspect_pte
    from optimum_qnn.artifacts.manifest import read_manifest

    variant, unshared_pte = sharing_export
    shared, unshared = inspect_pte(variant / "model.pte"), inspect_pte(unshared_pte)
    print(shared.to_text(), unshared.to_text(), sep="\n\n")

    for report, sharing in ((shared, True), (unshared, False)):
        (context,) = report.contexts  # both methods' graphs in one context
        assert context.delegates == ["kv_forward[0]", "prefill_forward[0]"]
        assert (context.soc, context.htp_arch, context.weight_sharing) == ("SM8650", 75, sharing)
        assert context.build_id.startswith("v2.49.40.")
        assert sorted(g.name for g in context.graphs) == ["kv_forward", "prefill_forward"]
        graphs = {g.name: g for g in context.graphs}
        # The runner contract's shapes: prefill takes PREFILL tokens per call, decode one; masks span the context.
        assert [t.shape for t in graphs["prefill_forward"].inputs if t.name.endswith("atten_mask@0")] == [[1, 1, PREFILL, CTX]] * 2
        assert [t.shape for t in graphs["kv_forward"].inputs if t.name.endswith("atten_mask@0")] == [[1, 1, 1, CTX]] * 2
        assert graphs["prefill_forward"].outputs[-1].shape[:2] == [1, PREFILL]  # the logits
        # The graph's memory needs as QNN reports them: no spill-fill at this size; its IO buffers hold at least the
        # IO tensors' own bytes (the HTP pads them; a weight-shared context reports one size for both graphs).
        element = {"ufixed16": 2, "ufixed8": 1, "float32": 4, "float16": 2, "int32": 4}
        for g in graphs.values():
            tensors = sum(math.prod(t.shape) * element[t.dtype] for t in (*g.inputs, *g.outputs))
            assert g.spill_fill_bytes == 0 and g.op_data_bytes > 0 and g.io_bytes >= tensors, (g.name, g.io_bytes, tensors)

    check = compare_builds(shared, unshared)
    assert check.same_graphs, check.differences
    # Weights stored once: the shared context is smaller by about one copy of the HTP weights (its pool), and the
    # non-shared context keeps a copy per graph.
    pool = shared.contexts[0].shared_weights_bytes
    assert pool > 1_000_000 and unshared.contexts[0].shared_weights_bytes == 0
    assert abs(check.saved_bytes - pool) <= 0.1 * pool, (check.saved_bytes, pool)
    assert unshared.contexts[0].const_bytes >= 1.8 * pool > 20 * shared.contexts[0].const_bytes
    assert check.weights_stored_once
    print(f"shared {check.shared_size} B, not shared {check.unshared_size} B, saved {check.saved_bytes} B, pool {pool} B")

    # The export ran the same check and recorded it, with the contexts, in the manifest.
    recorded = read_manifest(variant).inspection
    assert recorded is not None and recorded.sharing_check is not None
    assert recorded.sharing_check.same_graphs and recorded.sharing_check.weights_stored_once
    assert (recorded.sharing_check.shared_size, recorded.sharing_check.unshared_size) == (check.shared_size, check.unshared_size)
    (ctx,) = recorded.contexts
    assert (ctx.soc, ctx.htp_arch, ctx.weight_sharing, ctx.size) == ("SM8650", 75, True, shared.contexts[0].size)
    assert [g.name for g in ctx.graphs] == [g.name for g in shared.contexts[0].graphs]

    # The phone build itself, loaded on this x86 host: refused with the fix before anything loads.
    from optimum_qnn.errors import OptimumQnnError
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    root = next(p for p in variant.parents if (p / "qnn_index.json").is_file())
    with pytest.raises(OptimumQnnError, match="x86 HTP emulator cannot load.*--no-weight-sharing"):
        QNNModelForCausalLM.from_pretrained(root)


def test_inspect_command_text_and_json(fp16_export, run_python):
    from optimum_qnn.artifacts.manifest import read_manifest

    (variant,) = fp16_export.variants  # fp16 hybrid, weights not shared
    result = run_python("-m", "optimum_qnn", "inspect", str(variant / "model.pte"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # nothing but the JSON: the QNN libraries' own chatter goes to stderr
    (context,) = report["contexts"]
    assert (context["soc"], context["htp_arch"], context["weight_sharing"]) == ("SM8650", 75, False)
    assert context["shared_weights_bytes"] == 0 and context["const_bytes"] > 0
    graphs = {g["name"]: g for g in context["graphs"]}
    assert set(graphs) == {"prefill_forward", "kv_forward"}
    manifest = read_manifest(variant)
    for method in manifest.contract.methods:  # the context's graph IO is the runner contract's, in shape
        shapes = sorted(t["shape"] for t in graphs[method.name]["inputs"])
        assert [t.shape for t in method.inputs if t.name == "input_pos"][0] in shapes
    # Every export records the same facts in its manifest (no shared/non-shared check was asked for).
    assert manifest.inspection is not None and manifest.inspection.sharing_check is None
    (recorded,) = manifest.inspection.contexts
    assert (recorded.size, recorded.weight_sharing) == (context["size"], False)
    text = run_python("-m", "optimum_qnn", "inspect", str(variant))  # a variant folder works too
    assert text.returncode == 0, text.stderr
    assert "target    SM8650, HTP v75" in text.stdout and "weights   per graph" in text.stdout


def test_inspect_command_refuses_a_file_that_is_not_a_pte(tmp_path, run_python):
    bad = tmp_path / "model.pte"
    bad.write_bytes(b"not a program" * 10)
    result = run_python("-m", "optimum_qnn", "inspect", str(bad))
    assert result.returncode == 2
    assert f"error: {bad} is not an ExecuTorch program" in result.stderr


def test_inspection_does_not_import_the_exporter(fp16_export, run_python):
    (variant,) = fp16_export.variants
    code = (
        "import sys\n"
        "from optimum_qnn.artifacts.inspection import inspect_pte\n"
        f"assert inspect_pte({str(variant / 'model.pte')!r}).contexts\n"
        # (`import torch` itself loads torch.export; what must stay out is the exporter and ExecuTorch's exir)
        "bad = [m for m in sys.modules if m.startswith(('optimum_qnn.exporter.pipeline', 'optimum_qnn.quantization.pt2e', "
        "'optimum_qnn.exporter.lowering', 'optimum_qnn.quantization.calibration', 'executorch.exir', 'torchao'))]\n"
        "assert not bad, bad\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr

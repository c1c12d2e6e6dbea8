"""benchmarks/lowering_profile.py's attribution of py-spy samples (the per-pass profile of issue 31 rests on it)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import lowering_profile  # noqa: E402

ROOT = 'process 11:"python optimum-cli export qnn"'
EXPORT = "export (optimum_qnn/exporter/pipeline.py:170);_export (optimum_qnn/exporter/pipeline.py:260)"
LOWER = f"{ROOT};<module> (optimum-cli:6);{EXPORT};lower_to_pte (optimum_qnn/exporter/lowering.py:240)"


def test_samples_go_to_their_process_stage_and_step(tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text("\n".join([
        # the edge passes under to_edge's wrapper: named by the pass below it
        f"{LOWER};_to_edge_and_lower (optimum_qnn/exporter/lowering.py:370);wrapper (exir/program/_program.py:116)"
        ";_ExportPassBaseDeprecatedDoNotUse.call (exir/pass_base.py:600)"
        ";ScalarToTensorPass.call (exir/passes/scalar_to_tensor_pass.py:20) 30",
        # a forked shard compile
        f"{LOWER};_compile_and_exit (optimum_qnn/exporter/parallel_compile.py:346)"
        ";preprocess_multimethod (backends/qualcomm/qnn_preprocess.py:90) 50",
        # a method of a stage's class, and a thread that waits
        f"{ROOT};{EXPORT};VariantWriter.write_variant (optimum_qnn/artifacts/writer.py:200);sha256 (hashlib.py:1) 4",
        f"{ROOT};Thread._bootstrap (threading.py:1002);_RssSampler.run (optimum_qnn/exporter/pipeline.py:95)"
        ";Event.wait (threading.py:629) 7",
        # the SoC-independent part of the lowering, done once for every SoC
        f"{ROOT};{EXPORT};EdgeLowering.prepare (optimum_qnn/exporter/lowering.py:300)"
        ";to_edge (optimum_qnn/exporter/edge.py:100);wrapper (exir/program/_program.py:116)"
        ";RemoveRedundancy.call (backends/qualcomm/_passes/remove_redundancy.py:40) 6",
        "malformed line",
    ]))
    counts = lowering_profile.read(profile)
    assert dict(counts) == {
        ("main", "lower", "scalar_to_tensor_pass.ScalarToTensorPass.call"): 30,  # the pass, not to_edge's wrapper
        ("worker", "lower", "parallel_compile._compile_and_exit"): 50,  # a forked compile is the worker's
        ("main", "write", "hashlib.sha256"): 4,  # a stage's method (py-spy names it Class.method)
        ("idle", "waiting", "Event.wait"): 7,  # a waiting thread is not CPU time
        ("main", "edge", "remove_redundancy.RemoveRedundancy.call"): 6,  # EdgeLowering.prepare's pass
    }
    text = lowering_profile.table(counts, rate=10, top=10)
    assert text.splitlines()[0] == "9 CPU s sampled at 10 Hz (and 1 s of threads waiting, left out)", text
    assert "| worker | lower | 5 | 55.6% |" in text, text

"""The onnxruntime backend's engine (`OrtProgram`) against ExecuTorch's own runtime, on the x86 HTP emulator.

Every comparison is byte for byte: the same .pte, the same inputs, the outputs' bytes equal (no tolerance).
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from optimum_qnn.artifacts.manifest import read_manifest
from optimum_qnn.errors import OptimumQnnError
from tests.runtime.backends.ort_helpers import contract_inputs, executorch_outputs, same_bytes, variant_dirs

CALLS = 2  # calls per method, with different inputs: a state leak between calls would show


def _program(folder: Path):
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram

    return OrtProgram(folder / "model.pte", read_manifest(folder))


def _assert_identical(folder: Path, expect_ops: set[str]) -> None:
    from optimum_qnn.artifacts.inspection.pte_plan import KernelCall, read_plans

    manifest = read_manifest(folder)
    program = _program(folder)
    plans = read_plans((folder / "model.pte").read_bytes())
    assert set(program.methods) == {m.name for m in manifest.contract.methods}
    for method in manifest.contract.methods:
        plan = plans[method.name]
        cpu_ops = {plan.operators[s.op] for s in plan.instructions if isinstance(s, KernelCall)}
        assert cpu_ops == expect_ops, f"{method.name} runs {cpu_ops} on the CPU"
        for seed in range(CALLS):
            inputs = contract_inputs(manifest, method.name, seed)
            ours = program.methods[method.name](inputs)
            theirs = executorch_outputs(folder, method.name, inputs)
            assert [o.name for o in method.outputs] and len(ours) == len(theirs) == len(method.outputs)
            for spec, a, b in zip(method.outputs, ours, theirs):
                assert same_bytes(a, b), f"{method.name} call {seed}: {spec.name} differs from ExecuTorch's"
                assert a.dtype == np.dtype(spec.dtype) and a.shape == tuple(spec.shape)
    assert program.calls == CALLS * len(manifest.contract.methods) and program.exec_seconds > 0
    assert program.load_seconds > 0


def test_fp16_hybrid_identical(fp16_export):
    """fp16, float embedding tables: the CPU side is `aten::embedding`."""
    (folder,) = variant_dirs(fp16_export.output)
    _assert_identical(folder, {"aten::embedding.out"})


def test_16a8w_hybrid_identical(a16w8_export):
    """16a8w with 8-bit tables: `embedding_byte`, uint16 caches and masks at the graph boundary."""
    (folder,) = variant_dirs(a16w8_export("hybrid"))
    _assert_identical(folder, {"quantized_decomposed::embedding_byte.dtype_out"})


def test_16a8w_two_shards_identical(cli_16a8w_export):
    """Two shards per method: two contexts, each holding prefill and decode, chained through `llama::fallback`."""
    (folder,) = variant_dirs(cli_16a8w_export[0])
    assert read_manifest(folder).contract.shards == 2
    _assert_identical(folder, {"quantized_decomposed::embedding_byte.dtype_out", "llama::fallback.out"})


def test_kv_mode_identical(demo_kv_export):
    """kv mode: the decode method only."""
    (folder,) = variant_dirs(demo_kv_export)
    assert [m.name for m in read_manifest(folder).contract.methods] == ["kv_forward"]
    _assert_identical(folder, {"aten::embedding.out"})


def test_16a4w_block_4bit_tables_identical(block4_export):
    """16a4w_block weights, 4-bit embedding tables in groups of 32: `embedding_4bit` unpacks nibbles."""
    (folder,) = variant_dirs(block4_export)
    _assert_identical(folder, {"quantized_decomposed::embedding_4bit.dtype_out"})


def test_unknown_cpu_op_refused_at_load(a16w8_export, tmp_path):
    """A program whose CPU side holds an op the backend has no kernel for is refused when loaded, by the op's
    name, before any session is created. The op is made by renaming `embedding_byte` in the file (same length, so
    the flatbuffer stays valid)."""
    from optimum_qnn.runtime.backends.onnxruntime import OrtBackendError, OrtProgram

    (folder,) = variant_dirs(a16w8_export("hybrid"))
    data = (folder / "model.pte").read_bytes()
    name = b"quantized_decomposed::embedding_byte"
    assert data.count(name) >= 1
    (tmp_path / "model.pte").write_bytes(data.replace(name, b"quantized_decomposed::embedding_bytx"))
    with pytest.raises(OrtBackendError) as e:
        OrtProgram(tmp_path / "model.pte", read_manifest(folder))
    message = str(e.value)
    assert "quantized_decomposed::embedding_bytx.dtype_out" in message
    assert "ExecuTorch backend" in message and "has no kernel" in message


@pytest.mark.parametrize("damage", ["truncated", "root_offset", "not_a_program"])
def test_corrupt_pte_refused(a16w8_export, tmp_path, damage):
    """A damaged file is refused with an OptimumQnnError that says to export again; the process survives."""
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram

    (folder,) = variant_dirs(a16w8_export("hybrid"))
    data = bytearray((folder / "model.pte").read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "root_offset":
        data[0:4] = (len(data) + 4096).to_bytes(4, "little")  # the root table points past the end
    else:
        data[4:8] = b"XXXX"
    (tmp_path / "model.pte").write_bytes(bytes(data))
    with pytest.raises(OptimumQnnError, match="corrupt|not an ExecuTorch program"):
        OrtProgram(tmp_path / "model.pte", read_manifest(folder))


def test_weight_shared_refused_before_loading(a16w8_export, tmp_path):
    """A weight-shared variant on the x86 emulator is refused with QNN's reason and the fix, before the file is
    even opened (the path given does not exist)."""
    from optimum_qnn.program import is_emulator_host
    from optimum_qnn.runtime.backends.onnxruntime import OrtBackendError, OrtProgram

    if not is_emulator_host():
        pytest.skip("the refusal is for the x86 HTP emulator")
    (folder,) = variant_dirs(a16w8_export("hybrid"))
    manifest = read_manifest(folder)
    shared = dataclasses.replace(manifest, contract=dataclasses.replace(manifest.contract, weight_sharing=True))
    with pytest.raises(OrtBackendError) as e:
        OrtProgram(tmp_path / "missing.pte", shared)
    assert "Shared weights buffer isn't supported on this platform" in str(e.value)
    assert "--no-weight-sharing" in str(e.value)


def test_wrong_input_refused(a16w8_export):
    """An input of the wrong dtype is refused with the contract's spec, not passed to QNN as wrong bytes."""
    from optimum_qnn.runtime.backends.onnxruntime import OrtBackendError

    (folder,) = variant_dirs(a16w8_export("hybrid"))
    manifest = read_manifest(folder)
    program = _program(folder)
    inputs = contract_inputs(manifest, "kv_forward", 0)
    inputs[0] = inputs[0].astype(np.int32)
    with pytest.raises(OrtBackendError, match="tokens must be int64"):
        program.methods["kv_forward"](inputs)


def test_several_variants_in_one_process(random_kv_export, a16w8_export, fp16_export):
    """Three SoCs of one export plus two more variants, loaded side by side in one process, and the first loaded
    still answers like ExecuTorch after the others loaded (each context loads once; graph names repeat across them)."""
    folders = [*variant_dirs(random_kv_export.output), *variant_dirs(a16w8_export("hybrid")),
               *variant_dirs(fp16_export.output)]
    assert len(folders) == 5
    programs = [_program(f) for f in folders]
    for folder, program in zip(folders, programs):
        manifest = read_manifest(folder)
        method = manifest.contract.methods[0].name
        outputs = program.methods[method](contract_inputs(manifest, method, 1))
        assert len(outputs) == len(manifest.contract.methods[0].outputs)
    first = folders[0]
    inputs = contract_inputs(read_manifest(first), "kv_forward", 3)
    ours = programs[0].methods["kv_forward"](inputs)
    assert all(same_bytes(a, b) for a, b in zip(ours, executorch_outputs(first, "kv_forward", inputs)))


def test_asymmetric_4bit_tables_identical(asym4_kv_export):
    """Asymmetric tables: the zero points are subtracted in float32 before the scale, as ExecuTorch's kernel does."""
    from optimum_qnn.artifacts.inspection.pte_plan import read_plans

    (folder,) = variant_dirs(asym4_kv_export)
    plan = read_plans((folder / "model.pte").read_bytes())["kv_forward"]
    assert any(v is not None for v in (plan.values[s.args[2]] for s in plan.instructions if hasattr(s, "op")))
    _assert_identical(folder, {"quantized_decomposed::embedding_4bit.dtype_out"})


def test_check_program_file_reads_the_file_only(asym4_kv_export, tmp_path):
    """`check_program_file` (doctor's question) passes a program the backend runs and refuses one with an op it has
    no kernel for, naming it, from the file alone: the doctored copy sits where no manifest is (nothing is loaded).
    Before the errors were raised after the file's map closed, this refusal came out as "BufferError: cannot close
    exported pointers exist" (the plans and the traceback held views of the map), and doctor, which catches the
    project's errors, would have crashed on it."""
    from optimum_qnn.runtime.backends.onnxruntime.program import check_program_file
    from optimum_qnn.sdk.onnxruntime_ep import OrtBackendError

    (folder,) = variant_dirs(asym4_kv_export)
    check_program_file(folder / "model.pte")
    data = (folder / "model.pte").read_bytes()
    name = b"quantized_decomposed::embedding_4bit"
    assert data.count(name) >= 1
    (tmp_path / "model.pte").write_bytes(data.replace(name, b"quantized_decomposed::embedding_4bix"))
    with pytest.raises(OrtBackendError, match=r"method kv_forward runs quantized_decomposed::embedding_4bix\S* on the "
                                              r"CPU, which the onnxruntime backend has no kernel for"):
        check_program_file(tmp_path / "model.pte")
    # A damaged file: read_plans' own error, raised once the map is closed (not "cannot close exported pointers").
    (tmp_path / "model.pte").write_bytes(data[: len(data) // 2])
    with pytest.raises(OptimumQnnError, match="segment 1 of method kv_forward runs past the end of the file"):
        check_program_file(tmp_path / "model.pte")
    with pytest.raises(OSError):
        check_program_file(tmp_path / "missing.pte")


def test_contexts_load_from_scratch_files_not_python_bytes(a16w8_export):
    """Issue 51: no session keeps a Python copy of a context (onnxruntime's InferenceSession holds the bytes it was
    given for its whole life: one full context each, 0.62 GB of 2.68 GB RSS on one Gemma-4-E2B shard), the models name
    their context file instead of embedding it (`embed_mode=0`), the scratch files are gone once the program has
    loaded, and the program still answers like ExecuTorch without them. A scratch folder a crashed load left behind
    (older than a day) is removed by the next load; a recent one (another process loading) is not."""
    from optimum_qnn.runtime.backends.onnxruntime.program import SCRATCH_MAX_AGE_S, scratch_folder

    (folder,) = variant_dirs(a16w8_export("hybrid"))
    scratch_root = scratch_folder()
    stale, busy = scratch_root / "context-stale-test", scratch_root / "context-busy-test"
    for made in (stale, busy):
        (made / "context.bin").parent.mkdir(exist_ok=True)
        (made / "context.bin").write_bytes(b"left behind")
    old = time.time() - SCRATCH_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    before = set(scratch_root.iterdir()) - {stale}
    try:
        program = _program(folder)
        assert len(program._sessions) == 2  # prefill and decode of one context
        assert all(s._model_bytes is None and s._model_path for s in program._sessions)
        assert set(scratch_root.iterdir()) == before  # the stale folder and this load's own are gone, the busy one kept
    finally:
        for made in (stale, busy):
            if made.exists():
                (made / "context.bin").unlink()
                made.rmdir()
    inputs = contract_inputs(read_manifest(folder), "kv_forward", 2)
    ours = program.methods["kv_forward"](inputs)
    assert all(same_bytes(a, b) for a, b in zip(ours, executorch_outputs(folder, "kv_forward", inputs)))


def test_contexts_beyond_the_emulators_htp_memory_refused_before_loading(a16w8_export, monkeypatch):
    """A program whose contexts need more HTP memory than the x86 emulator's one protection domain holds (full-size
    E2B at 32K, unshared: 5.5 GB) is refused by the onnxruntime backend before QNN creates a context, and explained
    when ExecuTorch's load fails, with the fix; the need counted is each graph's constants, IO, spill-fill and op
    data, as `inspect` reads them."""
    import onnxruntime

    import optimum_qnn.program as program
    from optimum_qnn.artifacts.inspection import inspect_pte, program_load_bytes
    from optimum_qnn.runtime.backends.host import ExecuTorchBackend
    from optimum_qnn.runtime.backends.onnxruntime import OrtProgram

    (folder,) = variant_dirs(a16w8_export("hybrid"))
    pte = folder / "model.pte"
    report = inspect_pte(pte)
    graphs = [g for c in report.contexts for g in c.graphs]
    need = sum(g.const_bytes + g.io_bytes + g.spill_fill_bytes + g.op_data_bytes for g in graphs)
    assert len(graphs) == 2 and program_load_bytes(pte) == need > 0
    assert f"HTP load {need / 2**20:.2f} MB" in report.to_text()  # what `inspect` prints
    program.check_emulator_can_hold(need, "x.pte", machine="x86_64")  # at the limit it fits
    monkeypatch.setattr(program, "EMULATOR_PD_BYTES", need - 1)
    program.check_emulator_can_hold(need, "x.pte", machine="aarch64")  # a Snapdragon has several domains
    if not program.is_emulator_host():
        pytest.skip("the refusal is for the x86 HTP emulator")

    def no_session(*args, **kwargs):
        raise AssertionError("a QNN context was loaded")

    monkeypatch.setattr(onnxruntime, "InferenceSession", no_session)
    with pytest.raises(OptimumQnnError, match=r"more than the x86 HTP emulator holds.*--mode kv"):
        OrtProgram(pte, read_manifest(folder))
    def qnn_fails(*args, **kwargs):  # what ExecuTorch raises when QNN cannot place a context (error 1002)
        raise RuntimeError("Failed to load method prefill_forward, error: 0x:1")

    monkeypatch.setattr(program, "load_program", qnn_fails)
    monkeypatch.setattr(program.LoadedProgram, "_live", weakref.WeakValueDictionary())  # not the suite's live copy
    with pytest.raises(OptimumQnnError, match=r"more than the x86 HTP emulator holds.*--mode kv"):
        ExecuTorchBackend(folder, read_manifest(folder))

"""The export's memory estimate (optimum_qnn.exporter.memory): parameter counts from the config alone, the fit against the
exports measured on this machine, the shard count chosen from it, and the refusal before any weight is read.
No export runs here."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import sys
from pathlib import Path

import pytest

from optimum_qnn.config import (
    EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, WeightRanges, WeightRounding, recipe_fields,
)
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.memory import (
    FIT_ERROR_GB,
    FIT_MAX_ERROR_GB,
    GB_BYTES,
    CgroupFiles,
    available_memory,
    choose_memory_plan,
    default_budget_gib,
    estimate,
)
from optimum_qnn.exporter.parameters import (
    HTP_CONTEXT_WEIGHTS_GB,
    SHARD_PARAMS,
    ParameterCounts,
    fewest_loadable_shards,
    fewest_shards_per_call,
    shard_weights_gb,
)
from optimum_qnn.models.gemma4.loading import read_text_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import memory_fit  # noqa: E402
from e2b_width import e2b_config, e4b_config  # noqa: E402

# The exports memory.py is fitted to: E2B widths at 2 and 7 layers, the full E2B and the full E4B
# (benchmarks/memory_rows.json, fitted by benchmarks/memory_fit.py).
E2B_ROWS = [(row["counts"], tuple(row["starts"]), row["stages"]) for row in memory_fit.load_rows()]
# The configuration of those rows.
E2B_BENCH = ExportConfig(quant=QuantScheme.A16W4_BLOCK, mode=ExportMode.HYBRID, shapes=ShapeConfig(1024, 128),
                         embedding_quant=EmbeddingQuant(4, 32))


@pytest.fixture(scope="module")
def e2b() -> ParameterCounts:
    return ParameterCounts.from_config(e2b_config())


def measured_rows():
    """(counts, config, shards, {stage: measured anonymous GB}) for every measured export the fit is meant to
    reproduce."""
    for counts, starts, measured in E2B_ROWS:
        yield counts, E2B_BENCH, starts, measured
    (demo,) = memory_fit.load_rows("demo")
    demo_config = ExportConfig(quant=QuantScheme.A16W8, shapes=ShapeConfig(128, 16), embedding_quant=EmbeddingQuant(8, 0))
    yield demo["counts"], demo_config, (), {k: demo["stages"][k] for k in ("load", "lower")}


def test_parameter_counts_of_e2b_from_its_config(e2b):
    # docs/exporting.md, "Export memory": the tables are 2.75 B of E2B's 4.63 B parameters.
    assert round(e2b.tables / 1e9, 2) == 2.75 and round(e2b.total / 1e9, 2) == 4.63
    assert len(e2b.layers) == 35 and e2b.stored_bytes == 2  # bf16, as published
    # The last 20 layers reuse an earlier layer's KV and have a double-wide MLP (12288): bigger than the first.
    assert e2b.layers[34] > e2b.layers[0] and e2b.layers[15] > e2b.layers[14]
    # One shard holds everything; 35 shards: the largest is the last layer plus the lm_head (vocab x hidden).
    assert e2b.largest_shard(()) == e2b.htp
    assert e2b.largest_shard(tuple(range(1, 35))) == e2b.layers[34] + 262144 * 1536


def test_estimate_reproduces_every_measured_stage():
    checked = 0
    for counts, config, starts, measured in measured_rows():
        est = estimate(counts, config, len(starts) + 1, starts=starts)  # split as the row was measured
        for stage, gb in measured.items():
            where = (len(counts.layers), starts, stage, est.stages[stage], gb)
            # what docs/exporting.md ("Export memory") and memory.py state: within FIT_MAX_ERROR_GB either way, and never
            # below a measured peak by more than the FIT_ERROR_GB a shard choice keeps to spare (else a chosen plan overruns)
            assert abs(est.stages[stage] - gb) <= FIT_MAX_ERROR_GB, where
            assert est.stages[stage] >= gb - FIT_ERROR_GB, where
            checked += 1
    assert checked == len(E2B_ROWS) * 8 + 2


def test_estimate_grows_with_what_the_rows_did_not_vary(e2b):
    base = estimate(e2b, E2B_BENCH, 4)
    wider = estimate(e2b, dataclasses.replace(E2B_BENCH, quant=QuantScheme.A16W8), 4)
    float_tables = estimate(e2b, dataclasses.replace(E2B_BENCH, embedding_quant=EmbeddingQuant(0, 0)), 4)
    evaluated = estimate(e2b, E2B_BENCH, 4, evaluate=True)
    for other in (wider, float_tables, evaluated):
        assert other.peak > base.peak and other.lowering > base.lowering
    # 8-bit weights: half a byte more per HTP parameter, at least.
    assert wider.lowering - base.lowering >= e2b.htp * 0.5 / 2**30
    fp16 = estimate(e2b, dataclasses.replace(E2B_BENCH, quant=QuantScheme.FP16, embedding_quant=None), 1)
    assert "calibrate" not in fp16.stages and "quantize" not in fp16.stages
    # More shards: a smaller largest shard, a lower lowering peak; the other stages do not change.
    one, many = estimate(e2b, E2B_BENCH, 1), estimate(e2b, E2B_BENCH, 35)
    assert one.lowering > many.lowering + 5 and one.stages["quantize"] == many.stages["quantize"]


def test_shards_are_balanced_by_parameters(e2b):
    """The lm_head rides in the last shard and the later E2B layers are wider: even layer counts put 1186 M
    parameters in the last of 3 shards. The split takes the smallest largest shard any split of contiguous layers
    has (checked against every split), and the others about as even as that leaves them."""
    def sizes(starts):
        return e2b.shard_sizes(tuple(starts))

    assert max(sizes((12, 23))) > 1.18e9  # the even split the exporter made before
    for shards in (3, 4):
        best = min(max(sizes(starts)) for starts in itertools.combinations(range(1, 35), shards - 1))
        chosen = sizes(e2b.shard_starts(shards))
        assert len(chosen) == shards and max(chosen) == best and sum(chosen) == e2b.htp
    assert max(sizes(e2b.shard_starts(3))) < 0.8e9 and max(sizes(e2b.shard_starts(4))) < 0.6e9
    # 7 shards: the lm_head's (and one layer) is the largest any split can have; the others share the rest evenly
    # rather than leaving one-layer shards behind
    seven = sizes(e2b.shard_starts(7))
    assert max(seven) == e2b.layers[34] + e2b.token_table and min(seven) > 0.25e9
    assert e2b.shard_starts(1) == () and e2b.shard_starts(35) == tuple(range(1, 35))
    with pytest.raises(InvalidInputError, match="--shards 36 must be between 1 and the model's 35"):
        e2b.shard_starts(36)


def test_auto_shards_pick_one_for_the_demo_and_executorch_s_per_shard_size_for_e2b(demo_model_dir, e2b):
    demo = ParameterCounts.from_config(read_text_config(demo_model_dir))
    assert choose_memory_plan(demo, ExportConfig(max_memory=24)).estimate.shards == 1
    # ExecuTorch's own E2B build: 4 shards; balanced, each within SHARD_PARAMS, 3 would not be
    assert fewest_shards_per_call(e2b) == 4
    assert e2b.largest_shard(e2b.shard_starts(4)) <= SHARD_PARAMS < e2b.largest_shard(e2b.shard_starts(3))
    for quant in (QuantScheme.A16W8, QuantScheme.A16W4_BLOCK):  # the default scheme, and the issue's
        for budget in (24, 64):  # memory would allow fewer: the per-call size decides
            config = ExportConfig(quant=quant, max_memory=budget)
            plan = choose_memory_plan(e2b, config)
            assert plan.estimate.shards == 4 and plan.auto and estimate(e2b, config, 3).peak + FIT_ERROR_GB <= budget
            assert plan.estimate.starts == e2b.shard_starts(4)
            assert "at least 4 for ExecuTorch's per-shard size (600 M parameters)" in plan.summary()
    # Where memory needs more, memory decides: the fewest that fit, one fewer would not
    config = ExportConfig(quant=QuantScheme.A16W4_BLOCK, max_memory=6.5)
    shards = choose_memory_plan(e2b, config).estimate.shards
    assert shards > 4 and estimate(e2b, config, shards - 1).peak + FIT_ERROR_GB > 6.5


def test_a_given_shard_count_is_kept_and_checked(e2b):
    plan = choose_memory_plan(e2b, ExportConfig(quant=QuantScheme.A16W4, shards=35, max_memory=16))
    assert plan.estimate.shards == 35 and not plan.auto
    with pytest.raises(InvalidInputError, match="leave --shards out to let the exporter choose"):
        choose_memory_plan(e2b, ExportConfig(quant=QuantScheme.A16W4, shards=1, max_memory=16))


def test_shards_keep_every_htp_context_loadable(e2b):
    """The HTP loads a context of at most 4 GB: a shard count that would put more weights in one is never chosen,
    and refused when given, whatever the build machine's memory."""
    e4b = ParameterCounts.from_config(e4b_config())
    w8, w4 = ExportConfig(quant=QuantScheme.A16W8, max_memory=256), ExportConfig(quant=QuantScheme.A16W4_BLOCK, max_memory=256)
    assert fewest_loadable_shards(e4b, w4) == 1 and fewest_loadable_shards(e2b, w8) == 1  # 2.2 and 2.2 GB
    # E4B at 8 bits: 4.4 GB of HTP weights (lm_head included) in one context, 2 shards bring the larger under 3
    assert shard_weights_gb(e4b, w8, 1) > 4 and shard_weights_gb(e4b, w8, 2) <= HTP_CONTEXT_WEIGHTS_GB
    plan = choose_memory_plan(e4b, w8)
    # the per-call size asks for more (7: the lm_head's shard is the largest any split has from there)
    assert plan.estimate.shards == fewest_shards_per_call(e4b) == 7 and "HTP's 4 GB context (at least 2)" in plan.summary()
    assert choose_memory_plan(e4b, w4).estimate.shards == 7
    with pytest.raises(InvalidInputError, match="--shards 1 puts up to 4.[0-9] GB .* Give --shards 2 or more"):
        choose_memory_plan(e4b, dataclasses.replace(w8, shards=1))
    # A size budget may keep any linear at 8 bits: counted so; fp16 E2B needs two contexts as well
    recipe = ExportConfig(**recipe_fields("16a4w_e2b"), max_memory=256)
    assert fewest_loadable_shards(e4b, recipe) == 2
    fp16 = ExportConfig(quant=QuantScheme.FP16, max_memory=256)
    assert fewest_loadable_shards(e2b, fp16) == 2 and shard_weights_gb(e2b, fp16, 1) > 4


def test_default_budget_is_mem_available_less_a_margin(tmp_path, e2b):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1000000 kB\nMemAvailable:   16777216 kB\n")
    no_cgroup = CgroupFiles(tmp_path / "no-cgroup", tmp_path)
    assert available_memory(meminfo, no_cgroup) == (16.0, "MemAvailable 16.0 GB")
    assert default_budget_gib(16.0) == pytest.approx(14.4) and default_budget_gib(5.0) == 4.0
    assert available_memory(tmp_path / "missing", no_cgroup) == (None, "unknown") and default_budget_gib(None) is None
    # A 16 GB laptop fits Gemma-4-E2B at the default scheme, in the fewest shards whose estimate fits 14.4 GB.
    plan = choose_memory_plan(e2b, ExportConfig(), meminfo=meminfo, cgroups=no_cgroup)
    assert plan.estimate.peak <= 14.4 and "(MemAvailable 16.0 GB less margin)" in plan.summary()
    meminfo.write_text("MemAvailable:   5242880 kB\n")  # 5 GB: no shard count fits 4 GB
    with pytest.raises(InvalidInputError) as info:
        choose_memory_plan(e2b, ExportConfig(), meminfo=meminfo, cgroups=no_cgroup)
    message = str(info.value)
    assert "budget of 4.0 GB (MemAvailable 5.0 GB less margin)" in message
    assert "estimated" in message and "--max-memory" in message
    # Without MemAvailable there is no budget to refuse against: the fewest shards, and a line saying so.
    plan = choose_memory_plan(e2b, ExportConfig(), meminfo=tmp_path / "missing", cgroups=no_cgroup)
    assert plan.estimate.shards == fewest_shards_per_call(e2b) and "no budget known" in plan.summary()


def _cgroup(root: Path, version: int, limit: str, usage: int, inactive: int, path: str = "/job", active: int = 0,
            dirty: int = 0) -> CgroupFiles:
    """A fake /proc/self/cgroup and cgroup mount: the process in `path`, with that memory limit and usage, and that
    much file cache on the inactive and active lists (``dirty`` of it not yet written back)."""
    if version == 2:
        (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
        (root / "cgroup.controllers").write_text("cpu memory\n")
        folder, files = root / path.lstrip("/"), ("memory.max", "memory.current")
        stats = ("inactive_file", "active_file", "file_dirty")
        membership = f"0::{path}\n"
    else:
        folder, files = root / "memory" / path.lstrip("/"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        stats = ("total_inactive_file", "total_active_file", "total_dirty")
        membership = f"9:name=systemd:/\n4:memory:{path}\n0::/\n"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / files[0]).write_text(limit + "\n")
    (folder / files[1]).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text("anon 1\n" + "".join(f"{name} {n}\n" for name, n in zip(stats, (inactive, active, dirty))))
    (root / "self-cgroup").write_text(membership)
    return CgroupFiles(root / "self-cgroup", root)


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_memory_limit_sets_the_default_budget(tmp_path, e2b, version):
    """In a container or a systemd slice the limit, not the machine, is what the kernel enforces: a 16 GB limit with
    1 GB used, 0.5 GB of it reclaimable cache, leaves 15.5 GB on a machine with 22 GB available."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   23068672 kB\n")  # 22 GB
    cgroups = _cgroup(tmp_path / "fs", version, str(16 * GB_BYTES), GB_BYTES, GB_BYTES // 2)
    assert available_memory(meminfo, cgroups) == (15.5, "cgroup memory limit, 15.5 GB free")
    plan = choose_memory_plan(e2b, ExportConfig(quant=QuantScheme.A16W4_BLOCK), meminfo=meminfo, cgroups=cgroups)
    assert plan.budget_gib == pytest.approx(15.5 - 1.55) and "(cgroup memory limit, 15.5 GB free less margin)" in plan.summary()
    # No limit ("max" in v2, a huge number in v1): the machine's figure.
    unlimited = _cgroup(tmp_path / "fs2", version, "max" if version == 2 else str(2**63 - 4096), GB_BYTES, 0)
    assert available_memory(meminfo, unlimited) == (22.0, "MemAvailable 22.0 GB")
    # A limit on a parent group counts too.
    parent = _cgroup(tmp_path / "fs3", version, "max" if version == 2 else str(2**63 - 4096), 0, 0, path="/slice/job")
    top = tmp_path / "fs3" / ("" if version == 2 else "memory") / "slice"
    limits = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    (top / limits[0]).write_text(str(12 * GB_BYTES))
    (top / limits[1]).write_text(str(2 * GB_BYTES))
    (top / "memory.stat").write_text("")
    assert available_memory(meminfo, parent)[0] == 10.0


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroups_clean_file_cache_counts_as_headroom_active_or_not(tmp_path, version):
    """The kernel reclaims a group's clean file cache before it kills, from the active list too (MemAvailable counts a
    machine's page cache so): 16 GB limit, 12 GB used of which 1 GB inactive and 3 GB active file cache, 0.5 GB of
    that dirty, leaves 16 - 12 + 3.5 GB. Counting the inactive list alone had left 5 GB."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   23068672 kB\n")  # 22 GB
    cgroups = _cgroup(tmp_path / "fs", version, str(16 * GB_BYTES), 12 * GB_BYTES, GB_BYTES, active=3 * GB_BYTES,
                      dirty=GB_BYTES // 2)
    assert available_memory(meminfo, cgroups) == (7.5, "cgroup memory limit, 7.5 GB free")


def test_the_printed_line_says_estimate(demo_model_dir):
    demo = ParameterCounts.from_config(read_text_config(demo_model_dir))
    line = choose_memory_plan(demo, ExportConfig(max_memory=8)).summary()
    assert line.startswith("Memory: 1 shard(s) chosen for budget 8.0 GB (--max-memory); estimated peak ")
    assert "an estimate" in line and "\n" not in line


@pytest.mark.parametrize("value", [0, -3, float("nan"), float("inf"), True, "12"])
def test_max_memory_bad_values_in_the_config(value):
    with pytest.raises(InvalidInputError, match="max_memory must be a positive number of GB"):
        ExportConfig(max_memory=value)


def e2b_folder_with_garbage_weights(tmp_path: Path) -> Path:
    """Gemma-4-E2B's config beside a 'safetensors' file that is not one: reading any weight would fail."""
    folder = tmp_path / "e2b"
    config = e2b_config()
    config.architectures = ["Gemma4ForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header" * 100)
    return folder


def test_too_small_budget_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    import optimum_qnn.exporter.pipeline as export_module
    from optimum_qnn.exporter.pipeline import export

    monkeypatch.setattr(export_module, "load_text_model", lambda *a, **k: pytest.fail("the model was loaded"))
    folder = e2b_folder_with_garbage_weights(tmp_path)
    from optimum_qnn.contract import CacheLayout
    from optimum_qnn.config import DEFAULT_CONTEXT

    config = ExportConfig(quant=QuantScheme.A16W4_BLOCK, embedding_quant=EmbeddingQuant(4, 0), max_memory=5)
    # as the export resolves it before the estimate: the default context, in the full layout (it compiles at 4096)
    resolved = dataclasses.replace(config, shapes=dataclasses.replace(
        config.shapes, max_seq_len=DEFAULT_CONTEXT, cache_layout=CacheLayout.FULL))
    best = min((estimate(ParameterCounts.from_config(e2b_config()), resolved, n) for n in range(1, 36)),
               key=lambda e: (e.peak, e.shards))
    peak = best.peak  # the best any shard count does
    assert 5 < peak < 8
    with pytest.raises(InvalidInputError) as info:
        export(folder, tmp_path / "new" / "out", config)
    message = str(info.value)
    assert f"needs an estimated {peak:.1f} GB at its peak (lower stage, {best.shards} shard(s))" in message
    assert "more than the budget of 5.0 GB (--max-memory)" in message and "stops before loading any weight" in message
    assert "no flag of this exporter lowers this estimate" in message
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("layout, context, block", [("full", 96, None), ("blocks", 128, 32), ("ring", 128, None)])
def test_the_estimate_counts_the_caches_the_export_makes(demo_model_dir, layout, context, block):
    """`memory.cache_bytes` from the config alone equals what the static model's contract holds: the float32 caches
    of every method's example inputs, and per shard the cache inputs its graphs take (its own layers' and those its
    KV-reusing layers read from an earlier shard)."""
    from optimum_qnn.contract import CacheLayout
    from optimum_qnn.exporter.memory import cache_bytes
    from optimum_qnn.models.gemma4.loading import load_text_model
    from optimum_qnn.models.gemma4.modeling import StaticCausalLM

    hf = load_text_model(demo_model_dir)[0]
    static = StaticCausalLM.from_hf(hf, max_context_len=context, ar_len=16, cache_layout=CacheLayout(layout),
                                    block_len=block)
    config = ExportConfig(quant=QuantScheme.A16W8, shapes=ShapeConfig(context, 16, cache_layout=CacheLayout(layout),
                                                                       cache_block_len=block))
    counts = ParameterCounts.from_config(hf.config)
    layers = static.contract.layers
    starts = (layers[-1].index,)  # the last layer (KV-reusing) alone in a second shard
    examples, shards = cache_bytes(counts, config, starts)
    held = [t for m in static.contract.methods for spec, t in zip(m.inputs, static.example_inputs(m.name))
            if "cache" in spec.name]
    assert held and examples == sum(t.numel() * t.element_size() for t in held)
    assert all(t.dtype is __import__("torch").float32 for t in held)
    source = layers[layers[-1].kv_source]
    read = [spec for m in static.contract.methods for spec in m.inputs
            if spec.name in {n for kind in ("k", "v") for n in static.contract.cache_input_names(kind, source, m.name)}]
    assert read and shards[1] == sum(__import__("math").prod(spec.shape) for spec in read) * 2  # uint16 graph IO
    assert shards[0] == examples // 2  # every cache input is in the first shard's graphs, at 2 bytes for 4


def test_the_estimate_grows_with_the_context_and_the_refusal_names_one_that_fits():
    """Gemma-4-E4B at 32768 (blocks of 4096, as the exporter lays it out): the example inputs' caches (float32, both
    methods: 2.1 GB) are held from the export to the re-export, and each shard's compile grows with its cache inputs.
    A budget that 32768 exceeds and 16384 does not is refused naming --max-seq-len 16384."""
    from optimum_qnn.contract import CacheLayout
    from optimum_qnn.exporter.memory import _COMPILE_BYTES_PER_CACHE_BYTE, cache_bytes

    e4b = ParameterCounts.from_config(e4b_config())

    def config(context, block=4096, budget=None):
        layout = CacheLayout.BLOCKS if block else CacheLayout.FULL
        return ExportConfig(quant=QuantScheme.A16W4_BLOCK, shapes=ShapeConfig(context, 128, cache_layout=layout,
                                                                              cache_block_len=block), max_memory=budget)

    short, long = estimate(e4b, config(1024, None), 7), estimate(e4b, config(32768), 7)
    examples, shards = cache_bytes(e4b, config(32768), long.starts)
    assert 2.0 < examples / GB_BYTES < 2.2
    for stage in ("export", "calibrate", "quantize"):
        assert long.stages[stage] - short.stages[stage] > 1.8
    assert long.lowering - short.lowering == pytest.approx(
        _COMPILE_BYTES_PER_CACHE_BYTE * (max(shards) - max(cache_bytes(e4b, config(1024, None), long.starts)[1])) / GB_BYTES,
        abs=0.02)
    lowest = {c: min(estimate(e4b, config(c), n).peak for n in range(7, 43)) for c in (16384, 32768)}
    budget = (lowest[16384] + lowest[32768]) / 2  # no shard count fits 32768; 16384 fits
    with pytest.raises(InvalidInputError) as info:
        choose_memory_plan(e4b, config(32768, budget=budget))
    assert "--max-seq-len 16384" in str(info.value)


def test_the_refusal_names_the_flags_that_lower_the_estimate(e2b):
    config = ExportConfig(quant=QuantScheme.A16W8, embedding_quant=EmbeddingQuant(8, 0), max_memory=20)
    with pytest.raises(InvalidInputError) as info:
        choose_memory_plan(e2b, config, evaluate=True)
    message = str(info.value)
    for flag, variant, evaluates in (
        ("--quant 16a4w_block", dataclasses.replace(config, quant=QuantScheme.A16W4_BLOCK), True),
        ("--embedding-quant 4,0 (4-bit tables, one group per row)", dataclasses.replace(config, embedding_quant=EmbeddingQuant(4, 0)), True),
        ("dropping --evaluate (it keeps the float32 model resident)", config, False),
    ):
        assert f"{flag}: estimated peak {estimate(e2b, variant, 35, evaluate=evaluates).peak:.1f} GB" in message


def test_cli_refuses_a_half_gigabyte_budget_with_exit_2(random_model_dir, run_python, tmp_path):
    out = tmp_path / "out"
    # The weights are not a safetensors file: an export that read any weight would fail otherwise. Seen, not timed.
    model = tmp_path / "model"
    shutil.copytree(random_model_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    proc = run_python("-m", "optimum_qnn", "export", "--model", str(model), "--output", str(out),
                      "--max-memory", "0.5", "--max-seq-len", "64", "--prefill-ar-len", "16", timeout=300)
    assert proc.returncode == 2, proc.stderr
    peak = estimate(ParameterCounts.from_config(read_text_config(random_model_dir)), ExportConfig(), 1).peak
    assert f"error: This export needs an estimated {peak:.1f} GB at its peak (lower stage, 1 shard(s))" in proc.stderr
    assert "budget of 0.5 GB (--max-memory)" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert "safetensors" not in proc.stderr.lower()  # refused on the meta-device count: no weight was read


def test_export_prints_its_choice_before_loading(random_model_dir, tmp_path, monkeypatch, caplog):
    import optimum_qnn.exporter.pipeline as export_module

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(export_module, "load_text_model", load)
    config = ExportConfig(shapes=ShapeConfig(64, 16), max_memory=8)
    with caplog.at_level("INFO", logger="optimum_qnn.stages"), pytest.raises(Loaded):
        export_module.export(random_model_dir, tmp_path / "out", config)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory:")]
    peak = estimate(ParameterCounts.from_config(read_text_config(random_model_dir)), config, 1).peak
    assert line.startswith(f"Memory: 1 shard(s) chosen for budget 8.0 GB (--max-memory); estimated peak {peak:.1f} GB")


def test_the_recipe_plan_and_gptq_count_what_they_hold(e2b):
    """The recipe's plan holds, on 512 tokens, each linear's 4-bit output change and its gradient plus what autograd
    keeps (3 x 1.21 M output channels, float32: 6.9 GB at E2B's widths), then the output-MSE search's input rows
    (0.70 M input channels: 1.3 GB), one after the other. GPTQ holds every float64 input Hessian (31.5 GB) until
    the rounding, so it is refused on a 16 GB budget and the refusal names the flag that lifts it."""
    assert (e2b.linears, e2b.linear_inputs, e2b.linear_outputs) == (277, 697088, 1212416)
    assert e2b.hessian_elements * 8 / 2**30 == pytest.approx(31.5, abs=0.05)
    plain = estimate(e2b, ExportConfig(quant=QuantScheme.A16W4_BLOCK), 7)
    recipe = estimate(e2b, ExportConfig(**recipe_fields("16a4w_e2b")), 7)
    assert "plan" not in plain.stages and recipe.peak_stage == "plan"
    assert recipe.stages["plan"] == pytest.approx(plain.stages["calibrate"] + 3 * 512 * 1212416 * 4 / 2**30, abs=0.01)
    ranges_only = estimate(e2b, ExportConfig(quant=QuantScheme.A16W4_BLOCK, weight_ranges=WeightRanges.OUTPUT_MSE), 7)
    assert ranges_only.stages["plan"] == pytest.approx(plain.stages["calibrate"] + 512 * 697088 * 4 / 2**30, abs=0.01)
    gptq = estimate(e2b, ExportConfig(quant=QuantScheme.A16W4_BLOCK, weight_rounding=WeightRounding.GPTQ), 7)
    assert gptq.stages["plan"] == pytest.approx(plain.stages["calibrate"] + 31.5, abs=0.06)
    assert gptq.stages["calibrate"] == pytest.approx(gptq.stages["plan"], abs=0.01)  # held until the rounding
    with pytest.raises(InvalidInputError) as info:
        choose_memory_plan(e2b, dataclasses.replace(ExportConfig(**recipe_fields("16a4w_e2b"), max_memory=16),
                                                    weight_rounding=WeightRounding.GPTQ))
    message = str(info.value)
    assert "(plan stage" in message and "--weight-rounding nearest (GPTQ holds every 4-bit linear's input Hessian, 31.5 GB" in message
    assert f"estimated peak {recipe.peak:.1f} GB" in message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc: Linux only")
def test_return_free_heap_gives_back_what_the_heap_kept():
    """Freed tensors below glibc's mmap threshold stay in the process's heap (and RSS) until trimmed: 3000 of 64 KiB
    (below any threshold), freed all but the last (which pins the heap's top, so free() itself cannot shrink it)."""
    import torch

    from optimum_qnn.quantization.weights import return_free_heap, rss_kb

    return_free_heap()
    tensors = [torch.ones(16 * 1024) for _ in range(3000)]  # 64 KiB each, touched: ~188 MiB resident
    last = tensors.pop()
    del tensors
    kept = rss_kb()
    freed = return_free_heap()
    assert freed * 1024 > 150, (kept, freed)  # MiB
    assert last.sum().item() == 16 * 1024  # the live tensor is untouched

"""optimum_qnn.artifacts.writer: variants are written atomically, nothing is lost on bad output folders or full disks.

The writer gets real `LoweredProgram` objects whose .pte bytes are placeholders: what is checked here is the
folder logic (staging, replacement, index), not the program. Exports killed mid-way are in test_reliability.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest

from optimum_qnn.artifacts.writer import INDEX_NAME, ArtifactError, BackgroundDigests, VariantWriter, check_output_folder, read_index, variant_name
from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
from optimum_qnn.contract import DECODE_METHOD, AttentionKind, LayerSpec, RunnerContract
from optimum_qnn.exporter.lowering import LoweredProgram
from optimum_qnn.artifacts.manifest import ManifestError, read_manifest
from optimum_qnn.models.gemma4.loading import LoadReport
from optimum_qnn.artifacts.variants import verify_files
from optimum_qnn.runtime.modeling import QNNModelForCausalLM

CONFIG = ExportConfig(
    socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(24, 4),
    embedding_quant=EmbeddingQuant(0, 0),
)
CONTRACT = RunnerContract.build(
    (LayerSpec(0, AttentionKind.FULL, 8, 1, 0, 0),), vocab_size=32, context_len=24, ar_lens={DECODE_METHOD: 1},
    sliding_window=None,
)


class _TextConfig:
    bos_token_id, eos_token_id, pad_token_id = 2, 1, 0


def writer(output: Path, source: Path) -> VariantWriter:
    return VariantWriter(
        output, source_folder=source, model_id="local/tiny", revision=None,
        load_report=LoadReport(files=["model.safetensors"]), tokenizer=None, text_config=_TextConfig(),
    )


def program(size: int, fill: int = 7) -> LoweredProgram:
    return LoweredProgram(program=bytes([fill]) * size, delegation={}, weight_sharing=False, soc=Soc.SM8650)


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / "source"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "generation_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def leftovers(output: Path) -> list[str]:
    return sorted(p.name for p in output.rglob(".*") if p.name.startswith((".staging-", ".old-")) or p.suffix == ".tmp")


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Mounts a tmpfs of a given size and options (needs root and a machine that allows mounts)."""
    mounted = []

    def mount(size_kb: int, options: str = "") -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        opts = f"size={size_kb}k" + (f",{options}" if options else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"this machine does not allow a tmpfs mount: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_variant_written_with_manifest_and_index(tmp_path, source, qnn_sdk):
    out = tmp_path / "out"
    path = writer(out, source).write_variant(variant_name(Soc.SM8650, CONFIG), program(1000), CONTRACT, CONFIG)
    assert path == out / "qnn/sm8650/fp16-ctx24-kv"
    manifest = read_manifest(path)
    verify_files(path, manifest)
    index = read_index(out)
    assert [v["path"] for v in index["variants"]] == ["qnn/sm8650/fp16-ctx24-kv"]
    assert (out / "config.json").is_file() and leftovers(out) == []


def test_weight_files_hashed_in_the_background_make_the_same_manifest(tmp_path, source, qnn_sdk):
    """The export hashes the checkpoint in the background from the swap on (`BackgroundDigests`): the manifest's
    source entries are the ones hashing at write time gives, and a file that cannot be hashed fails the write as it would
    there, leaving nothing behind."""
    (source / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    plain = read_manifest(writer(tmp_path / "a", source).write_variant("v", program(100), CONTRACT, CONFIG))
    early = writer(tmp_path / "b", source)
    early.weight_digests = BackgroundDigests(source, ["model.safetensors"])
    manifest = read_manifest(early.write_variant("v", program(100), CONTRACT, CONFIG))
    assert manifest.source.weight_files == plain.source.weight_files and plain.source.weight_files[0].size == 256 * 4096
    assert manifest.program == manifest.files[0] and manifest.program.size == 100
    missing = writer(tmp_path / "c", source)
    missing.weight_digests = BackgroundDigests(source, ["model-00002.safetensors"])
    with pytest.raises(ArtifactError, match="No such file"):
        missing.write_variant("v", program(100), CONTRACT, CONFIG)
    assert leftovers(tmp_path / "c") == []


def test_manifest_hashes_the_root_files_the_variant_reads(tmp_path, source, qnn_sdk):
    out = tmp_path / "out"
    path = writer(out, source).write_variant(variant_name(Soc.SM8650, CONFIG), program(1000), CONTRACT, CONFIG)
    manifest = read_manifest(path)
    assert manifest.schema_version == "1.6" and manifest.quantization.weight_rounding == "nearest"
    assert sorted(e.path for e in manifest.root_files) == ["config.json", "generation_config.json", "tokenizer.json"]
    verify_files(path, manifest, root=out)


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "generation_config.json"])
def test_from_pretrained_refuses_a_tampered_root_file(tmp_path, source, qnn_sdk, name):
    """The check runs before the program is loaded, so a placeholder .pte is enough to see the refusal."""
    out = tmp_path / "out"
    writer(out, source).write_variant(variant_name(Soc.SM8650, CONFIG), program(1000), CONTRACT, CONFIG)
    (out / name).write_text('{"tampered": true}')
    with pytest.raises(ManifestError, match=f"{name} does not match its manifest sha256"):
        QNNModelForCausalLM.from_pretrained(out)
    (out / name).unlink()
    with pytest.raises(ManifestError, match=f"{name} is listed in the manifest but missing"):
        QNNModelForCausalLM.from_pretrained(out)


def test_replacing_a_variant_swaps_it_whole(tmp_path, source, qnn_sdk):
    out = tmp_path / "out"
    name = variant_name(Soc.SM8650, CONFIG)
    writer(out, source).write_variant(name, program(1000, fill=1), CONTRACT, CONFIG)
    path = writer(out, source).write_variant(name, program(2000, fill=2), CONTRACT, CONFIG)
    assert (path / "model.pte").read_bytes() == bytes([2]) * 2000
    verify_files(path, read_manifest(path))
    index = read_index(out)
    assert len(index["variants"]) == 1
    assert leftovers(out) == []


def test_unwritable_output_folder_is_refused_up_front(tmp_path, mount_tmpfs):
    if os.geteuid() == 0:
        out = mount_tmpfs(64, "ro")  # root ignores permission bits: a read-only mount is the real thing
    else:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
    with pytest.raises(ArtifactError, match="Cannot write to the output folder .*Choose a writable --output"):
        check_output_folder(out / "artifacts")


@contextlib.contextmanager
def file_size_limit(max_bytes: int):
    """Writes past ``max_bytes`` in one file fail with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored), for this process.

    Lowering a soft limit and raising it back up to the hard limit needs no privilege, so unlike a small tmpfs
    this runs wherever the suite runs; the writer meets the same thing as on a full disk: an `OSError` from a
    write in the middle of the variant.
    """
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("full", ["tmpfs", "file-size-limit"])
def test_full_disk_keeps_earlier_variants(tmp_path, source, mount_tmpfs, qnn_sdk, full):
    """A write that fails half-way (a full 512 KB tmpfs where mounts are allowed, else a per-file size limit)."""
    out = mount_tmpfs(512) if full == "tmpfs" else tmp_path / "out"
    first = writer(out, source).write_variant(variant_name(Soc.SM8650, CONFIG), program(100_000), CONTRACT, CONFIG)
    index_before = (out / INDEX_NAME).read_bytes()
    bigger = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(48, 4),
                          embedding_quant=EmbeddingQuant(0, 0))
    second = writer(out, source)
    limit = file_size_limit(512 * 1024) if full == "file-size-limit" else contextlib.nullcontext()
    error = "File too large" if full == "file-size-limit" else "No space left on device"
    with limit, pytest.raises(ArtifactError, match=f"{error}.*earlier variants are intact"):
        second.write_variant(variant_name(Soc.SM8650, bigger), program(1_000_000), CONTRACT, bigger)
    verify_files(first, read_manifest(first), root=out)
    assert (out / INDEX_NAME).read_bytes() == index_before
    assert leftovers(out) == [] and not (out / "qnn/sm8650/fp16-ctx48-kv").exists()
    if full == "file-size-limit":  # the limit is lifted again: the same write now succeeds
        second.write_variant(variant_name(Soc.SM8650, bigger), program(1_000_000), CONTRACT, bigger)


def test_staging_folders_of_killed_exports_are_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = out / f".staging-{dead.pid}-abc"
    live = out / f".staging-{os.getpid()}-def"  # an export running right now in another thread or process
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.pte").write_bytes(b"x")
    # a program being lowered is streamed to a staging file of its own
    stale_program, live_program = out / f".staging-{dead.pid}-0a.pte", out / f".staging-{os.getpid()}-0b.pte"
    for file in (stale_program, live_program):
        file.write_bytes(b"x")
    check_output_folder(out)
    assert not stale.exists() and live.exists()
    assert not stale_program.exists() and live_program.exists()


def test_foreign_index_is_refused_before_any_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / INDEX_NAME).write_text(json.dumps({"format": "something-else", "variants": []}))
    with pytest.raises(ArtifactError, match="not an optimum-qnn variant index"):
        check_output_folder(out)


def test_context_len_picks_among_variants_and_several_matches_are_refused():
    from optimum_qnn.artifacts.variants import select_variant
    from optimum_qnn.runtime.modeling import VariantNotFoundError

    index = {"variants": [
        {"soc": "SM8650", "quant": "16a8w", "context_len": ctx, "mode": "hybrid", "path": f"qnn/sm8650/16a8w-ctx{ctx}-hybrid"}
        for ctx in (512, 1024)
    ]}
    assert select_variant(index, "sm8650", "16a8w", 1024)["path"] == "qnn/sm8650/16a8w-ctx1024-hybrid"
    with pytest.raises(VariantNotFoundError, match=r"Several variants match soc=sm8650, quant=16a8w; be more specific. "
                                                   r"Available: SM8650/16a8w/ctx512/hybrid, SM8650/16a8w/ctx1024/hybrid"):
        select_variant(index, "sm8650", "16a8w", None)


def test_one_context_exported_for_several_decodings_is_chosen_by_the_decoding(caplog):
    """Plain, ``-asst3`` and lookahead variants of one SoC, scheme and context: ``speculative`` picks among them
    (None: plain; "auto", what chat and serve load: the assistant's), one line names the others, and several contexts
    of each still go to the memory choice; a decoding no candidate has keeps them all for the caller's refusal."""
    import logging

    from optimum_qnn.artifacts.variants import AUTO_SPECULATIVE, MemoryFit, VariantNotFoundError, select_variant

    def entry(ctx, mode="hybrid", draft=None):
        tail = f"-asst{draft}" if draft else "" if mode == "hybrid" else "-lhd4w3g3"
        e = {"soc": "SM8650", "quant": "16a8w", "context_len": ctx, "mode": mode, "path": f"qnn/sm8650/16a8w-ctx{ctx}{tail}"}
        return {**e, "assistant": {"method": "draft_forward", "draft_len": draft}} if draft else e

    index = {"variants": [entry(128), entry(128, draft=3), entry(128, "lookahead")]}
    pick = lambda spec: select_variant(index, "SM8650", "16a8w", 128, speculative=spec)["path"]  # noqa: E731
    with caplog.at_level(logging.INFO, logger="optimum_qnn.stages"):
        assert pick(None) == "qnn/sm8650/16a8w-ctx128"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "optimum_qnn.stages"]
    assert line == ("The variant for plain decoding; SM8650/16a8w/ctx128/hybrid/asst3 loads with speculative='assistant' "
                    "(--speculative assistant); SM8650/16a8w/ctx128/lookahead loads with speculative='lookahead' "
                    "(--speculative lookahead)")
    assert pick("assistant") == pick(AUTO_SPECULATIVE) == "qnn/sm8650/16a8w-ctx128-asst3"
    assert pick("lookahead") == "qnn/sm8650/16a8w-ctx128-lhd4w3g3"
    without_assistant = {"variants": index["variants"][::2]}
    assert select_variant(without_assistant, "SM8650", "16a8w", 128, speculative=AUTO_SPECULATIVE)["mode"] == "lookahead"
    with pytest.raises(VariantNotFoundError, match="Several variants match"):
        select_variant({"variants": [entry(128), entry(128, "kv")]}, "SM8650", "16a8w", 128, speculative="assistant")
    # Two contexts of each decoding: the decoding first, then the context by memory.
    both = {"variants": [entry(ctx, draft=d) for ctx in (128, 256) for d in (None, 3)]}
    fit = MemoryFit(lambda e: e["context_len"] << 20, max_memory=1.0)
    assert select_variant(both, "SM8650", "16a8w", None, fit=fit, speculative="assistant")["path"] == "qnn/sm8650/16a8w-ctx256-asst3"
    assert select_variant(both, "SM8650", "16a8w", None, fit=fit)["path"] == "qnn/sm8650/16a8w-ctx256"


def test_an_image_variant_and_its_text_twin_are_chosen_by_the_model_class():
    """A text and an image variant (``-img70``) of one SoC, scheme, context and mode: the text class takes the text
    one, the image class the image one; several contexts of image variants still go to the memory choice; the image
    class refuses a folder of text variants with the fix, and a listing names the image variants as such."""
    from optimum_qnn.artifacts.variants import MemoryFit, VariantNotFoundError, select_variant

    def entry(ctx, soft=None):
        e = {"soc": "SM8650", "quant": "fp16", "context_len": ctx, "mode": "hybrid",
             "path": f"qnn/sm8650/fp16-ctx{ctx}" + (f"-img{soft}" if soft else "")}
        return {**e, "images": {"soft_tokens": soft}} if soft else e

    index = {"variants": [entry(128), entry(128, 70)]}
    assert select_variant(index, "SM8650", "fp16", None)["path"] == "qnn/sm8650/fp16-ctx128"
    assert select_variant(index, "SM8650", "fp16", None, images=True)["path"] == "qnn/sm8650/fp16-ctx128-img70"
    # An image variant without a text twin still loads for text (its prefill reads text as well).
    assert select_variant({"variants": [entry(128, 70)]}, None, None, None)["path"] == "qnn/sm8650/fp16-ctx128-img70"
    fit = MemoryFit(lambda e: e["context_len"] << 20, max_memory=1.0)
    several = {"variants": [entry(ctx, soft) for ctx in (128, 256) for soft in (None, 70)]}
    assert select_variant(several, "SM8650", "fp16", None, fit=fit, images=True)["path"] == "qnn/sm8650/fp16-ctx256-img70"
    assert select_variant(several, "SM8650", "fp16", None, fit=fit)["path"] == "qnn/sm8650/fp16-ctx256"
    with pytest.raises(VariantNotFoundError, match=r"takes images \(SM8650/fp16/ctx128/hybrid: exported for text generation\).*--task image-text-to-text"):
        select_variant({"variants": [entry(128)]}, "SM8650", "fp16", None, images=True)
    with pytest.raises(VariantNotFoundError, match="SM8650/fp16/ctx256/hybrid/img70"):
        select_variant(several, "SM8650", "fp16", 512, images=True)


def test_from_pretrained_refuses_an_unknown_speculative_before_anything(tmp_path):
    from optimum_qnn.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"speculative must be None, 'auto' or one of: lookahead, assistant; got 'medusa'"):
        QNNModelForCausalLM.from_pretrained(tmp_path / "nothing-here", speculative="medusa")


def test_from_pretrained_with_a_context_len_no_variant_has(tmp_path, source, qnn_sdk):
    from optimum_qnn.runtime.modeling import VariantNotFoundError

    out = tmp_path / "out"
    writer(out, source).write_variant(variant_name(Soc.SM8650, CONFIG), program(1000), CONTRACT, CONFIG)
    with pytest.raises(VariantNotFoundError, match=r"No variant has a context of 99 tokens \(--max-seq-len\); the contexts "
                                                   r"there are: 24\. Available: SM8650/fp16/ctx24/kv"):
        QNNModelForCausalLM.from_pretrained(out, soc="SM8650", context_len=99)

"""The export pipeline: load -> swap -> torch.export -> quantize (calibrated) -> map -> edge -> lower per SoC -> write.

The model is loaded, swapped, exported and calibrated once, and its graphs are converted for QNN once (the `edge`
stage: re-export, QNN's passes, ExecuTorch's edge conversion); only partitioning, compiling and serializing run per
SoC.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import resource
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from optimum_qnn.artifacts.writer import BackgroundDigests, VariantWriter, check_output_folder, folder_lock, staging_path, variant_name
from optimum_qnn.quantization.calibration import CalibrationSource
from optimum_qnn.config import DEFAULT_DRAFT_LEN, ExportConfig
from optimum_qnn.contract import DRAFT_METHOD, RunnerContract
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.evaluation import DEFAULT_MAX_TOKENS
from optimum_qnn.exporter.metadata import runner_metadata
from optimum_qnn.artifacts.hub import resolve_model_folder
from optimum_qnn.models.gemma4 import StaticCausalLM
from optimum_qnn.models.gemma4.loading import load_text_model
from optimum_qnn.exporter.parallel_compile import workers_private_mb
from optimum_qnn.exporter.vision import VisionExport, with_vision
from optimum_qnn.quantization.weights import resident_kb
from optimum_qnn.exporter.residency import (
    lm_head_in_float32,
    map_weights_to_file,
    release_float_weights,
    swap_embeddings_for_cpu,
)
from optimum_qnn.exporter.preflight import (
    check_arguments,
    check_overrides_match,
    first_missing,
    preflight,
    read_texts,
    source_model_id,
)
from optimum_qnn.progress import lowering_progress

logger = logging.getLogger(__name__)
# One line per finished stage (time, memory): the CLI shows this logger without -v.
stage_logger = logging.getLogger("optimum_qnn.stages")


@dataclass
class StageStats:
    """Wall time of one stage, and the highest RSS of the process while it ran; and the highest anonymous part of it
    (RSS less the file-backed and shared pages: the checkpoint's mapped bf16 pages are file-backed, and a memory
    limit's reclaim can drop and re-read them, while anonymous memory has to fit), 0 where /proc is not there."""

    name: str
    seconds: float
    peak_rss_mb: float
    peak_anon_mb: float = 0.0


@dataclass
class ExportResult:
    """What one export wrote, and what it cost."""

    output: Path
    variants: list[Path] = field(default_factory=list)
    stages: list[StageStats] = field(default_factory=list)
    delegation: dict[str, str] = field(default_factory=dict)
    quant_rows: list = field(default_factory=list)
    mixed_plan: object = None  # optimum_qnn.quantization.mixed_precision.MixedPlan of a --size-budget export
    swap_summary: str = ""

    def stage_table(self) -> str:
        lines = [f"{'stage':<12} {'wall s':>8} {'peak RSS MB':>12} {'anon MB':>8}"]
        lines += [f"{s.name:<12} {s.seconds:>8.1f} {s.peak_rss_mb:>12.0f} {s.peak_anon_mb:>8.0f}" for s in self.stages]
        return "\n".join(lines)


def peak_rss_mb() -> float:
    """The process's peak RSS so far (it only grows)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    """This process's RSS plus the private memory of its running QNN compile workers (their pages shared with it
    are in its RSS already)."""
    return _memory_mb()[0]


def _memory_mb() -> tuple[float, float]:
    """(RSS, anonymous RSS) of this process in MiB, each plus the private memory of its running QNN compile workers
    (their pages shared with it are in its RSS already); see `weights.resident_kb`."""
    resident, anonymous = resident_kb()
    workers = workers_private_mb()
    return resident / 1024 + workers, anonymous / 1024 + workers


class _RssSampler(threading.Thread):
    """The highest RSS seen while a stage runs, sampled every 50 ms (ru_maxrss cannot be reset per stage)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.peak_anon = _memory_mb()
        self._stop_event = threading.Event()

    def _sample(self) -> None:
        rss, anon = _memory_mb()
        self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)

    def run(self) -> None:
        while not self._stop_event.wait(0.05):
            self._sample()

    def stop(self) -> float:
        """Stop sampling; returns the peak RSS (the anonymous peak is `peak_anon`)."""
        self._stop_event.set()
        self.join()
        self._sample()
        return self.peak


@contextmanager
def _stage(result: ExportResult, name: str) -> Iterator[None]:
    logger.info("[%s] ...", name)
    sampler = _RssSampler() if os.path.exists("/proc/self/statm") else None
    if sampler:
        sampler.start()
    high_water = peak_rss_mb()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - t0
        # without /proc: the process's peak so far
        peak, anon = (sampler.stop(), sampler.peak_anon) if sampler else (peak_rss_mb(), 0.0)
        if peak_rss_mb() > high_water:  # a new process peak was set during this stage (catches spikes < 50 ms)
            peak = max(peak, peak_rss_mb())
    result.stages.append(StageStats(name, seconds, peak, anon))
    stage_logger.info("[%s] done in %.1f s, peak RSS %.0f MB (anonymous %.0f MB)", name, seconds, peak, anon)


def export(
    model: str | Path,
    output: str | Path,
    config: ExportConfig,
    *,
    revision: str | None = None,
    calibration: CalibrationSource | None = None,
    allow_pickle: bool = False,
    evaluate: Path | None = None,
    evaluate_tokens: int = DEFAULT_MAX_TOKENS,
    check_weight_sharing: bool = False,
    cluster=None,
    assistant: str | Path | None = None,
) -> ExportResult:
    """Export a Gemma4 text model to one QNN variant per SoC under ``output``.

    Everything that can be checked without the model (arguments, the checkpoint's config and file headers, the
    tokenizer, calibration and evaluation text) is checked before it loads. An export that fails leaves the output
    folder as it found it: a folder it created is removed, staging folders are deleted; variants completed before
    the failure (of a multi-SoC export) are kept.

    Args:
        model: a Hugging Face Hub id or a local checkpoint folder.
        output: the artifact folder (created; existing variants of other SoCs/schemes are kept).
        config: SoCs, quant scheme, mode and shapes.
        revision: Hub revision (branch, tag or commit) of ``model``.
        calibration: calibration text for quantized schemes (default: built-in sentences).
        allow_pickle: accept a checkpoint that has only pickle weights.
        evaluate: a text file; each variant is run on it (on this host's HTP, or the x86 emulator) before it is put
            in place, and perplexity (fp32 vs exported) and logits SQNR go into its manifest.
        evaluate_tokens: at most this many tokens of ``evaluate`` are scored.
        check_weight_sharing: for a weight-shared export, also lower the graphs without weight sharing (one more
            lowering per SoC) and record in the manifest that both builds hold the same graphs, IO and encodings
            and that the shared one stores its weights once (`inspection.sharing_check`).
        cluster: an `optimum_qnn.exporter.cluster.RayMatrix`: the SoC-specific lowerings run as its tasks and this
            returns once they are submitted; the variants are written as `cluster.collect()` receives them.
        assistant: a Gemma 4 assistant (MTP drafter: Hub id or folder) for this target, checked against it before
            the target's weights are read, lowered as the method ``draft_forward`` of each variant, whose kv_forward
            then verifies ``config.draft_len`` drafts (default `DEFAULT_DRAFT_LEN`) a call (docs/assistant.md).

    Returns:
        The variant folders written and per-stage wall time / peak RSS.

    Raises:
        OptimumQnnError: for every failure a user can cause (`InvalidInputError`, `CheckpointError`, `HubError`...).
    """
    check_arguments(model, output, config, revision, calibration, evaluate, evaluate_tokens, assistant)
    if assistant is not None and config.draft_len is None:
        config = dataclasses.replace(config, draft_len=DEFAULT_DRAFT_LEN)
    if cluster is not None and check_weight_sharing:
        raise InvalidInputError(_NO_SHARING_CHECK_ON_RAY)
    evaluate = None if evaluate is None else Path(evaluate)
    calibration = calibration or CalibrationSource()
    texts = read_texts(config, calibration, evaluate)
    result = ExportResult(Path(output))
    created = first_missing(result.output)
    try:
        check_output_folder(result.output)  # fail in a second, not after calibration and lowering
        return _export(
            str(model), result, config, revision, calibration, texts, allow_pickle, evaluate, evaluate_tokens,
            check_weight_sharing, cluster, None if assistant is None else str(assistant),
        )
    except BaseException:
        if created is not None and not result.variants:
            shutil.rmtree(created, ignore_errors=True)  # the folders this export made, and nothing that was there
        elif result.variants:
            logger.warning("The export failed; the variants written before the failure are kept: %s",
                           ", ".join(str(v) for v in result.variants))
        raise


_NO_SHARING_CHECK_ON_RAY = ("--check-weight-sharing lowers each SoC twice in this process; it does not run on a Ray "
                            "cluster: drop --ray, or drop --check-weight-sharing")


def export_matrix(
    model: str | Path, output: str | Path, configs: list[ExportConfig], *, ray: str | None = None, **options
) -> list[ExportResult]:
    """`export` for each config (a scheme, with its SoCs) into one artifact folder.

    Args:
        ray: None exports here, one scheme after the other; an address ("" for the default: see
            `optimum_qnn.exporter.cluster.RayMatrix`) lowers each (scheme, SoC) cell as a task on that Ray cluster,
            each scheme calibrated and quantized here once, its variants written as they arrive.
        options: `export`'s keyword arguments.

    Raises:
        ClusterError: (with ``ray``) cells failed on the cluster; the others were written, and the error's
            ``results`` says what landed.
    """
    if not configs:
        raise InvalidInputError("Nothing to export: no quantization scheme given")
    if ray is None:
        return [export(model, output, config, **options) for config in configs]
    from optimum_qnn.exporter.cluster import RayMatrix

    if options.get("check_weight_sharing"):
        raise InvalidInputError(_NO_SHARING_CHECK_ON_RAY)
    for config in configs:  # every config's arguments are checked before the cluster is touched
        check_arguments(model, output, config, options.get("revision"), options.get("calibration"),
                        options.get("evaluate"), options.get("evaluate_tokens", DEFAULT_MAX_TOKENS), options.get("assistant"))
    created = first_missing(Path(output))
    results: list[ExportResult] = []
    try:
        with RayMatrix(ray or None) as cluster:
            for config in configs:
                results.append(export(model, output, config, cluster=cluster, **options))
            cluster.collect()
    except BaseException as error:
        if created is not None and not any(r.variants for r in results):
            shutil.rmtree(created, ignore_errors=True)
        error.results = results
        raise
    return results


def _export(model: str, result: ExportResult, config: ExportConfig, revision: str | None, calibration: CalibrationSource,
            texts: list[str] | None, allow_pickle: bool, evaluate: Path | None, evaluate_tokens: int,
            check_weight_sharing: bool, cluster, assistant: str | None = None) -> ExportResult:
    output = result.output
    with _stage(result, "load"):
        folder = resolve_model_folder(model, revision=revision, allow_pickle=allow_pickle)
        tokenizer, config, memory = preflight(model, folder, config, revision, calibration, allow_pickle, evaluate,
                                              assistant=assistant)
        stage_logger.info("%s", memory.summary())
        if cluster is not None:
            cluster.check_fits(memory)  # before any weight is read
        # Without --evaluate the Hugging Face model never runs: its embedding tables stay in their stored dtype
        # until they are quantized, and the model is released after the swap.
        # A quantized export also keeps the linear weights as stored (bf16, in the file's pages) and casts them in
        # its graph (optimum_qnn.quantization.weights): no fp32 copy of the decoder.
        stored = evaluate is None and config.quant.is_quantized
        hf_model, load_report = load_text_model(
            folder, allow_pickle=allow_pickle, tables_in_stored_dtype=evaluate is None, matrices_in_stored_dtype=stored
        )
    shapes = config.shapes
    hybrid = config.mode.has_prefill
    with _stage(result, "swap"):
        static = StaticCausalLM.from_hf(
            hf_model, max_context_len=shapes.max_seq_len, ar_len=shapes.prefill_ar_len if hybrid else None,
            decode_ar_len=config.decode_ar_len, quantized=config.quant.is_quantized, cache_layout=shapes.cache_layout,
            block_len=shapes.cache_block_len, hidden_output=assistant is not None,
            image_inputs=config.image_tokens is not None,
        )
        result.swap_summary = static.report.table()
        # Where the lowering will cut the layers: a layer that reuses the K/V of a layer in an earlier shard joins
        # that cache itself (`StaticGemma4TextModel.forward`), so no whole cache crosses between shards.
        static.module.model.shard_starts = tuple(memory.estimate.starts)
        check_overrides_match(static.module, config)
        swap_embeddings_for_cpu(static, config, output)
        if stored:
            from optimum_qnn.quantization.embedding import QuantizedEmbedding
            from optimum_qnn.quantization.weights import upcast_in_graph

            upcast_in_graph(static.module, keep=(QuantizedEmbedding,))
        else:
            lm_head_in_float32(static)
        if evaluate is None:
            del hf_model  # frees the float embedding tables (the static module holds their quantized copies)
    vision = None
    if config.image_tokens is not None:
        with _stage(result, "vision"):
            vision = VisionExport.load(folder, config.image_tokens, static.text_config.pad_token_id)
    drafter = None
    if assistant is not None:
        from optimum_qnn.exporter import assistant as drafting

        with _stage(result, "assistant"):  # after the CPU lookup's swap: the drafter adopts the target's embedding
            drafter = drafting.load_drafter(assistant, static)
    # The manifest's SHA-256 of each weight file, hashed from here on in a low-priority thread: calibration leaves a
    # core mostly idle (120 % of 200 % at Gemma-4-E2B's size), where the swap uses both (started at load, the swap
    # took 32 s where it had taken 22-25).
    digests = BackgroundDigests(folder, load_report.files) if output is not None else None
    methods = [m.name for m in static.contract.methods]
    # Balanced by parameters (`ParameterCounts.shard_starts`); a drafter splits into as many partitions.
    shard_starts = dict.fromkeys(methods, memory.estimate.starts)
    # One set of example inputs per method, the export's and the lowering's re-export's: its zero caches are the
    # context's size in float32 (about 1 GB per method for Gemma-4-E4B at 32768), and no stage after the re-export needs
    # them (`EdgeLowering.prepare` lets them go).
    examples = {name: static.example_inputs(name) for name in methods}
    with _stage(result, "export"):
        programs = {name: static.export(name, examples[name]) for name in methods}
        if drafter is not None:
            examples[DRAFT_METHOD] = drafter.example_inputs()
            programs[DRAFT_METHOD] = torch.export.export(drafter.module, examples[DRAFT_METHOD], strict=False)
            shard_starts[DRAFT_METHOD] = drafting.drafter_shard_starts(
                drafter, len(memory.estimate.starts) + 1, weight_sharing=config.weight_sharing)
        if vision is not None:  # one partition: it splits at no decoder layer
            examples[vision.method.name], programs[vision.method.name] = vision.export()
            shard_starts[vision.method.name] = ()
    contract, quantized_io = static.contract, None
    if config.quant.is_quantized:
        graphs = _quantize(static, {n: programs[n] for n in methods}, config, tokenizer, texts, result, vision)
        if not config.float_io:
            from optimum_qnn.quantization.io import integer_io

            contract, quantized_io = integer_io(static.contract, graphs)
        if drafter is not None:
            with _stage(result, "drafter"):
                graphs[DRAFT_METHOD] = drafting.quantize_for_export(drafter, programs[DRAFT_METHOD], config, tokenizer,
                                                                    texts, contract if quantized_io else None)
        sources = {name: (graphs[name], examples[name]) for name in graphs}
        if vision is not None:  # the encoder stays float, at HTP fp16 (quantized graphs keep their own encodings)
            sources[vision.method.name] = programs[vision.method.name]
        del programs, examples
        with _stage(result, "map"):  # where the quantized weights live until the lowering is done
            if evaluate is None:
                release_float_weights(static.module, graphs.values())
            if output is not None:
                map_weights_to_file(graphs.values(), output)
        del graphs  # the lowering holds them (`sources`) until its SoC-independent part is done
    else:
        sources = programs
        del programs, examples
    float_outputs, assistant_info = {}, None
    if drafter is not None:
        contract = drafting.with_drafter(contract, drafter)
        float_outputs = drafting.float_outputs(contract) if quantized_io else {}
        if quantized_io:
            from optimum_qnn.quantization.io import quantized_inputs

            quantized_io[DRAFT_METHOD] = quantized_inputs(drafter.method)
        assistant_info = drafting.assistant_info(drafter, source_model_id(assistant, Path(assistant)), config.draft_len)
    contract = with_vision(contract, vision)
    writer = VariantWriter(
        output, source_folder=folder, model_id=source_model_id(model, folder), revision=revision,
        load_report=load_report, tokenizer=tokenizer, text_config=static.text_config, weight_digests=digests,
    )
    from optimum_qnn.artifacts.model_card import write_model_card
    from optimum_qnn.artifacts.inspection import export_time_inspection
    from optimum_qnn.exporter.delegation import format_delegation
    from optimum_qnn.exporter.lowering import EdgeLowering, LoweredProgram
    from optimum_qnn.exporter.side_by_side import lower_side_by_side, socs_at_once

    evaluator = None
    if evaluate is not None:
        evaluator = _evaluator(hf_model, static, tokenizer, evaluate, evaluate_tokens, result)
    # The SoC-independent part of the lowering (re-export, QNN's passes, edge conversion) runs once for every SoC;
    # each SoC then partitions, compiles and serializes its own copy, the last SoC's lowering (or its unshared
    # inspection build) consuming the edge programs.
    lowering = EdgeLowering(
        sources, fp16=not config.quant.is_quantized or vision is not None, constant_methods=runner_metadata(static, contract),
        skip_ops=_CPU_OPS, int64_inputs={"tokens"}, shard_starts=shard_starts, quantized_io=quantized_io,
        float_outputs=float_outputs,
    )
    del sources
    weight_sharing = config.weight_sharing and len(lowering.methods) > 1

    def write(soc: Soc, lowered: LoweredProgram, unshared=None) -> None:
        """Inspect one SoC's lowered program and put its variant in place (the card lists every variant)."""
        with _stage(result, f"inspect {soc.value}"):
            inspection = export_time_inspection(lowered.program, unshared)
        with _stage(result, f"write {soc.value}"):
            path = writer.write_variant(
                variant_name(soc, config), lowered, contract, config, quant_rows=result.quant_rows,
                evaluate=evaluator, inspection=inspection, mixed_plan=result.mixed_plan, assistant=assistant_info,
                images=None if vision is None else vision.info,
            )
            result.variants.append(path)
            with folder_lock(output):  # the folder is complete as published: its card lists every variant
                write_model_card(output)

    if cluster is not None:  # the SoC-specific part runs on the cluster's nodes; written as each arrives
        def landed(soc: Soc, lowered: LoweredProgram, seconds: float, peak_mb: float) -> None:
            result.stages.append(StageStats(f"lower {soc.value}", seconds, peak_mb))  # the cell's own figures
            result.delegation[soc.value] = format_delegation(lowered.delegation)
            write(soc, lowered)

        cluster.submit(lowering, config, weight_sharing, memory, output, landed)
        return result
    with _stage(result, "edge"), lowering_progress("Preparing the graphs for QNN", _rss_mb):
        lowering.prepare()
    at_once = 1 if check_weight_sharing else socs_at_once(len(config.socs), memory.estimate.lowering, memory.budget_gib)
    if at_once > 1:
        def write_wave(wave: list[tuple[Soc, LoweredProgram, float]]) -> None:
            try:
                for soc, lowered, seconds in wave:
                    logger.info("Lowered for %s in %.1f s", soc.value, seconds)
                    result.delegation[soc.value] = format_delegation(lowered.delegation)
                    write(soc, lowered)
            finally:  # the writer moved each program it wrote into place; what a failure left goes
                for _, lowered, _ in wave:
                    Path(lowered.program).unlink(missing_ok=True)

        lower_side_by_side(lowering, config.socs, at_once, weight_sharing=weight_sharing, budget_gb=memory.budget_gib,
                           program_file=lambda: staging_path(output, ".pte"), lowered=write_wave,
                           stage=functools.partial(_stage, result), rss_mb=_rss_mb)
        return result
    for i, soc in enumerate(config.socs):
        last = i == len(config.socs) - 1
        lower = functools.partial(lowering.lower, soc, memory_budget_gb=memory.budget_gib)
        # The program is streamed to a file next to the variants (the same file system: the writer moves it into
        # place), so its bytes are never joined in memory; the file goes with a failure.
        program_file = staging_path(output, ".pte")
        try:
            with _stage(result, f"lower {soc.value}"), lowering_progress(f"Lowering for {soc.value}", _rss_mb):
                lowered = lower(weight_sharing=weight_sharing, path=program_file, keep=not last or check_weight_sharing)
                result.delegation[soc.value] = format_delegation(lowered.delegation)
            unshared = (lambda: lower(weight_sharing=False, keep=not last).buffer) if check_weight_sharing else None
            write(soc, lowered, unshared)
        finally:
            program_file.unlink(missing_ok=True)
    return result


def _evaluator(hf_model, static: StaticCausalLM, tokenizer, text_file: Path, max_tokens: int, result: ExportResult):
    """``evaluate(folder, manifest)`` for `VariantWriter.write_variant`: scores the staged .pte against fp32."""
    from optimum_qnn.artifacts.manifest import Evaluation
    from optimum_qnn.exporter.evaluation import evaluate_variant, staged_session

    contract = static.contract
    reference = StaticCausalLM.from_hf(hf_model, max_context_len=contract.context_len, ar_len=contract.methods[0].ar_len)

    def run(folder: Path, manifest) -> Evaluation:
        with _stage(result, "evaluate"):
            scores = evaluate_variant(
                reference.session(), lambda: staged_session(folder, manifest), tokenizer,
                text_file, contract.context_len, static.text_config.bos_token_id, max_tokens,
            )
            # The emulator's program sits in a reference cycle (model -> session -> timed methods -> model): free its
            # QNN context now, not during the next SoC's lowering or at exit.
            gc.collect()
        logger.info(
            "Evaluation on %d tokens of %s: perplexity %.3f (fp32) -> %.3f (exported), logits SQNR %.1f dB, top-1 %.3f",
            scores.tokens, text_file.name, scores.perplexity_reference, scores.perplexity_exported, scores.sqnr_db,
            scores.top1_agreement,
        )
        return Evaluation(
            text_file=text_file.name, tokens=scores.tokens, perplexity_reference=round(scores.perplexity_reference, 4),
            perplexity_exported=round(scores.perplexity_exported, 4),
            sqnr_db=round(min(scores.sqnr_db, 200.0), 2),  # identical logits give +inf, which JSON cannot hold
            top1_agreement=round(scores.top1_agreement, 4),
        )

    return run


# Ops that stay on the CPU side of the .pte: the embedding lookups (the per-layer table is far too large for
# the NPU; quantized lookups are CPU kernels anyway).
_CPU_OPS = frozenset({"aten.embedding.default"})


def _quantize(static: StaticCausalLM, programs, config: ExportConfig, tokenizer, texts, result: ExportResult, vision=None):
    from optimum_qnn.quantization.ptq import quantize_static

    graphs, result.quant_rows, result.mixed_plan = quantize_static(static, programs, config, tokenizer, texts,
                                                                   stage=lambda name: _stage(result, name), vision=vision)
    return graphs

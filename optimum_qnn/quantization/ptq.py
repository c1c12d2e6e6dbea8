"""The quantize stage of an export: calibration samples, the optional mixed-precision plan and weight-range
search (both measured on the eager model), then PT2E prepare / calibrate / convert of every method's graph.

Kept apart from the pipeline (export.py) so the stage's steps read in one place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import ContextManager

import torch

from optimum_qnn.quantization.calibration import token_sequences
from optimum_qnn.config import ExportConfig, QuantScheme, WeightRanges, WeightRounding
from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD
from optimum_qnn.progress import bar
from optimum_qnn.session import KVSession, torch_method

logger = logging.getLogger(__name__)

# Below this many calibration tokens the activation ranges come from a handful of rows (the built-in sentences
# give about 120 with the demo tokenizer).
_MIN_CALIBRATION_TOKENS = 64
# The plan (sensitivity probes and the output-MSE range search) runs on the first samples, each cut to at most this
# many tokens: 512 tokens bound its cost and memory at Gemma-4-E2B's widths (QUANT_NOTES.md section 9).
PLAN_SAMPLES, PLAN_SAMPLE_TOKENS = 4, 128


def calibration_sequences(static, tokenizer, texts: list[str], calibrate_on: str) -> list[list[int]]:
    """Token ids of the calibration samples (random ids, two calls' worth, when there is no tokenizer)."""
    contract = static.contract
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        length = min(contract.context_len - 1, max(64, 2 * contract.method(calibrate_on).ar_len))
        return [torch.randint(0, contract.vocab_size, (length,), generator=gen).tolist()]
    seqs = token_sequences(tokenizer, texts, contract.context_len, static.text_config.bos_token_id)
    tokens = sum(len(seq) for seq in seqs)
    enough = max(_MIN_CALIBRATION_TOKENS, 2 * contract.method(calibrate_on).ar_len)
    if tokens < enough:
        logger.warning(
            "Calibrating on only %d tokens (%d samples): too few to set activation ranges reliably (want %d or "
            "more); pass a --calib-file with more text of the target domain",
            tokens, len(seqs), enough,
        )
    return seqs


def _feed(session: KVSession, method: str, seqs: list[list[int]], desc: str | None = None) -> list[torch.Tensor]:
    """Run samples through one method as a runner drives the .pte (chunked prefill, real cache contents)."""
    from optimum_qnn.quantization.kernels import row_gather_lookups

    spec = session.contract.method(method)
    logits = []
    with row_gather_lookups():
        for seq in bar(seqs, desc, "sample", enabled=desc is not None):
            session.reset()
            ids = torch.tensor(seq)
            # Whole calls of the method, so padding rows do not dilute the statistics; a sample shorter than one
            # call goes in as one padded call (as a runner feeds a short prompt).
            usable = (ids.numel() // spec.ar_len) * spec.ar_len or ids.numel()
            logits.append(session.feed_method(spec.name, ids[:usable]))
    return logits


def quantize_static(
    static, programs, config: ExportConfig, tokenizer, texts: list[str],
    stage: Callable[[str], ContextManager] = contextlib.nullcontext, vision=None,
):
    """Quantize the exported graphs of `static` (one per method) with shared quantization parameters.

    With `config.size_budget`, the linears whose 4-bit rounding most changes the logits are kept at 8 bits
    (`mixed_precision`); with `config.weight_ranges` = output-mse, the 4-bit weight scales are clipped per channel
    by output error (`weight_search`); with `config.weight_rounding` = gptq, the 4-bit weights are rounded by GPTQ
    on those scales (`gptq`). All are measured on the eager float module before PT2E (GPTQ's rounding itself runs
    on the calibrated graphs).

    With ``vision`` (an image variant's `VisionExport`), the prefill is calibrated on image prompts too
    (`image_calibration`): one per calibration photograph, its soft tokens from the float encoder.

    Returns:
        (method name -> converted graph, the quantization summary rows, the MixedPlan or None).
    """
    from optimum_qnn.quantization.summary import quant_summary
    from optimum_qnn.quantization.pt2e import make_quantizer
    from optimum_qnn.quantization.shared import quantize_shared
    from optimum_qnn.sdk import ensure_qnn_sdk

    ensure_qnn_sdk()  # QnnQuantizer needs QNN_SDK_ROOT before executorch's Qualcomm code is imported
    contract = static.contract
    calibrate_on = PREFILL_METHOD if PREFILL_METHOD in programs else DECODE_METHOD
    seqs = calibration_sequences(static, tokenizer, texts, calibrate_on)
    mixed_plan, clips, hessians = None, {}, {}
    if config.has_plan_stage:
        with stage("plan"):
            mixed_plan, clips, hessians = _plan_weights(static, config, seqs, calibrate_on)
    overrides = dict(config.overrides)
    if mixed_plan is not None:
        overrides.update((p, s) for p, s in mixed_plan.overrides() if p not in overrides)  # the user's win
    quantizer = make_quantizer(config.quant, block_size=config.block_size, soc=config.socs[0], overrides=overrides or None)

    with_images = []
    if vision is not None:
        from optimum_qnn.quantization.image_calibration import calibration_photos, image_samples

        with stage("image samples"):
            with_images = image_samples(vision, seqs, calibration_photos(), static.text_config.bos_token_id,
                                        contract.context_len)

    def calibrate(prepared: torch.nn.Module) -> None:
        spec = contract.method(calibrate_on)
        session = KVSession(contract, {spec.name: torch_method(prepared)})
        _feed(session, calibrate_on, seqs, "Calibrating")
        for ids, soft in bar(with_images, "Calibrating on images", "sample", enabled=bool(with_images)):
            session.reset()
            session.feed_method(spec.name, torch.tensor(ids), soft)
        if clips:
            from optimum_qnn.quantization.weight_search import apply_clips

            logger.info("Output-MSE ranges set on %d 4-bit weights", apply_clips(prepared, clips))

    tie = None
    if not config.float_io:  # integer IO: new K/V must come out in their cache's encoding
        from optimum_qnn.quantization.io import tie_cache_observers

        def tie(name: str, prepared) -> None:
            logger.debug("%s: %d new K/V outputs tied to their cache's observer", name, tie_cache_observers(prepared, contract.method(name)))

    adjust = None
    if config.weight_rounding is WeightRounding.GPTQ:
        from optimum_qnn.quantization.gptq import apply_gptq

        def adjust(prepared) -> None:
            apply_gptq(prepared, calibrate_on, hessians)
            hessians.clear()  # GB at real widths: not held through convert

    graphs = quantize_shared(programs, calibrate, quantizer, calibrate_on=calibrate_on, stage=stage, tie=tie, adjust=adjust)
    return graphs, quant_summary(graphs[calibrate_on]), mixed_plan


def _plan_weights(static, config: ExportConfig, seqs: list[list[int]], calibrate_on: str):
    """The mixed-precision plan (None without a size budget), per-linear 4-bit clip factors ({} for min-max) and the
    input Hessians of the 4-bit linears for GPTQ ({} without it). The plan and the clips look at the first
    PLAN_SAMPLES samples; GPTQ's Hessians gather every calibration sample."""
    from optimum_qnn.quantization import mixed_precision, weight_search

    scheme_block = config.block_size if config.quant is QuantScheme.A16W4_BLOCK else None
    linears = mixed_precision.htp_linears(static.module)
    samples = [seq[:PLAN_SAMPLE_TOKENS] for seq in seqs[:PLAN_SAMPLES]]
    plan = None
    if config.size_budget is not None:
        sensitivity = mixed_precision.probe_sensitivity(
            static.module, linears, lambda: torch.cat(_feed(_probe_session(static), calibrate_on, samples)),
            lambda linear: weight_search.block_of(linear, scheme_block),
            probes=mixed_precision.PROBES, progress=lambda steps: bar(steps, "Probing sensitivity", "probe"),
        )
        plan = mixed_precision.plan(sensitivity, {n: m.weight.numel() for n, m in linears.items()}, config.size_budget,
                                    probes=mixed_precision.PROBES)
        logger.info("%s", plan.table())
    kept = set(plan.kept) if plan is not None else set()
    searched = {n: m for n, m in linears.items() if n not in kept}
    session = static.session()
    clips, hessians = {}, {}
    if config.weight_ranges is WeightRanges.OUTPUT_MSE:
        rows = weight_search.input_rows(searched, lambda: _feed(session, calibrate_on, samples))
        clips = {
            n: weight_search.output_mse_clips(m, rows.pop(n), weight_search.block_of(m, scheme_block))
            for n, m in bar(searched.items(), "Searching 4-bit ranges", "linear")
        }
    if config.weight_rounding is WeightRounding.GPTQ:
        hessians = weight_search.input_hessians(searched, lambda: _feed(session, calibrate_on, seqs))
    return plan, clips, hessians


def _probe_session(static) -> KVSession:
    """A KV session that runs the float module with autograd on. Each call's inputs are copies (the session rewrites
    its buffers in place between calls) and its new K/V leave detached, so a probe's gradient stays within a call."""

    def run(*inputs):
        outputs = static.module(*inputs)
        return [outputs[0], *(o.detach() for o in outputs[1:])]

    return KVSession(static.contract, {m.name: torch_method(run, grad=True) for m in static.contract.methods})

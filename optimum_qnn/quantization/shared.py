"""One set of quantization parameters for several graphs of one module (hybrid prefill + decode): observers are
calibrated on one graph and copied to the others before all are converted."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import ContextManager

import torch
from torch import nn

from optimum_qnn.quantization.folding import share_equal_constants
from optimum_qnn.quantization.pt2e import _check_calibrated, _observers, convert, prepare

logger = logging.getLogger(__name__)


def _observed_name(node: torch.fx.Node) -> str:
    """The graph node an observer call watches, through observers of observers (whose names are numbered in
    graph order and so differ between graphs of different length)."""
    observed = node.args[0]
    while isinstance(observed, torch.fx.Node) and observed.op == "call_module" and observed.target.startswith(
        "activation_post_process_"
    ):
        observed = observed.args[0]
    return observed.name if isinstance(observed, torch.fx.Node) else repr(observed)


def _observer_key(node: torch.fx.Node, observer: nn.Module) -> tuple[str, str]:
    return _observed_name(node), type(observer).__name__


def copy_observer_state(source: torch.fx.GraphModule, target: torch.fx.GraphModule) -> int:
    """Copy every observer's statistics from one prepared graph to another of the same topology.

    The two graphs are traced from the same module with different static shapes (prefill / decode): observers
    pair up in graph order and must observe nodes of the same name. The source may observe nodes the target does
    not have at all (a prefill call longer than the sliding window closes its own out-of-window columns with one
    more op, `ops.mask.window_band`); those observers are left out. Buffers (`min_val`, `max_val`, ...) and the
    plain attributes some observers keep instead (ExecuTorch's per-block weight observer) are copied;
    references to graph nodes (ExecuTorch's concat observer) are not.

    Returns:
        The number of observers copied.

    Raises:
        ValueError: when the graphs' observers do not pair up (naming the first mismatch).
    """
    target_nodes = {node.name for node in target.graph.nodes}
    pairs_dst = _observers(target)
    pairs_src = [(n, o) for n, o in _observers(source) if _observed_name(n) in target_nodes]
    keys_src = [_observer_key(n, o) for n, o in pairs_src]
    keys_dst = [_observer_key(n, o) for n, o in pairs_dst]
    if keys_src != keys_dst:
        mismatches = (i for i, (a, b) in enumerate(zip(keys_src, keys_dst)) if a != b)
        first = next(mismatches, min(len(keys_src), len(keys_dst)))
        a = keys_src[first] if first < len(keys_src) else "<none>"
        b = keys_dst[first] if first < len(keys_dst) else "<none>"
        raise ValueError(
            f"Cannot share quantization parameters: the graphs differ at observer #{first} ({a} vs {b}); "
            f"{len(keys_src)} vs {len(keys_dst)} observers. Both graphs must be traced from the same module code."
        )
    for (_, src), (_, dst) in zip(pairs_src, pairs_dst):
        for name, buffer in src.named_buffers(recurse=False):
            setattr(dst, name, buffer.detach().clone())
        for name, value in vars(src).items():
            if name.startswith("_") or name in src._buffers:
                continue
            if isinstance(value, torch.Tensor):
                setattr(dst, name, value.detach().clone())
            elif isinstance(value, (bool, torch.dtype)):
                setattr(dst, name, value)
    return len(pairs_src)


def quantize_shared(
    programs: Mapping[str, torch.export.ExportedProgram | torch.fx.GraphModule],
    calibrate: Callable[[nn.Module], None],
    quantizer,
    *,
    calibrate_on: str,
    stage: Callable[[str], ContextManager] = contextlib.nullcontext,
    tie: Callable[[str, torch.fx.GraphModule], None] | None = None,
    adjust: Callable[[Mapping[str, torch.fx.GraphModule]], None] | None = None,
) -> dict[str, torch.fx.GraphModule]:
    """Quantize several graphs of one module (hybrid prefill + decode) with identical quantization parameters.

    All graphs are prepared; only `programs[calibrate_on]` is calibrated; its observer statistics are copied
    into the other prepared graphs (:func:`copy_observer_state`); then all are converted. Every activation
    scale / zero point and every quantized weight is therefore the same in all graphs, so the scales found
    serve both methods. ExecuTorch's Qualcomm LLM flow reaches the same end differently: it converts each graph
    and then overwrites the Q/DQ arguments and weights of one converted graph with the other's
    (`HybridTextDecoder._encoding_override` in examples/qualcomm/oss_scripts/llama/wrappers/llm_wrappers.py).

    Calibrate on the graph whose inputs cover the ranges of both (ExecuTorch calibrates an ar_len = N graph
    with a KV cache, which is also N times faster per token than the decode graph).

    Args:
        programs: method name -> exported program (or `.module()`), e.g. `{"prefill": ep_n, "decode": ep_1}`.
        calibrate: runs the prepared module of `calibrate_on` on calibration batches.
        quantizer: from :func:`make_quantizer`.
        calibrate_on: the key of the graph to calibrate.
        stage: ``stage(name)`` is entered around "calibrate" (prepare, observe, share the observers) and
            "quantize" (convert to Q/DQ), e.g. to time them.
        tie: ``tie(name, prepared)`` may rewire a prepared graph's observers before calibration (the same way in
            every graph, so their observers still pair up), e.g. `quant_io.tie_cache_observers`.
        adjust: ``adjust(prepared)`` runs once every graph's observers hold the calibrated statistics, before
            convert, with all prepared graphs by method name (e.g. `gptq.apply_gptq`, which rewrites weights in
            all of them alike).

    Returns:
        Method name -> converted graph module, in the order of `programs`.

    Raises:
        ValueError: for an unknown `calibrate_on`, or graphs whose observers do not pair up.
    """
    if calibrate_on not in programs:
        raise ValueError(f"Unknown graph {calibrate_on!r} to calibrate on; expected one of: {', '.join(programs)}")
    with stage("calibrate"):
        prepared = {name: prepare(program, quantizer) for name, program in programs.items()}
        if tie is not None:
            for name, graph in prepared.items():
                tie(name, graph)
        with torch.no_grad():
            calibrate(prepared[calibrate_on])
        _check_calibrated(prepared[calibrate_on], f"quantize_shared({calibrate_on!r})")
        for name, graph in prepared.items():
            if name != calibrate_on:
                count = copy_observer_state(prepared[calibrate_on], graph)
                logger.info("Copied %d observers from %s to %s", count, calibrate_on, name)
        if adjust is not None:
            adjust(prepared)
    with stage("quantize"):
        converted: dict[str, torch.fx.GraphModule] = {}
        memo: dict = {}  # each weight quantized once for all graphs
        for name in list(prepared):
            graph = convert(prepared.pop(name), memo)
            if converted:
                shared = share_equal_constants(next(iter(converted.values())), graph)
                logger.info("%s shares %.0f MB of constants with %s", name, shared / 2**20, next(iter(converted)))
            converted[name] = graph
        return converted

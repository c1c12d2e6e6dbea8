"""Post-training quantization of the HTP graphs, and the CPU-side weight-only quantized embedding lookups.

The HTP part of a graph is quantized with PT2E (`torchao.quantization.pt2e`) annotated by ExecuTorch's
`QnnQuantizer`, driven by a `QuantRecipe` (executorch.backends.qualcomm.quantizer.quant_recipe): activations
per-tensor with MinMax observers, weights of linear/conv per-channel or, for `16a4w_block`, per-block (LPBQ).
Per-module overrides keep chosen layers at another scheme.

Hybrid exports lower two graphs (prefill, ar_len N; decode, ar_len 1) traced from one module. They must share
every quantization parameter: :func:`quantize_shared` calibrates one prepared graph and copies its observer
state into the other prepared graphs before converting them all (exact: the converted graphs hold identical
scales, zero points and quantized weights).

Embedding tables never enter the HTP graph: `optimum_qnn.embedding.QuantizedEmbedding` calls ExecuTorch's
`quantized_decomposed::embedding_{4bit,byte}.dtype` ops, which the QNN partitioner leaves on the CPU where
`executorch.kernels.quantized` runs them. The quantizer never annotates an embedding lookup, so its float
output enters the HTP graph through a quantize node.

Example:
    >>> quantizer = make_quantizer(QuantScheme.A16W4_BLOCK, block_size=64, overrides={r"^lm_head$": "16a8w"})
    >>> converted = quantize(exported_program, calibrate=run_batches, quantizer=quantizer)
    >>> print(format_quant_summary(quant_summary(converted)))  # optimum_qnn.quant_summary
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import operator
import re
from collections.abc import Callable, Mapping
from typing import ContextManager

import torch
from torch import nn

from optimum_qnn.config import QuantScheme, Soc
from optimum_qnn.folding import _CASTS, _drop_unused_tensors, fold_weight_quantization, share_equal_constants

logger = logging.getLogger(__name__)

# Ops whose weight gets per-channel / per-block quantization (all others: per-tensor activations only).
_LINEAR = torch.ops.aten.linear.default
_CONV2D = torch.ops.aten.conv2d.default
_CONV1D = torch.ops.aten.conv1d.default
WEIGHT_OPS = frozenset({_LINEAR, _CONV1D, _CONV2D})
# Block quantization shapes (1, block, 1...) per op: the block runs along the input channels (dim 1).
_BLOCK_RANK = {_LINEAR: 2, _CONV2D: 4}
# Lookups the quantizer must never annotate: embedding tables stay on the CPU (see QuantizedEmbedding).
CPU_OPS = frozenset({torch.ops.aten.embedding.default})

_ANNOTATION_KEY = "quantization_annotation"  # torchao.quantization.pt2e.quantizer.Q_ANNOTATION_KEY


def _quant_dtype(scheme: QuantScheme):
    from executorch.backends.qualcomm.quantizer.quantizer import QuantDtype

    table = {
        QuantScheme.A16W16: QuantDtype.use_16a16w,
        QuantScheme.A16W8: QuantDtype.use_16a8w,
        QuantScheme.A16W4: QuantDtype.use_16a4w,
        QuantScheme.A16W4_BLOCK: QuantDtype.use_16a4w_block,
        QuantScheme.A8W8: QuantDtype.use_8a8w,
    }
    if scheme not in table:
        quantized = ", ".join(s.value for s in table)
        raise ValueError(f"Quant scheme {scheme.value!r} is not a PT2E scheme; expected one of: {quantized}")
    return table[scheme]


# ---------------------------------------------------------------------------------------------------------------
# Quantizer
# ---------------------------------------------------------------------------------------------------------------


def _module_path(node: torch.fx.Node) -> str:
    """Fully qualified name of the innermost module a node was traced in (`""` for the root)."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


# The HTP stores a block-quantized (LPBQ) weight as int4 values, one float scale per output channel and, per
# block, a 4-bit integer multiplier in [1, 16] of that scale / 16 (see `make_qnn_per_block_config` in
# executorch/backends/qualcomm/builders/node_visitor.py).
_LPBQ_SCALE_STEPS = 16


def _lpbq_scales(scale: torch.Tensor) -> torch.Tensor:
    """Round per-block scales `[out, blocks, ...]` up to what LPBQ can store: integer multiples of channel max / 16.

    Rounding up never clips a weight; the quantized weights are then computed with these exact scales, so the
    fake-quant model and the compiled graph agree (with float block scales they differ by up to 30 % per block).
    """
    flat = scale.reshape(scale.shape[0], -1)
    unit = flat.amax(dim=1, keepdim=True) / _LPBQ_SCALE_STEPS
    steps = torch.clamp(torch.ceil(flat / unit - 1e-4), 1, _LPBQ_SCALE_STEPS)
    return (steps * unit).reshape(scale.shape).to(scale.dtype)


# The x86 HTP emulator of QAIRT 2.49.40 (libQnnHtp.so from onnxruntime-qnn 2.5.0) segfaults, in an HVX worker
# thread on the first execution, on an LPBQ conv whose input channels form 7, 8 or 9 blocks of 48 channels or more
# (512 = 8 x 64, 448, 576; 1024 = 8 x 128; ...), for SM8550, SM8650 and SM8750 alike. 6 or >= 10 such blocks, and
# any number of 32-channel blocks, run and match the fake-quant model. Those weights get 32-channel blocks.
_LPBQ_CRASH_BLOCK_COUNTS = range(7, 10)
_LPBQ_SAFE_BLOCK = 32


def lpbq_block_size(in_features: int, block_size: int) -> int | None:
    """The block size `16a4w_block` uses for a weight with `in_features` input channels.

    Returns:
        `block_size`; or 32 when `block_size` would make 7-9 blocks (the emulator crash above); or None (the
        weight stays 4-bit per-channel) when neither block size divides `in_features`.
    """
    for block in dict.fromkeys((block_size, _LPBQ_SAFE_BLOCK)):
        if in_features % block:
            continue
        if block > _LPBQ_SAFE_BLOCK and in_features // block in _LPBQ_CRASH_BLOCK_COUNTS:
            continue
        return block
    return None


def _in_features(node: torch.fx.Node) -> int:
    weight = node.args[1]
    value = weight.meta.get("val")
    if value is None:  # a get_attr node of a graph module that was not re-traced
        value = operator.attrgetter(weight.target)(weight.graph.owning_module)
    return value.shape[1]


@functools.cache
def _recipe_classes():
    # Built lazily: executorch's Qualcomm quantizer modules need QNN_SDK_ROOT at import.
    from executorch.backends.qualcomm.quantizer.observers.per_block_param_observer import PerBlockParamObserver
    from executorch.backends.qualcomm.quantizer.quant_recipe import QuantGranularity, QuantizationStrategy

    class LpbqObserver(PerBlockParamObserver):
        """ExecuTorch's per-block weight observer with scales the HTP's LPBQ encoding represents exactly."""

        def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
            scale, zero_point = super().calculate_qparams()
            return _lpbq_scales(scale), zero_point

    class Rule(QuantizationStrategy):
        """Match by op target AND (optionally) by a regex searched in the node's module path.

        ExecuTorch's `ByNameRegex` matches every op of a module, which breaks per-channel rules on modules that
        also hold element-wise ops (`layers.0.` would hand a per-channel config to an `add`).
        """

        def __init__(self, *, targets, pattern, accept=None, **kwargs):
            super().__init__(**kwargs)
            self.targets = targets
            self.pattern = re.compile(pattern) if pattern is not None else None
            self.accept = accept
            if self.granularity == QuantGranularity.PER_BLOCK:
                for config in self.quant_config.per_block_quant_config_list:
                    keywords = config.weight.observer_or_fake_quant_ctr.p.keywords
                    config.weight = dataclasses.replace(
                        config.weight, observer_or_fake_quant_ctr=LpbqObserver.with_args(**keywords)
                    )

        def _matches(self, node: torch.fx.Node) -> bool:
            if node.op != "call_function" or node.target not in self.targets:
                return False
            if self.pattern is not None and not self.pattern.search(_module_path(node)):
                return False
            return self.accept is None or self.accept(node)

    return Rule, LpbqObserver


def _scheme_rules(rule_cls, scheme: QuantScheme, block_size: int, supported_ops, pattern, priority, note):
    """The rules of one scheme: weights of linear/conv (per-channel or per-block) then every other op."""
    from executorch.backends.qualcomm.quantizer.quant_recipe import QuantGranularity
    from torchao.quantization.pt2e import MinMaxObserver

    common = dict(
        quant_dtype=_quant_dtype(scheme),
        is_qat=False,
        act_observer=MinMaxObserver,
        act_symmetric=False,
        note=note,
        priority=priority,
    )
    rules = []
    weight_ops = WEIGHT_OPS & supported_ops
    per_channel = None
    if scheme is QuantScheme.A16W4_BLOCK:
        # One rule (hence one observer constructor) per op and block size: the annotator writes the block size
        # into the rule's shared observer constructor, so weights of different block shapes cannot share a rule.
        for op, rank in _BLOCK_RANK.items():
            for block in dict.fromkeys((block_size, _LPBQ_SAFE_BLOCK)):
                rules.append(
                    rule_cls(
                        targets={op},
                        pattern=pattern,
                        accept=lambda node, block=block: lpbq_block_size(_in_features(node), block_size) == block,
                        granularity=QuantGranularity.PER_BLOCK,
                        extra_kwargs={"block_size": (1, block) + (1,) * (rank - 2)},
                        **common,
                    )
                )

        def per_channel(node: torch.fx.Node) -> bool:  # the weights no block size fits
            return node.target not in _BLOCK_RANK or lpbq_block_size(_in_features(node), block_size) is None
    if weight_ops:
        rules.append(
            rule_cls(
                targets=weight_ops,
                pattern=pattern,
                accept=per_channel,
                granularity=QuantGranularity.PER_CHANNEL,
                extra_kwargs={},
                **common,
            )
        )
    rules.append(
        rule_cls(
            targets=supported_ops - WEIGHT_OPS,
            pattern=pattern,
            granularity=QuantGranularity.PER_TENSOR,
            extra_kwargs={},
            **common,
        )
    )
    return rules


def make_quantizer(
    scheme: QuantScheme | str,
    *,
    block_size: int = 64,
    overrides: Mapping[str, QuantScheme | str] | None = None,
    soc: Soc | str = Soc.SM8650,
):
    """Build ExecuTorch's `QnnQuantizer` for a quant scheme, with per-module overrides.

    Activations are per-tensor (uint16, or uint8 for `8a8w`) with MinMax observers: the default moving-average
    observers let empty KV caches dominate the statistics. Linear/conv weights are symmetric per-channel at the
    scheme's width; `16a4w_block` quantizes linear and conv2d weights to 4 bits per block of `block_size` input
    channels (LPBQ) and any other conv per-channel. Embedding lookups are never annotated (they run on the CPU).

    Args:
        scheme: a quantized `QuantScheme` (not `fp16`, which needs no quantizer).
        block_size: input channels per block for `16a4w_block` (also used by a `16a4w_block` override).
        overrides: module-path regex -> scheme, e.g. `{r"^lm_head$": "16a8w", r"layers\\.0\\.": "16a16w"}`. A
            regex is searched (`re.search`) in the fully qualified name of the module an op was traced in; the
            first matching entry wins, and an override beats the scheme.
        soc: target SoC (the quantizer validates ops against it; LPBQ needs HTP v69 or newer).

    Returns:
        The configured `QnnQuantizer`, for `quantize` / `quantize_shared`.

    Raises:
        ValueError: for `fp16`, an unknown scheme, or a block size that is not positive.

    Example:
        >>> quantizer = make_quantizer("16a4w_block", block_size=32, overrides={"lm_head": "16a8w"})
    """
    from executorch.backends.qualcomm.quantizer.quant_recipe import QuantGranularity, QuantRecipe
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e import MinMaxObserver

    scheme = QuantScheme.parse(scheme)
    soc = Soc.parse(soc)
    if block_size <= 0:
        raise ValueError(f"Block size must be positive; got {block_size}")
    overrides = {pattern: QuantScheme.parse(value) for pattern, value in (overrides or {}).items()}
    for pattern in overrides:
        re.compile(pattern)  # fail here, not in the middle of annotation

    quantizer = QnnQuantizer(soc_model=getattr(QcomChipset, soc.name))
    supported = frozenset(quantizer.get_supported_ops()) - CPU_OPS
    rule_cls, _ = _recipe_classes()
    recipe = QuantRecipe(
        _quant_dtype(scheme), False, act_observer=MinMaxObserver, granularity=QuantGranularity.PER_TENSOR
    )
    # QuantRecipe tries higher priorities first: the first override gets the highest one.
    for rank, (pattern, override) in enumerate(overrides.items()):
        priority = 2 + len(overrides) - rank
        recipe._strategies += _scheme_rules(
            rule_cls, override, block_size, supported, pattern, priority, f"override {pattern!r}: {override.value}"
        )
    recipe._strategies += _scheme_rules(rule_cls, scheme, block_size, supported, None, 1, scheme.value)
    quantizer.set_recipe(recipe)
    # set_recipe makes every supported op a target of the fallback rule; embeddings must stay unannotated.
    recipe.initialize_default_strategy_ops(supported)
    return quantizer


# ---------------------------------------------------------------------------------------------------------------
# Prepare / calibrate / convert
# ---------------------------------------------------------------------------------------------------------------


def _as_graph_module(program) -> torch.fx.GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    if isinstance(program, torch.fx.GraphModule):
        return program
    raise TypeError(f"Expected a torch.export.ExportedProgram or torch.fx.GraphModule; got {type(program).__name__}")


def _observers(prepared: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, nn.Module]]:
    """(node, observer module) of every observer call, in graph order."""
    # torchao's own test: per-block (affine) observers do not derive from ObserverBase.
    from torchao.quantization.pt2e.observer import _is_activation_post_process

    found = []
    for node in prepared.graph.nodes:
        if node.op == "call_module":
            module = prepared.get_submodule(node.target)
            if _is_activation_post_process(module):
                found.append((node, module))
    return found


def _check_calibrated(prepared: torch.fx.GraphModule, what: str) -> None:
    for node, observer in _observers(prepared):
        min_val = getattr(observer, "min_val", None)
        if isinstance(min_val, torch.Tensor) and min_val.numel() == 1 and torch.isinf(min_val).item():
            raise RuntimeError(
                f"{what}: observer {node.target} (after {node.args[0]}) saw no data; the calibration callback "
                "must run the prepared module on at least one batch"
            )


def prepare(program, quantizer) -> torch.fx.GraphModule:
    """Annotate and insert observers (`prepare_pt2e`) into an exported program or its `.module()`.

    A cast of a constant (a weight kept in its stored dtype, `weights.UpcastLinear`) is left unannotated: QnnQuantizer
    treats a cast as an activation op and would observe the bf16 weight before it, so the weight's own observer
    would land behind a Q/DQ pair that cannot be folded. Unannotated, the cast feeds the weight's observer and folds
    into the quantized constant (`fold_weight_quantization`)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    annotate = quantizer.annotate

    def annotate_around_weight_casts(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        _mark_weight_casts_annotated(model)
        return annotate(model)

    quantizer.annotate = annotate_around_weight_casts
    try:
        return prepare_pt2e(_as_graph_module(program), quantizer)
    finally:
        del quantizer.annotate  # the instance attribute; the class's method is back




def _mark_weight_casts_annotated(graph: torch.fx.GraphModule) -> None:
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in _CASTS and getattr(node.args[0], "op", None) == "get_attr":
            node.meta["quantization_annotation"] = QuantizationAnnotation(_annotated=True)


def quantize(
    program: torch.export.ExportedProgram | torch.fx.GraphModule,
    calibrate: Callable[[nn.Module], None],
    quantizer,
) -> torch.fx.GraphModule:
    """Prepare, calibrate and convert one graph.

    Args:
        program: the exported program (or its `.module()`) of one method.
        calibrate: runs the prepared module on calibration batches (and shows the progress bar); called once.
        quantizer: from :func:`make_quantizer`.

    Returns:
        The converted (fake-quant, Q/DQ) graph module, ready for lowering.

    Raises:
        RuntimeError: when calibration left an activation observer without data.
    """
    prepared = prepare(program, quantizer)
    with torch.no_grad():
        calibrate(prepared)
    _check_calibrated(prepared, "quantize")
    return convert(prepared)


def convert(prepared: torch.fx.GraphModule, memo: dict | None = None) -> torch.fx.GraphModule:
    """`convert_pt2e` with the weights' quantization folded into int constants, in bounded memory: row-chunked
    per-channel quantization (`kernels.chunked_weight_quantization`), no float copy of the dequantized weights
    (`fold_weight_quantization`), and the float weights it replaced dropped from the graph. ``memo``: shared by the
    graphs of one module, so each weight is quantized once (see `fold_weight_quantization`)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    from optimum_qnn.kernels import chunked_weight_quantization

    graph = convert_pt2e(prepared, fold_quantize=False)
    with chunked_weight_quantization():
        fold_weight_quantization(graph, memo)
    _drop_unused_tensors(graph)
    return graph


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

"""Integer graph IO for quantized exports, as ExecuTorch's Qualcomm LLM flow ships it (`get_kv_io_bit_width` 16).

A quantized graph computes on 16-bit activations anyway; with float IO the HTP delegate quantizes every input and
dequantizes every output on each call. With integer IO the host passes the masks and KV caches as uint16 and gets
the logits and the new K/V back as uint16:
- the new K/V outputs carry their cache's own encoding (the quantizer shares one observer between a cache and the
  new slice concatenated to it), so the host copies them into the caches unchanged; the blocks of one cache
  (`CacheLayout.BLOCKS`) share that encoding too;
- the mask encoding maps 0 (attend) to 65535 and `MASK_MIN` (-255) to 0: ExecuTorch's runner's uint16 values;
- logits are dequantized as ``(q - zero_point) * scale`` (the runner takes argmax on the raw values).

`tokens` and `input_pos` stay int64 / int32: they index CPU-side tables and the RoPE tables.
"""

from __future__ import annotations

import re

import torch

from optimum_qnn.contract import IMAGE_INPUTS, MethodSpec, RunnerContract

_BLOCK_SUFFIX = re.compile(r"_block\d+$")

# Inputs that become integer IO: the two masks and every cache. Every output does, but the hidden states a Gemma 4
# assistant reads and returns (float32 at both ends, so a drafter step can take either: docs/assistant.md).
_FLOAT_INPUTS = ("tokens", "input_pos", "hidden", *IMAGE_INPUTS)  # soft tokens: the encoder's float output
FLOAT_OUTPUTS = ("hidden", "hidden_out")


def float_output_positions(spec: MethodSpec) -> tuple[int, ...]:
    """Positions of the outputs of ``spec`` that stay float32 with integer IO (`FLOAT_OUTPUTS`)."""
    return tuple(i for i, t in enumerate(spec.outputs) if t.name in FLOAT_OUTPUTS)


def quantized_inputs(spec: MethodSpec) -> frozenset[int]:
    """Positions of the inputs of ``spec`` that become integer IO."""
    return frozenset(i for i, t in enumerate(spec.inputs) if t.name not in _FLOAT_INPUTS)


def tie_cache_observers(prepared: torch.fx.GraphModule, spec: MethodSpec) -> int:
    """Make each new K/V output of a prepared (observed) graph use its cache input's observer; returns how many
    were retied.

    The host copies new K/V into the cache unchanged, so both must carry one encoding, fitted to every value the
    cache will hold (the cache inputs and the new slices). QnnQuantizer's `cat` annotation shares one observer
    between a cache and the slice appended to it, but the graph output of that slice keeps its producer's observer
    whenever the two groups are not merged (measured: 5 of 8 caches of the demo model at prefill 16).
    """
    from torchao.quantization.pt2e.observer import _is_activation_post_process

    def observer_of(node: torch.fx.Node) -> str | None:
        if node.op == "call_module" and _is_activation_post_process(prepared.get_submodule(node.target)):
            return node.target
        return None

    placeholders = [n for n in prepared.graph.nodes if n.op == "placeholder"]
    output = next(n for n in prepared.graph.nodes if n.op == "output")
    results = list(output.args[0])
    if len(placeholders) != len(spec.inputs) or len(results) != len(spec.outputs):
        raise ValueError(f"{spec.name}: the prepared graph's IO does not line up with the contract ({len(placeholders)} inputs, {len(results)} outputs; the contract: {len(spec.inputs)}, {len(spec.outputs)})")
    cache_observer = {}
    retied = 0
    for t, node in zip(spec.inputs, placeholders):
        if t.name.startswith(("k_cache_", "v_cache_")):
            found = [user for user in node.users if observer_of(user)]
            if len(found) != 1:
                raise ValueError(f"{spec.name}: expected one observer on {t.name}, found {len(found)}")
            # The blocks of one cache (`CacheLayout.BLOCKS`) are one buffer to the host: their first block's observer.
            new = _BLOCK_SUFFIX.sub("", t.name).replace("_cache_", "_new_")
            if new not in cache_observer:
                cache_observer[new] = found[0].target
            elif found[0].target != cache_observer[new]:
                found[0].target = cache_observer[new]
                retied += 1
    for t, node in zip(spec.outputs, results):
        target = cache_observer.get(t.name)
        if target is None:
            continue
        if observer_of(node) is None:
            raise ValueError(f"{spec.name}: output {t.name} has no observer")
        if node.target != target:
            node.target = target
            retied += 1
    prepared.graph.eliminate_dead_code()
    prepared.recompile()
    return retied


def io_encodings(graph: torch.fx.GraphModule, spec: MethodSpec) -> dict[str, tuple[float, int, str]]:
    """IO name -> (scale, zero point, dtype name) read from a converted PT2E graph of method ``spec``.

    Inputs are read from the quantize op after each placeholder, outputs from the dequantize op that produces them.

    Raises:
        ValueError: the graph's IO does not line up with ``spec``, or an IO that must be quantized is not.
    """
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.graph.nodes if n.op == "output")
    results = list(output.args[0])
    if len(placeholders) != len(spec.inputs) or len(results) != len(spec.outputs):
        raise ValueError(
            f"{spec.name}: the quantized graph has {len(placeholders)} inputs and {len(results)} outputs; "
            f"the contract has {len(spec.inputs)} and {len(spec.outputs)}"
        )
    q_ops = {torch.ops.quantized_decomposed.quantize_per_tensor.default}
    dq_ops = {torch.ops.quantized_decomposed.dequantize_per_tensor.default}
    encodings: dict[str, tuple[float, int, str]] = {}
    for i in sorted(quantized_inputs(spec)):
        quant = [u for u in placeholders[i].users if u.target in q_ops]
        if not quant:
            raise ValueError(f"{spec.name}: input {spec.inputs[i].name} is not quantized in the graph")
        encodings[spec.inputs[i].name] = _encoding(quant[0])
    for t, node in zip(spec.outputs, results):
        if node.target not in dq_ops:
            raise ValueError(f"{spec.name}: output {t.name} is not produced by a dequantize op")
        encodings[t.name] = _encoding(node)
    return encodings


def io_dtype(quant_min: int, quant_max: int) -> torch.dtype:
    """The unsigned dtype of a quantization range. QnnQuantizer writes 16-bit encodings as int32 with the range
    [0, 65535]; at the graph boundary they are uint16 (ExecuTorch's flow tags them so too)."""
    for dtype in (torch.uint8, torch.uint16):
        if (quant_min, quant_max) == (0, torch.iinfo(dtype).max):
            return dtype
    raise ValueError(f"No unsigned IO dtype for the quantization range [{quant_min}, {quant_max}]; export with --float-io")


def _encoding(node: torch.fx.Node) -> tuple[float, int, str]:
    # quantize/dequantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype)
    _, scale, zero_point, quant_min, quant_max = node.args[:5]
    return float(scale), int(zero_point), str(io_dtype(quant_min, quant_max)).removeprefix("torch.")


def integer_io(
    contract: RunnerContract, graphs: dict[str, torch.fx.GraphModule]
) -> tuple[RunnerContract, dict[str, frozenset[int]]]:
    """The contract of a quantized export with integer masks, caches and logits, and per method the positions of
    the inputs to keep integer. Prefill and decode were quantized with shared observers, so their IO encodings must
    agree (a difference raises `RuntimeError` naming the tensors). An assistant's ``hidden`` output stays float32
    (`FLOAT_OUTPUTS`): the drafter reads it beside its own ``hidden_out``, whose range differs."""
    encodings = {name: io_encodings(graph, contract.method(name)) for name, graph in graphs.items()}
    for found in encodings.values():
        for name in FLOAT_OUTPUTS:
            found.pop(name, None)
    first, *others = encodings.values()
    for name, other in zip(list(encodings)[1:], others):
        if other != first:
            diff = sorted(k for k in first if other.get(k) != first[k])
            raise RuntimeError(f"{name}'s IO encodings differ from {next(iter(encodings))}'s for {diff}; export with --float-io")
    return contract.with_quantized_io(first), {name: quantized_inputs(contract.method(name)) for name in graphs}

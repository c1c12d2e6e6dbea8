"""Gemma 4's assistant in the target's variant (``--assistant``, docs/assistant.md#export): the drafter built over
the static target, calibrated on drafter rounds over the target's own caches and hidden states, quantized with the
target's scheme, its IO tied to the target's, and split into as many QNN partitions as the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np
import torch

from optimum_qnn.config import ExportConfig
from optimum_qnn.contract import DECODE_METHOD, DRAFT_METHOD, AttentionKind, MethodSpec, RunnerContract, TensorSpec
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.models.gemma4.assistant import StaticDrafter
from optimum_qnn.quantization.io import FLOAT_OUTPUTS, float_output_positions, io_encodings, quantized_inputs

logger = logging.getLogger(__name__)

# Drafter rounds per calibration sample, at evenly spaced positions; each round runs `draft_len` chained steps.
ROUNDS_PER_SAMPLE = 4


def load_drafter(assistant: str, static) -> StaticDrafter:
    """The assistant (a Hub id or folder, checked by `preflight.check_assistant`) as a `StaticDrafter` over
    ``static``; it adopts the target's input embedding as it is at this point (the CPU lookup of the export)."""
    from optimum_qnn.artifacts.hub import resolve_model_folder
    from optimum_qnn.models.gemma4.loading import load_assistant

    return StaticDrafter.from_hf(load_assistant(resolve_model_folder(assistant)), static)


def drafter_shard_starts(drafter: StaticDrafter, partitions: int, *, weight_sharing: bool) -> tuple[int, ...]:
    """Where the drafter's graph splits so that it lowers into ``partitions`` QNN partitions, the target's count.

    ExecuTorch's weight sharing compiles the i-th partition of every method into one context, and refuses methods
    that split differently ("Only graphs with the same number of partitions could be used"). The drafter splits
    before its own ``layers.N`` (`llama::fallback`, as the target); ordered embeddings add one partition of their
    own (measured: the tiny ordered drafter lowers in 2, around the token ordering left on the CPU).

    Raises:
        InvalidInputError: with weight sharing, a drafter too short to split that many times.
    """
    layers = len(drafter.module.layers)
    splits = partitions - 1 - (drafter.module.masked_embedding is not None)
    if 0 <= splits < layers:
        return tuple(round(i * layers / (splits + 1)) for i in range(1, splits + 1))
    if weight_sharing:
        raise InvalidInputError(
            f"The target lowers in {partitions} QNN partitions (shards), and with weight sharing its drafter must too, "
            f"but the drafter's {layers} layers split into at most {layers + (drafter.module.masked_embedding is not None)}: "
            f"export with --shards {min(layers, partitions)}, or --no-weight-sharing")
    logger.info("The drafter lowers unsplit (%d layers, the target's %d partitions; weights not shared)", layers, partitions)
    return ()


def first_draft_steps(drafter: StaticDrafter, seqs: Sequence[Sequence[int]],
                      rounds: int = ROUNDS_PER_SAMPLE) -> Iterator[tuple[torch.Tensor, ...]]:
    """Inputs of the first drafter step of rounds over ``seqs``, as the host hands them over: the target (eager, its
    ``hidden`` output) fed up to position ``p``, its caches, its hidden state at ``p - 1`` and the token at ``p``.
    Positions are spread over each sample, within the drafter's cache slots; the tensors are copies."""
    session = drafter.target.session()
    decode, last = session.methods[DECODE_METHOD], []

    def recording(inputs):
        last[:] = [decode(inputs)]
        return last[0]

    session.methods = {**session.methods, DECODE_METHOD: recording}
    spec = drafter.method
    slots = min(t.shape[-1] for t in spec.inputs if t.name.startswith("k_cache_"))
    shapes = {t.name: t.shape for t in spec.inputs}
    for seq in seqs:
        end = min(len(seq) - 1, slots)
        if end < 2:
            continue
        session.reset()
        fed = 0
        for p in sorted({int(p) for p in np.linspace(2, end, rounds)}):
            if p - 1 > fed:
                session.feed(np.asarray(seq[fed : p - 1], dtype=np.int64))
            session.feed(np.asarray(seq[p - 1 : p], dtype=np.int64))  # one token: row 0 of a decode call is p - 1
            fed = p
            caches = {}
            for layer, k, v in zip(session.cache_layers, session.k_bufs, session.v_bufs):
                for name, buf in ((f"k_cache_{layer.index}", k), (f"v_cache_{layer.index}", v)):
                    if name in shapes:
                        caches[name] = torch.from_numpy(np.array(buf[tuple(slice(0, n) for n in shapes[name])]))
            full, sliding = drafter.masks(p)
            given = {"tokens": torch.tensor([[seq[p]]]), "hidden": torch.as_tensor(last[0][-1])[:, :1].clone(),
                     "atten_mask": full, "sliding_atten_mask": sliding,
                     "input_pos": torch.tensor([[p]], dtype=torch.int32), **caches}
            yield tuple(given[t.name] for t in spec.inputs)


def run_round(module, first: Sequence[torch.Tensor], spec: MethodSpec, draft_len: int) -> list:
    """``draft_len`` chained drafter steps from ``first``: each takes the previous step's argmax and ``hidden_out``
    at the same position (docs/assistant.md); returns each step's outputs."""
    names = [t.name for t in spec.inputs]
    inputs, outputs = list(first), []
    for _ in range(draft_len):
        logits, hidden_out = module(*inputs)
        outputs.append((logits, hidden_out))
        inputs[names.index("tokens")] = logits.argmax(-1).view(1, 1).to(torch.int64)
        inputs[names.index("hidden")] = hidden_out
    return outputs


def quantize_drafter(drafter: StaticDrafter, program: torch.export.ExportedProgram, config: ExportConfig,
                     seqs: Sequence[Sequence[int]], target: RunnerContract | None = None) -> torch.fx.GraphModule:
    """The drafter PT2E-quantized with ``config``'s scheme (QnnQuantizer; no per-module overrides: their patterns name
    the target's modules), calibrated on `first_draft_steps` rounds of ``config.draft_len`` steps.

    ``target``: the target's deployed contract with integer IO; the drafter then reads the target's uint16 masks and
    cache buffers as they are, so those inputs take the target's encodings (its observers are set to them).

    Raises:
        RuntimeError: an input's encoding does not come out as the target's.
    """
    from optimum_qnn.progress import bar
    from optimum_qnn.quantization.kernels import row_gather_lookups
    from optimum_qnn.quantization.pt2e import make_quantizer, quantize

    quantizer = make_quantizer(config.quant, block_size=config.block_size, soc=config.socs[0])
    spec = drafter.method
    fixed = target_encodings(spec, target) if target is not None else {}

    def calibrate(prepared) -> None:
        # The target runs eagerly here, and ExecuTorch's reference lookups dequantize a whole table per call
        # (Gemma-4-E2B's per-layer table: 9.4 GB in float32; the full-size export was killed for memory here).
        with row_gather_lookups():
            for first in bar(first_draft_steps(drafter, seqs), "Calibrating the drafter", "round"):
                run_round(prepared, first, spec, config.draft_len)
        if fixed:
            set_input_observers(prepared, spec, fixed)

    graph = quantize(program, calibrate, quantizer)
    if fixed:
        found = io_encodings(graph, spec)
        wrong = sorted(n for n, (scale, zp, dtype) in fixed.items()
                       if found[n][1:] != (zp, dtype) or not np.isclose(found[n][0], scale, rtol=1e-6, atol=0))
        if wrong:
            raise RuntimeError(f"The drafter's inputs {wrong} did not take the target's encodings; export with --float-io")
    return graph


def target_encodings(spec: MethodSpec, target: RunnerContract) -> dict[str, tuple[float, int, str]]:
    """Input name -> the target's (scale, zero point, dtype) for every drafter input the target passes as integers
    (masks and caches, named as in the target's decode method)."""
    decode = {t.name: t for t in target.method(DECODE_METHOD).inputs}
    return {spec.inputs[i].name: (decode[n].scale, decode[n].zero_point, decode[n].dtype)
            for i in sorted(quantized_inputs(spec)) if (n := spec.inputs[i].name) in decode and decode[n].quantized}


def set_input_observers(prepared: torch.fx.GraphModule, spec: MethodSpec,
                        encodings: dict[str, tuple[float, int, str]]) -> None:
    """Set the observer after each named input placeholder to the range whose encoding is ``encodings[name]``.

    Raises:
        RuntimeError: an input without exactly one min/max observer, or one whose range is not unsigned (a graph input
            read straight by a matmul takes its symmetric int16 encoding: `StaticGemma4Assistant` adds `+ 0.0` first).
    """
    from torchao.quantization.pt2e.observer import _is_activation_post_process

    placeholders = [n for n in prepared.graph.nodes if n.op == "placeholder"]
    for t, node in zip(spec.inputs, placeholders):
        if t.name not in encodings:
            continue
        scale, zero_point, _ = encodings[t.name]
        users = [prepared.get_submodule(u.target) for u in node.users if u.op == "call_module"]
        observers = [m for m in users if _is_activation_post_process(m)]
        if len(observers) != 1 or not hasattr(observers[0], "min_val") or observers[0].quant_min != 0:
            raise RuntimeError(f"{spec.name}: expected one unsigned min/max observer on input {t.name}, found {observers}")
        obs = observers[0]
        obs.min_val = torch.tensor((obs.quant_min - zero_point) * scale)
        obs.max_val = torch.tensor((obs.quant_max - zero_point) * scale)


def deployed_draft_method(spec: MethodSpec, target: RunnerContract) -> MethodSpec:
    """``spec`` with the target's integer encodings on the inputs the target passes as integers (masks, caches):
    the drafter's IO in the manifest. Its ``hidden`` input and both outputs stay float32."""
    encodings = target_encodings(spec, target)

    def io(t: TensorSpec) -> TensorSpec:
        if t.name not in encodings:
            return t
        scale, zero_point, dtype = encodings[t.name]
        return TensorSpec(t.name, t.shape, dtype, scale, zero_point)

    return replace(spec, inputs=tuple(map(io, spec.inputs)))


def assistant_info(drafter: StaticDrafter, model_id: str, draft_len: int):
    """The manifest's `AssistantInfo` of this drafter."""
    from optimum_qnn.artifacts.manifest import AssistantInfo, DraftSources
    from optimum_qnn.models.gemma4.assistant import drafter_sources

    sources = drafter_sources(drafter.target.contract.layers)
    return AssistantInfo(
        model_id=model_id, draft_len=draft_len, method=DRAFT_METHOD, verify_ar=draft_len + 1,
        hidden_size=drafter.method.inputs[1].shape[-1], sliding_window=drafter.window,
        source_layers=DraftSources(sources[AttentionKind.FULL].index, sources[AttentionKind.SLIDING].index),
    )


def with_drafter(contract: RunnerContract, drafter: StaticDrafter) -> RunnerContract:
    """The deployed contract with the drafter's method last (its integer inputs in the target's encodings)."""
    return replace(contract, methods=(*contract.methods, deployed_draft_method(drafter.method, contract)))


def float_outputs(contract: RunnerContract) -> dict[str, tuple[int, ...]]:
    """Method name -> output positions that stay float32 with integer IO: the target's ``hidden``
    (`quantization.io.FLOAT_OUTPUTS`) and both of the drafter's outputs, which its manifest entry records as float32
    (`deployed_draft_method`; its logits had come out uint16 unrecorded: -105 dB against its graph, read as floats)."""
    positions = {m.name: float_output_positions(m) for m in contract.methods
                 if any(t.name in FLOAT_OUTPUTS for t in m.outputs)}
    return positions | {DRAFT_METHOD: tuple(range(len(contract.method(DRAFT_METHOD).outputs)))}


def quantize_for_export(drafter: StaticDrafter, program, config: ExportConfig, tokenizer, texts,
                        target: RunnerContract | None) -> torch.fx.GraphModule:
    """`quantize_drafter` on the export's calibration text (the samples the target was calibrated on)."""
    from optimum_qnn.contract import PREFILL_METHOD
    from optimum_qnn.quantization.ptq import calibration_sequences

    static = drafter.target
    method = PREFILL_METHOD if config.mode.has_prefill else DECODE_METHOD
    return quantize_drafter(drafter, program, config, calibration_sequences(static, tokenizer, texts, method), target)

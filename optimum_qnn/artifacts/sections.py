"""The manifest's view of the exporter's objects: a `RunnerContract` and a mixed-precision plan, as the
dataclasses of `optimum_qnn.artifacts.manifest` (which only reads and checks manifests) hold them."""

from __future__ import annotations

from optimum_qnn.artifacts.manifest import (
    AssistantInfo, Contract, ImagesInfo, Layer, LinearPlanRow, LookaheadInfo, Method, MixedPrecision, TensorIO,
)


def mixed_precision_section(plan) -> MixedPrecision | None:
    """The manifest's view of an `optimum_qnn.quantization.mixed_precision.MixedPlan` (None: no plan)."""
    if plan is None:
        return None
    rows = [LinearPlanRow(r.module, r.params, round(min(r.sqnr_db, 200.0), 2), r.kept) for r in plan.rows]  # JSON has no inf
    return MixedPrecision(plan.budget, plan.high.value, round(plan.kept_share, 4), rows, plan.probes)


_FULL_UPDATE = "smart_mask: copy k_new/v_new into slots [n_past, n_past+n) of caches [.., C-1]; nothing shifts"
_RING_UPDATE = (_FULL_UPDATE + "; sliding layers: a ring of sliding_window slots, k_new/v_new of position p into slot "
                "p % sliding_window, sliding_atten_mask over the ring's slots then the call's own tokens")
_BLOCKS_UPDATE = (_RING_UPDATE + " (where the window is shorter than C - 1); every other cache: inputs of "
                  "block_len slots, block b holding slots [b * block_len, (b + 1) * block_len)")


def contract_section(contract, *, weight_sharing: bool, shards: int = 1, lookahead=None,
                     assistant: AssistantInfo | None = None, images: ImagesInfo | None = None) -> Contract:
    """The manifest's view of a `RunnerContract` (with an assistant, its ``draft_forward`` is one of the methods)."""
    d = contract.to_dict()
    return Contract(
        context_len=d["context_len"],
        vocab_size=d["vocab_size"],
        sliding_window=d["sliding_window"],
        mask_attend=float(d["mask_attend"]),
        mask_masked=float(d["mask_masked"]),
        rope="tables inside the graph, indexed by input_pos; partial RoPE on full layers is zero-padded",
        kv_update={"ring": _RING_UPDATE, "blocks": _BLOCKS_UPDATE}.get(d["cache_layout"], _FULL_UPDATE),
        weight_sharing=weight_sharing,
        layers=[Layer(**layer) for layer in d["layers"]],
        methods=[
            Method(
                m["name"], m["ar_len"],
                [TensorIO(t["name"], list(t["shape"]), t["dtype"], t["scale"], t["zero_point"]) for t in m["inputs"]],
                [TensorIO(t["name"], list(t["shape"]), t["dtype"], t["scale"], t["zero_point"]) for t in m["outputs"]],
            )
            for m in d["methods"]
        ],
        shards=shards,
        cache_layout=d["cache_layout"],
        lookahead=None if lookahead is None else LookaheadInfo(**lookahead.to_dict()),
        block_len=d["block_len"],
        assistant=assistant,
        images=images,
    )

"""The constant methods of a variant's .pte that ExecuTorch's Qualcomm LLM runner reads (``get_max_seq_len``...)."""

from __future__ import annotations

from optimum_qnn.contract import RunnerContract


def runner_metadata(static, contract: RunnerContract | None = None) -> dict[str, int | float | bool]:
    """Constant methods matching ExecuTorch's Qualcomm LLM runner, so its runners find what they read.

    ``contract``: the deployed contract (integer IO of a quantized export); the static model's by default."""
    cfg = static.text_config
    contract = contract or static.contract
    layers = contract.layers
    sliding = [l for l in layers if l.attention.value == "sliding_attention"]
    full = [l for l in layers if l.attention.value == "full_attention"]
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else (cfg.eos_token_id or [1])[0]
    meta: dict[str, int | float | bool] = {
        "get_ar_len": contract.methods[0].ar_len,
        "get_bos_id": int(cfg.bos_token_id if cfg.bos_token_id is not None else -1),
        "get_eos_id": int(eos),
        "get_dim": cfg.hidden_size,
        "get_head_dim": (sliding or full)[0].head_dim,
        "get_global_head_dim": (full or sliding)[0].head_dim,
        "get_max_batch_size": 1,
        "get_max_seq_len": contract.context_len,
        "get_max_context_len": contract.context_len,
        "get_n_bos": 1,
        "get_n_eos": 1,
        "get_n_kv_heads": layers[0].kv_heads,
        "get_n_layers": cfg.num_hidden_layers,
        "get_n_self_layers": len(contract.cache_layers),
        "get_vocab_size": cfg.vocab_size,
        "get_use_kv_cache": True,
        "get_sliding_window": contract.sliding_window or 0,
        "get_num_kv_shared_layers": cfg.num_kv_shared_layers,
    }
    meta["get_kv_io_bit_width"] = contract.kv_io_bits
    logits = contract.methods[0].outputs[0]
    if logits.quantized:  # what ExecuTorch's host scripts read to dequantize uint16 logits
        meta["get_logits_scale"] = logits.scale
        meta["get_logits_zero_point"] = logits.zero_point
    return meta

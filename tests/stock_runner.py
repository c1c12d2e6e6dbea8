"""The host side of ExecuTorch's `qnn_llama_runner`, rewritten in Python for the conformance tests.

Written from the runner's C++ sources (ExecuTorch main of 2026-08, `examples/qualcomm/oss_scripts/llama/runner/`:
`kv_manager.cpp`, `prompt_processor.cpp`, `token_generator.cpp`), independently of `optimum_qnn.session`, so a test
can feed an exported .pte exactly what the stock runner feeds it and compare with what `QNNModelForCausalLM` gets:
- everything is read from the program the way the runner reads it: `get_n_self_layers` and `get_sliding_window`
  constant methods, AR and context length from the mask input `[1, 1, AR, CL]`, dtypes from the method signatures;
- SMART_MASK KV management: one K buffer `[kv * hd, cache_len]` and one V buffer `[kv, cache_len, hd]` per cache
  layer, sized for the smallest AR; `rearrange_cache` memmoves the rows when the graph (and so cache_len = CL - AR)
  changes; new K/V outputs are copied to slots `[n_past, n_past + n_update)`;
- masks with the runner's values (float 0 / -65535, uint16 65535 / 0): past columns `[0, n_past)` and the call's own
  columns `[CL - AR, CL)` causal; the sliding mask also closes past columns older than the window;
- prefill: every chunk of the prompt through the prefill method, the last chunk's padding rows keeping the previous
  chunk's tokens, positions `start + i` for all AR rows (int32); the first token from row `(n - 1) % AR`;
- decode: the cache rearranged to AR 1, one token per call, argmax on the raw logits.
"""

from __future__ import annotations

import torch

PREFILL, DECODE = "prefill_forward", "kv_forward"
_DTYPES = {6: torch.float32, 4: torch.int64, 3: torch.int32, 27: torch.uint16, 0: torch.uint8}


class StockRunnerHost:
    def __init__(self, program, methods: dict):
        """``methods``: the program's loaded graph methods. A second `load_method` of a QNN method would share the
        first one's delegate handle and destroy it when dropped, so the caller hands over the ones it has."""
        names = program.method_names
        self.methods = {name: methods[name] for name in (PREFILL, DECODE) if name in names}
        self.n_self = int(program.load_method("get_n_self_layers").execute([])[0])
        window = int(program.load_method("get_sliding_window").execute([])[0]) if "get_sliding_window" in names else 0
        self.meta = {name: program.metadata(name) for name in self.methods}
        decode = self.meta[DECODE]
        self.context_len = decode.input_tensor_meta(1).sizes()[-1]
        self.window = window or self.context_len
        self.ar_lens = {name: meta.input_tensor_meta(1).sizes()[2] for name, meta in self.meta.items()}
        self.mask_dtype = _DTYPES[decode.input_tensor_meta(1).dtype()]
        self.cache_dtype = _DTYPES[decode.input_tensor_meta(4).dtype()]
        self.token_dtype = _DTYPES[decode.input_tensor_meta(0).dtype()]
        # K input i: [1, kv, hd, CL - AR]; V input i: [1, kv, CL - AR, hd].
        self.k_shapes = [decode.input_tensor_meta(4 + i).sizes() for i in range(self.n_self)]
        self.v_shapes = [decode.input_tensor_meta(4 + self.n_self + i).sizes() for i in range(self.n_self)]
        max_cache = self.context_len - min(self.ar_lens.values())
        self.k = [torch.zeros(s[1] * s[2] * max_cache, dtype=self.cache_dtype) for s in self.k_shapes]
        self.v = [torch.zeros(s[1] * max_cache * s[3], dtype=self.cache_dtype) for s in self.v_shapes]
        self.cur_ar = max(self.ar_lens.values())
        self.calls: list[str] = []

    # --- masks -------------------------------------------------------------------------------------------------
    def _values(self) -> tuple[float, float]:
        if self.mask_dtype == torch.float32:
            return 0.0, -65535.0
        return float(torch.iinfo(self.mask_dtype).max), 0.0

    def _init_mask(self, ar: int, n_past: int, window: int | None) -> torch.Tensor:
        pos, neg = self._values()
        mask = torch.full((ar, self.context_len), neg, dtype=torch.float64)
        new = self.context_len - ar
        for i in range(ar):
            mask[i, :n_past] = pos
            mask[i, new : new + i + 1] = pos  # the parent rows' own columns, then itself
            if window is not None:
                available = window - (i + 1) - n_past
                if available < 0:
                    mask[i, :-available] = neg
        return mask

    def _update_mask(self, mask: torch.Tensor, n_past: int, n_update: int, window: int | None) -> None:
        pos, neg = self._values()
        for i in range(mask.shape[0]):
            mask[i, n_past : n_past + n_update] = pos
            if window is not None:
                available = window - (i + 1)
                if n_past + n_update > available:
                    mask[i, : n_past + n_update - available] = neg

    # --- caches ------------------------------------------------------------------------------------------------
    def _rearrange(self, ar_dst: int) -> None:
        if ar_dst == self.cur_ar:
            return
        src, dst = self.context_len - self.cur_ar, self.context_len - ar_dst
        for layer in range(self.n_self):
            _, kv, hd, _ = self.k_shapes[layer]
            _memmove_rows(self.k[layer], kv * hd, src, dst, 1)
            _memmove_rows(self.v[layer], kv, src, dst, self.v_shapes[layer][3])
        self.cur_ar = ar_dst

    def _cache_inputs(self, ar: int) -> list[torch.Tensor]:
        n = self.context_len - ar
        ks = [buf[: s[1] * s[2] * n].view(1, s[1], s[2], n) for buf, s in zip(self.k, self.k_shapes)]
        vs = [buf[: s[1] * n * s[3]].view(1, s[1], n, s[3]) for buf, s in zip(self.v, self.v_shapes)]
        return ks + vs

    def _update_cache(self, outputs, ar: int, n_past: int, n_update: int) -> None:
        n = self.context_len - ar
        for layer in range(self.n_self):
            _, kv, hd, _ = self.k_shapes[layer]
            k_out = outputs[1 + layer].reshape(kv * hd, ar)
            self.k[layer][: kv * hd * n].view(kv * hd, n)[:, n_past : n_past + n_update] = k_out[:, :n_update]
            v_out = outputs[1 + self.n_self + layer].reshape(kv, ar, -1)
            vd = self.v_shapes[layer][3]
            self.v[layer][: kv * n * vd].view(kv, n, vd)[:, n_past : n_past + n_update] = v_out[:, :n_update]

    # --- calls -------------------------------------------------------------------------------------------------
    def _run(self, name: str, tokens, mask, window_mask, pos) -> list[torch.Tensor]:
        ar = self.ar_lens[name]
        inputs = [
            tokens.view(1, ar).to(self.token_dtype),
            mask.view(1, 1, ar, -1).to(self.mask_dtype),
            window_mask.view(1, 1, ar, -1).to(self.mask_dtype),
            pos.view(1, ar).to(torch.int32),
            *[t.contiguous() for t in self._cache_inputs(ar)],
        ]
        self.calls.append(name)
        return self.methods[name].execute(inputs)

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy generation as the runner does it; returns the new tokens and the logits of the first one."""
        n_past = 0
        name = PREFILL if PREFILL in self.methods else DECODE
        ar = self.ar_lens[name]
        if n_past + len(prompt) > self.context_len - ar:
            raise ValueError("The sequence length exceeds the maximum limit that the prompt processor can handle.")
        self._rearrange(ar)
        mask, window_mask = self._init_mask(ar, n_past, None), self._init_mask(ar, n_past, self.window)
        tokens = torch.zeros(ar, dtype=torch.int64)
        iters = 1 + (len(prompt) - 1) // ar
        for i in range(iters):
            chunk = prompt[i * ar : (i + 1) * ar]
            tokens[: len(chunk)] = torch.tensor(chunk)  # padding rows keep the previous chunk's tokens
            pos = torch.arange(n_past, n_past + ar)
            outputs = self._run(name, tokens, mask, window_mask, pos)
            n_update = ar if i < iters - 1 else 1 + (len(prompt) - 1) % ar
            self._update_cache(outputs, ar, n_past, n_update)
            self._update_mask(mask, n_past, n_update, None)
            self._update_mask(window_mask, n_past, n_update, self.window)
            n_past += ar
        # The prompt processor advances by whole AR blocks; a partial last block leaves n_past at the prompt length.
        n_past = len(prompt)
        first_logits = outputs[0].reshape(ar, -1)[(len(prompt) + ar - 1) % ar].clone()
        token = _argmax(first_logits)
        new = [token]
        self._rearrange(1)
        mask, window_mask = self._init_mask(1, n_past, None), self._init_mask(1, n_past, self.window)
        while len(new) < max_new_tokens:
            outputs = self._run(DECODE, torch.tensor([token]), mask, window_mask, torch.tensor([n_past]))
            self._update_cache(outputs, 1, n_past, 1)
            self._update_mask(mask, n_past, 1, None)
            self._update_mask(window_mask, n_past, 1, self.window)
            n_past += 1
            token = _argmax(outputs[0].reshape(-1))
            new.append(token)
        return new, first_logits


def _argmax(logits: torch.Tensor) -> int:
    """Argmax on the raw values, as the runner takes it (uint16 has no argmax kernel in torch: widen it first)."""
    return int((logits if logits.is_floating_point() else logits.to(torch.int64)).argmax())


def _memmove_rows(buf: torch.Tensor, rows: int, src: int, dst: int, width: int) -> None:
    """`rows` blocks of ``src * width`` elements re-laid out as blocks of ``dst * width`` (the runner's memmoves)."""
    n = min(src, dst) * width
    order = range(rows) if dst < src else range(rows - 1, -1, -1)
    for r in order:
        buf[r * dst * width : r * dst * width + n] = buf[r * src * width : r * src * width + n].clone()

"""Host-side KV management of the runner contract, shared by eager static runs and the .pte runtime.

Caches are preallocated once per generation: one K buffer ``[1, kv, hd, C-1]`` and one V buffer
``[1, kv, C-1, hd]`` per cache-owning layer (the decode method's size, the largest). A method with ar_len N
reads the first C-N slots. After each call the host copies the new K/V slices into slots
``[n_past, n_past + n)`` and opens those mask columns on the next call ("smart mask": nothing ever shifts).

In the ring cache layout (`CacheLayout.RING`) a sliding layer's buffers hold ``sliding_window`` slots instead: the
host writes position p into slot ``p % window`` and builds the sliding mask over the ring's columns
(``ops.mask.ring_mask``); full-attention layers keep the full-length buffers above.

In the blocks layout (`CacheLayout.BLOCKS`) each cache that is no ring is a list of block buffers, block b holding
slots ``[b * block_len, (b + 1) * block_len)`` of the ``C - 1``; a method reads each block's slots below its own
``C - ar`` (`contract.column_blocks`), and a call's new K/V are written across the blocks they fall in.

The other inputs (tokens, positions, the two masks) are preallocated per method too. A decode step that follows
another decode step updates its masks in place (one column opens, and with a sliding window one closes); any other
call rewrites them from ``ops.mask.attention_mask``.

Everything here is numpy, so a runtime without torch drives the same session: a method is any callable from numpy
inputs to array outputs (onnxruntime's sessions, ExecuTorch's methods through `torch_method`, the exporter's eager
graphs). ``feed`` answers in the kind of array it was given: numpy for numpy or lists, torch for torch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from optimum_qnn.contract import (DECODE_METHOD, HIDDEN_OUTPUT, PREFILL_METHOD, AttentionKind, RunnerContract,
                                  column_blocks)
from optimum_qnn.errors import ContextOverflowError, InvalidInputError
from optimum_qnn.ops.arrays import as_numpy, is_torch, like
from optimum_qnn.ops.mask import MASK_MIN, attention_mask, ring_mask, tree_mask

MethodFn = Callable[[Sequence[np.ndarray]], Sequence[Any]]


def torch_method(fn: Callable[..., Sequence[Any]], *, grad: bool = False) -> MethodFn:
    """``fn(*tensors)``, a method of torch tensors, as a session method: each numpy input becomes a tensor sharing
    its memory (with ``grad=True`` a copy: autograd keeps inputs for the backward pass, and the session rewrites its
    buffers in place between calls). The outputs stay torch tensors: the session copies the new K/V into its numpy
    caches and hands the logits back as they are, so with ``grad=True`` they keep their autograd graph."""
    import torch

    def run(inputs: Sequence[np.ndarray]) -> Sequence[Any]:
        args = [torch.from_numpy(np.array(a) if grad else a) for a in inputs]
        with torch.set_grad_enabled(grad):
            return fn(*args)

    return run


class KVSession:
    """Runs a prompt and decode steps through the contract's methods, keeping the caches between calls.

    Args:
        contract: the runner contract of the export.
        methods: method name -> callable taking the inputs in contract order and returning the outputs.
    """

    def __init__(self, contract: RunnerContract, methods: dict[str, MethodFn]):
        self.contract = contract
        self.methods = methods
        self.decode_spec = contract.method(DECODE_METHOD)
        self.prefill_spec = contract.method(PREFILL_METHOD) if PREFILL_METHOD in methods else None
        dec_inputs = {t.name: t for t in self.decode_spec.inputs}
        self.cache_layers = contract.cache_layers
        # Quantized exports take integer caches whose new K/V outputs carry the cache's own encoding: the host
        # copies them unchanged and never dequantizes a cache.
        # Which caches are rings (sliding layers of a ring layout): the same buffer in every method, written at p % R.
        self.ring_len = contract.ring_len
        self.is_ring = [contract.is_ring(l) for l in self.cache_layers]
        # C - 1 slots, whatever the decode method's ar_len (a lookahead export's is above 1); a ring keeps its own.
        # A blocked cache is a list of its blocks' buffers (the blocks of C - 1 slots).
        self.blocks = column_blocks(contract.context_len - 1, contract.block_len)
        self.k_bufs: list = []
        self.v_bufs: list = []
        for layer, ring in zip(self.cache_layers, self.is_ring):
            k_spec, v_spec = (dec_inputs[contract.cache_input_names(kind, layer)[0]] for kind in "kv")
            if contract.is_blocked(layer):
                self.k_bufs.append([_zeros(k_spec, -1, e - s) for s, e in self.blocks])
                self.v_bufs.append([_zeros(v_spec, -2, e - s) for s, e in self.blocks])
            else:
                slots = None if ring else contract.context_len - 1
                self.k_bufs.append(_zeros(k_spec, -1, slots))
                self.v_bufs.append(_zeros(v_spec, -2, slots))
        # The ids whose K/V were written, slot j holding position j: what `truncate` reads again when a ring has
        # overwritten the window the kept tokens need.
        self.ids = np.zeros(contract.context_len, dtype=np.int64)
        self.logits_spec = self.decode_spec.outputs[0]
        self.mask_spec = self.decode_spec.inputs[1]
        self.n_past = 0
        self._method_inputs: dict[str, _MethodInputs] = {}
        self._pending: Sequence[Any] | None = None  # the outputs of the last tree_call, until accept()
        # The last call's final hidden states [tokens, hidden_size] (float32), in a variant whose methods output
        # them (built with an assistant: docs/assistant.md); None otherwise.
        self.hidden: np.ndarray | None = None

    @property
    def capacity(self) -> int:
        """Tokens that fit in one generation: the decode method's cache slots plus the token of the last call (the
        context, unless decode calls take several tokens: a lookahead export's)."""
        return self.decode_spec.cache_len + 1

    @property
    def stored(self) -> int:
        """How many leading tokens of the context have their K/V in the cache slots (at most C - 1)."""
        return min(self.n_past, self.contract.context_len - 1)

    def reset(self) -> None:
        # Stale slots are never read (their mask columns stay closed), so the buffers need no clearing.
        self.n_past = 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the context and forget the rest: the next call writes from slot ``n``.

        Anywhere is fine, also inside what one prefill call wrote: slots ``>= n`` become stale, and stale slots are
        never read (the masks of the next call are built for ``n_past = n``). A ring keeps only the last
        ``ring_len`` positions: when the tokens after ``n`` have overwritten the window the kept ones need, the
        first ``n`` tokens are fed again (a prefill of ``n`` tokens; the K/V come out the same)."""
        if not 0 <= n <= self.stored:
            raise ValueError(f"Cannot keep {n} tokens: the cache holds {self.stored}")
        if self.ring_len is not None and max(0, n - self.contract.sliding_window + 1) < self.n_past - self.ring_len:
            kept = self.ids[:n].copy()
            self.n_past = 0
            if n:
                self.feed(kept)
            return
        self.n_past = n

    def _inputs_of(self, spec) -> "_MethodInputs":
        buffers = self._method_inputs.get(spec.name)
        if buffers is None:
            c = self.contract
            buffers = self._method_inputs[spec.name] = _MethodInputs(
                spec.ar_len, c.context_len, c.sliding_window, self.mask_spec.dtype, c.mask_attend, c.mask_masked,
                ring_len=c.ring_len, image_size=spec.image_width,
            )
        return buffers

    def _call(self, spec, chunk: np.ndarray, images: "SoftTokens | None" = None) -> np.ndarray:
        """One call of ``spec`` on up to ar_len tokens (padded after the real ones), with the soft tokens among
        them (``images``, the chunk's rows); returns their logits."""
        cache_len = spec.cache_len
        n_valid = chunk.size
        if self.n_past > cache_len:
            raise ContextOverflowError(f"{self.n_past} tokens do not fit the {cache_len} cache slots of {spec.name}")
        buffers = self._inputs_of(spec)
        buffers.update(chunk, self.n_past)
        if spec.takes_images:
            buffers.set_images(images)
        outputs = self.methods[spec.name](self._inputs(spec, buffers))
        self._keep_hidden(spec, outputs, n_valid)
        self._store(outputs, chunk, np.arange(n_valid))
        logits = outputs[0][0, :n_valid]
        return self.logits_spec.dequantize(logits) if self.logits_spec.quantized else logits

    def _keep_hidden(self, spec, outputs: Sequence[Any], n_valid: int) -> None:
        """``self.hidden``: the ``hidden`` output's rows of the call's ``n_valid`` tokens (a copy: a runtime may
        reuse its output buffers), or None when the method has no such output."""
        out = spec.outputs[-1]
        if out.name != HIDDEN_OUTPUT:
            self.hidden = None
            return
        rows = np.array(as_numpy(outputs[-1])[0, :n_valid])
        self.hidden = out.dequantize(rows) if out.quantized else rows

    def _store(self, outputs: Sequence[Any], tokens: np.ndarray, rows: np.ndarray) -> None:
        """Copy the new K/V of the call's ``rows`` (ascending) into the slots after ``n_past``, in that order, as
        the K/V of ``tokens``; ``n_past`` grows by ``len(rows)``."""
        n = len(self.cache_layers)
        lo, hi = self.n_past, self.n_past + rows.size
        # The cache has C - 1 slots: a call that fills the context to C leaves one token whose K/V no later call
        # can read, so it is not stored.
        keep = min(hi, self.contract.context_len - 1) - lo
        self.ids[lo : lo + keep] = tokens[:keep]
        contiguous = rows.size == 0 or rows[-1] - rows[0] == rows.size - 1
        picked = slice(int(rows[0]), int(rows[0]) + keep) if contiguous and rows.size else rows[:keep]
        # A ring keeps the last ring_len of the new positions, position p in slot p % ring_len.
        first = max(0, keep - self.ring_len) if self.ring_len is not None else 0
        ring_slots = (np.arange(lo + first, lo + keep) % self.ring_len) if self.ring_len is not None else None
        for i in range(n):
            k_new, v_new = as_numpy(outputs[1 + i]), as_numpy(outputs[1 + n + i])
            if self.is_ring[i]:  # tree calls are refused with a ring, chain calls keep rows 0..n: rows are 0..n here
                self.k_bufs[i][..., ring_slots] = k_new[..., first:keep]
                self.v_bufs[i][:, :, ring_slots, :] = v_new[:, :, first:keep, :]
                continue
            if isinstance(self.k_bufs[i], list):
                self._store_blocks(i, k_new[..., picked], v_new[:, :, picked, :], lo)
                continue
            self.k_bufs[i][..., lo : lo + keep] = k_new[..., picked]
            self.v_bufs[i][:, :, lo : lo + keep, :] = v_new[:, :, picked, :]
        self.n_past = hi

    def _store_blocks(self, i: int, k_new: np.ndarray, v_new: np.ndarray, lo: int) -> None:
        """Write the new columns of cache ``i`` (slots from ``lo`` on) into the blocks they fall in."""
        hi = lo + k_new.shape[-1]
        for (start, end), k_buf, v_buf in zip(self.blocks, self.k_bufs[i], self.v_bufs[i]):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                k_buf[..., a - start : b - start] = k_new[..., a - lo : b - lo]
                v_buf[:, :, a - start : b - start, :] = v_new[:, :, a - lo : b - lo, :]

    def tree_call(self, tokens: np.ndarray, parents: Sequence[int], offsets: Sequence[int]) -> np.ndarray:
        """One decode call on a tree of tokens (lookahead decoding): row i at position ``n_past + offsets[i]``,
        continuing row ``parents[i]`` (`ops.mask.tree_mask`). Returns the rows' logits ``[len(tokens), vocab]``;
        nothing is stored until `accept` picks the rows whose tokens were accepted.

        Raises:
            InvalidInputError: a ring cache layout (its sliding mask has no tree form).
            ContextOverflowError: the cache has no room for the call.
        """
        if self.ring_len is not None:
            raise InvalidInputError("Lookahead decoding needs the full cache layout; this variant has --cache-layout ring")
        tokens = np.asarray(tokens, dtype=np.int64)
        return self._pending_call(tokens, lambda b: b.tree(tokens, self.n_past, list(parents), list(offsets)))

    def chain_call(self, tokens: np.ndarray) -> np.ndarray:
        """One decode call on consecutive tokens (speculative decoding's verification: the last token and the
        drafts), the tree whose row i continues row i - 1, in either cache layout (its masks are a prefill's).
        Returns their logits; nothing is stored until `accept` keeps a prefix of the rows (``rows`` 0, 1, ...).

        Raises:
            ContextOverflowError: the cache has no room for the call.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        return self._pending_call(tokens, lambda b: b.update(tokens, self.n_past))

    def _pending_call(self, tokens: np.ndarray, fill: Callable[["_MethodInputs"], None]) -> np.ndarray:
        """One decode call whose inputs ``fill`` writes; its outputs wait for `accept`."""
        spec = self.decode_spec
        if self.n_past > spec.cache_len:
            raise ContextOverflowError(f"{self.n_past} tokens do not fit the {spec.cache_len} cache slots of {spec.name}")
        buffers = self._inputs_of(spec)
        fill(buffers)
        self._pending = self.methods[spec.name](self._inputs(spec, buffers))
        self._keep_hidden(spec, self._pending, len(tokens))
        logits = as_numpy(self._pending[0])[0, : len(tokens)]
        return self.logits_spec.dequantize(logits) if self.logits_spec.quantized else logits

    def accept(self, tokens: Sequence[int], rows: Sequence[int]) -> None:
        """Keep the K/V of ``rows`` (ascending) of the last `tree_call`, whose tokens are ``tokens``, in the slots
        after ``n_past``: the accepted path of the tree; the other rows' K/V are dropped."""
        outputs, self._pending = self._pending, None
        if outputs is None:
            raise RuntimeError("accept() follows a tree_call()")
        self._store(outputs, np.asarray(tokens, dtype=np.int64), np.asarray(rows, dtype=np.int64))

    def _inputs(self, spec, buffers: "_MethodInputs") -> list[np.ndarray]:
        cache_len = spec.cache_len
        inputs: list[np.ndarray] = [buffers.tokens, buffers.mask, buffers.sliding_mask, buffers.pos]
        blocks = column_blocks(cache_len, self.contract.block_len)  # this method's: the first C - ar slots
        for bufs, axis in ((self.k_bufs, -1), (self.v_bufs, -2)):
            for buf, ring in zip(bufs, self.is_ring):
                if isinstance(buf, list):
                    inputs += [_first(b, axis, e - s) for b, (s, e) in zip(buf, blocks)]
                else:
                    inputs.append(buf if ring else _first(buf, axis, cache_len))
        if spec.takes_images:
            inputs += [buffers.image_embeds, buffers.image_mask]
        return inputs

    def _check(self, ids: Any, capacity: int | None = None) -> np.ndarray:
        ids = as_numpy(ids).reshape(-1)
        capacity = capacity or self.capacity
        if ids.size == 0:
            raise InvalidInputError("Cannot feed an empty sequence of token ids")
        if self.n_past + ids.size > capacity:
            raise ContextOverflowError(
                f"{self.n_past} + {ids.size} tokens exceed the exported context of {capacity} tokens; "
                "shorten the prompt or export with a larger --max-seq-len"
            )
        vocab = self.contract.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidInputError(f"Token ids must lie in [0, {vocab}); got min {int(ids.min())}, max {int(ids.max())}")
        return ids

    def feed(self, ids: Any, images: "SoftTokens | None" = None) -> Any:
        """Append ``ids`` (1-D: numpy, a list, or a torch tensor) to the context; returns their logits
        ``[len(ids), vocab]`` (float32; a torch tensor when ``ids`` is one, else numpy).

        Whole prefill chunks go through the prefill method while they fit; the rest goes token by token. ``images``:
        soft tokens among ``ids`` (an image variant's), which only the prefill method takes: every chunk up to the
        last soft token goes through it. At a soft token's place ``ids`` hold the pad id, as Gemma4Model looks it up.
        """
        given, ids = ids, self._check(ids)
        last_image = self._check_images(images, ids.size)
        logits: list[np.ndarray] = []
        start = 0
        spec = self.prefill_spec
        while spec is not None and start < ids.size and self.n_past <= spec.cache_len and (ids.size - start > 1 or start <= last_image):
            chunk = ids[start : start + spec.ar_len]
            logits.append(self._call(spec, chunk, images and images.rows(start, start + chunk.size)))
            start += chunk.size
        if start <= last_image:
            raise ContextOverflowError(f"The soft tokens up to position {self.n_past + last_image} do not fit the "
                                       f"{spec.cache_len} cache slots of {spec.name}, the method that takes them")
        for i in range(start, ids.size):
            logits.append(self._call(self.decode_spec, ids[i : i + 1]))
        return _joined(given, logits)

    def _check_images(self, images: "SoftTokens | None", n: int) -> int:
        """The index of the last soft token among ``n`` ids (-1: none); refuses soft tokens this session cannot take."""
        if images is None or not images.mask.any():
            return -1
        spec = self.prefill_spec
        if spec is None or not spec.takes_images:
            raise InvalidInputError("This variant takes no images (its prefill method has no soft-token inputs); "
                                    "export it with --task image-text-to-text")
        width = spec.image_width
        if images.mask.shape != (n,) or images.embeds.shape != (n, width):
            raise InvalidInputError(f"Soft tokens must be [{n}, {width}] rows with a mask of {n}; got "
                                    f"{images.embeds.shape} and {images.mask.shape}")
        return int(np.flatnonzero(images.mask)[-1])

    def feed_method(self, method: str, ids: Any, images: "SoftTokens | None" = None) -> Any:
        """Append ``ids`` through one method only, in calls of its ar_len (the last one padded); ``images``: soft
        tokens among them (`feed`), for a method that takes them."""
        given, ids = ids, self._check(ids, self.contract.context_len)  # each call checks its own cache room
        spec = self.contract.method(method)
        logits = [self._call(spec, ids[start : start + spec.ar_len], images and images.rows(start, start + spec.ar_len))
                  for start in range(0, ids.size, spec.ar_len)]
        return _joined(given, logits)


def _joined(given: Any, logits: list[Any]) -> Any:
    """The calls' logits as one array of the kind ``given`` is (torch tensors from a torch method are joined as they
    are, keeping their autograd graph)."""
    if is_torch(logits[0]):
        import torch

        joined = torch.cat(logits, dim=0)
        return joined if is_torch(given) else as_numpy(joined)
    return like(given, np.concatenate(logits, axis=0))


def _first(buf: np.ndarray, slot_axis: int, n: int) -> np.ndarray:
    """The first ``n`` slots of a cache buffer on ``slot_axis`` (the buffer itself when it has ``n``)."""
    if buf.shape[slot_axis] == n:
        return buf
    return buf[..., :n] if slot_axis == -1 else buf[:, :, :n, :]


def _zeros(spec, slot_axis: int, slots: int | None) -> np.ndarray:
    """Zeros of ``spec``, with ``slots`` slots on ``slot_axis`` (None: the spec's own, a ring's)."""
    shape = list(spec.shape)
    if slots is not None:
        shape[slot_axis] = slots
    return np.zeros(shape, dtype=spec.dtype)


class SoftTokens:
    """An image's embeddings among a prompt's ids: ``embeds`` ``[n, hidden]`` float32 (rows where ``mask`` is False
    are not read) and ``mask`` ``[n]`` bool, True at each soft token's place."""

    def __init__(self, embeds: Any, mask: Any):
        self.embeds = np.asarray(as_numpy(embeds), dtype=np.float32)
        self.mask = np.asarray(as_numpy(mask), dtype=bool).reshape(-1)

    def rows(self, start: int, end: int) -> "SoftTokens":
        return SoftTokens(self.embeds[start:end], self.mask[start:end])


class _MethodInputs:
    """The preallocated non-cache inputs of one method: tokens, both masks and positions, updated in place.

    Masks hold ``attend`` / ``masked`` (float 0 / `MASK_MIN`, or their quantized values for integer IO)."""

    def __init__(self, ar_len: int, context_len: int, window: int | None, mask_dtype: Any = np.float32,
                 attend: float = 0.0, masked: float = MASK_MIN, *, ring_len: int | None = None,
                 image_size: int | None = None):
        self.ar_len, self.context_len, self.window, self.ring_len = ar_len, context_len, window, ring_len
        self.attend, self.masked = attend, masked
        self.tokens = np.zeros((1, ar_len), dtype=np.int64)
        self.pos = np.zeros((1, ar_len), dtype=np.int32)
        self.mask = np.empty((1, 1, ar_len, context_len), dtype=mask_dtype)
        sliding_cols = context_len if ring_len is None else ring_len + ar_len
        self.sliding_mask = np.empty((1, 1, ar_len, sliding_cols), dtype=mask_dtype)
        self._state: tuple[int, int] | None = None  # (n_past, n_valid) the masks describe
        if image_size is not None:
            self.image_embeds = np.zeros((1, ar_len, image_size), dtype=np.float32)
            self.image_mask = np.zeros((1, ar_len, 1), dtype=np.float32)

    def set_images(self, images: SoftTokens | None) -> None:
        """The soft-token inputs of the next call: ``images``' rows, zeros (text) elsewhere."""
        self.image_embeds[...] = 0
        self.image_mask[...] = 0
        if images is not None:
            n = images.mask.size
            self.image_mask[0, :n, 0] = images.mask
            self.image_embeds[0, :n][images.mask] = images.embeds[images.mask]

    def update(self, chunk: np.ndarray, n_past: int) -> None:
        n_valid = chunk.size
        self.tokens[...] = 0
        self.tokens[0, :n_valid] = chunk
        np.minimum(np.arange(n_past, n_past + self.ar_len), self.context_len - 1, out=self.pos[0], casting="unsafe")
        if self.ar_len == 1 and self._state == (n_past - 1, 1):
            self._step(n_past)
        elif self._state != (n_past, n_valid):
            ar, ctx = self.ar_len, self.context_len
            self.mask[...] = self._values(attention_mask(ar, ctx, n_past, n_valid=n_valid))
            if self.ring_len is None:
                self.sliding_mask[...] = self._values(attention_mask(ar, ctx, n_past, window=self.window, n_valid=n_valid))
        if self.ring_len is not None:  # a ring's columns change meaning every call: rebuilt (window + ar columns)
            ring = ring_mask(self.ar_len, self.ring_len, n_past, window=self.window, n_valid=n_valid)
            self.sliding_mask[...] = self._values(ring)
        self._state = (n_past, n_valid)

    def tree(self, tokens: np.ndarray, n_past: int, parents: list[int], offsets: list[int]) -> None:
        """Inputs of a call on a tree of tokens (`KVSession.tree_call`); padding rows sit at ``n_past``."""
        self.tokens[...] = 0
        self.tokens[0, : tokens.size] = tokens
        self.pos[...] = n_past
        self.pos[0, : len(offsets)] = np.minimum(n_past + np.asarray(offsets), self.context_len - 1)
        ar, ctx = self.ar_len, self.context_len
        self.mask[...] = self._values(tree_mask(parents, offsets, ar, ctx, n_past))
        self.sliding_mask[...] = self._values(tree_mask(parents, offsets, ar, ctx, n_past, window=self.window))
        self._state = None  # the next `update` rebuilds both masks

    def _values(self, mask: np.ndarray) -> np.ndarray:
        """``attention_mask``'s 0 / `MASK_MIN` as this input's values."""
        if self.attend == 0.0 and self.masked == MASK_MIN:
            return mask
        return np.where(mask == 0, self.attend, self.masked)

    def _step(self, n_past: int) -> None:
        """Decode masks of ``n_past - 1`` -> ``n_past``: slot ``n_past - 1`` now holds the previous token."""
        opened = n_past - 1
        self.mask[..., opened] = self.attend
        if self.ring_len is not None:  # `update` rebuilds the ring's mask
            return
        if self.window is None:
            self.sliding_mask[..., opened] = self.attend
            return
        if self.window > 1:
            self.sliding_mask[..., opened] = self.attend
        closed = n_past - self.window  # the token at n_past no longer sees slot n_past - window
        if closed >= 0:
            self.sliding_mask[..., closed] = self.masked

"""Execution paths of a streaming MoE block: where the stacked experts come from.

Every path ends in the same :func:`expert_glu` call; they differ only in the
weights they hand it (and so in what they read and when):

- ``ExactPath``: read the union of routed experts into one reused set of K
  rows (fresh buffers for a larger union, e.g. a prompt chunk).
- ``HotPath``: gather from the hot cache's rows, reading misses into it
  (the exact path for a routed set larger than the cache); for a prompt
  chunk, with a :class:`NextLayerRouting`, it also queues reads of what the
  next layer will likely route.
- ``StagedPath``: fill this layer's staging buffer, gather via the
  device-side slot table (a routed set larger than the buffer goes to the
  decode fallback: hot or exact).
- ``WholeLayerPath``: prompt chunks; the whole layer, read ahead.

Each path receives what it uses in its constructor (store, tiers, telemetry,
compute dtype, the path it falls back to); paths compose, none inherits from
another or knows the runtime. A path is chosen once per forward from the
token count and the options (:meth:`StreamingRuntime.path`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .expert_math import expert_glu
from .hot import HotCache
from .prefill import WholeLayerLoader
from .slots import SlotBuffers
from .staging import StagingBuffer
from .store import ExpertStore
from .telemetry import Telemetry

Union = tuple[np.ndarray, np.ndarray]  # sorted unique expert ids, each index's position among them


def routed_union(layer: int, inds: mx.array, telemetry: Telemetry) -> Union:
    """Sorted unique experts of ``inds`` and each index's position among them
    (a host sync); appended to ``telemetry.routing_trace`` when one is recording,
    counted in ``telemetry.routing_counts`` when one is counting."""
    host = np.array(inds)  # evaluates the graph up to this layer's router
    telemetry.count_routings(layer, host)
    ids, inverse = np.unique(host, return_inverse=True)
    if telemetry.routing_trace is not None:
        telemetry.routing_trace.append((layer, ids.tolist()))
    return ids, inverse.reshape(host.shape)


class ExactPath:
    name = "exact"

    def __init__(
        self,
        store: ExpertStore,
        telemetry: Telemetry,
        compute_dtype: Optional[mx.Dtype],
        pool_dtype: Optional[mx.Dtype],
        rows: int,
    ):
        self.store = store
        self.telemetry = telemetry
        self.compute_dtype = compute_dtype
        self.pool_dtype = pool_dtype
        self.rows = rows
        # Rows for one routed set (K), reused by every call whose union fits:
        # allocating and zeroing a fresh buffer per decode call costs time on
        # every step (BENCHMARKS.md, "Measurements behind code comments").
        # Larger unions get fresh buffers.
        self.scratch: Optional[SlotBuffers] = None

    def begin(self, layer: int) -> None:
        pass

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        return self.from_union(layer, x, inds, routed_union(layer, inds, self.telemetry))

    def from_union(self, layer: int, x: mx.array, inds: mx.array, union: Union) -> mx.array:
        ids, local = union
        local = mx.array(local.astype(np.uint32))
        if len(ids) > self.rows:
            return expert_glu(x, local, self.store.read(layer, ids, self.compute_dtype))
        if self.scratch is None:
            self.scratch = SlotBuffers(self.store.geometry, self.rows, self.pool_dtype)
        # Rewriting the rows settles their readers: free in decode, where this
        # layer's sync evaluated them.
        self.store.submit(layer, ids, range(len(ids)), self.scratch, urgent=True).wait()
        return self.scratch.compute(x, local, self.compute_dtype)


class NextLayerRouting:
    """The lookahead's guess of the next MoE layer's routing: that layer's own
    router and routing math applied to this layer's input. Adjacent layers'
    inputs differ by one residual update, so most of a token's experts are
    the same; the guess only decides what is read early, never the routing.

    Args:
        layers: the MoE layers in order (each one's guess is for the next).
        gates: layer -> its router (input ``[B, L, D]`` -> logits).
        routes: layer -> its routing math (logits -> indices, scores).
    """

    def __init__(
        self,
        layers: Sequence[int],
        gates: dict[int, Callable[[mx.array], mx.array]],
        routes: dict[int, Callable[[mx.array], tuple[mx.array, mx.array]]],
    ):
        self.next_of = dict(zip(layers, layers[1:]))
        self.gates = gates
        self.routes = routes

    def guess(self, layer: int, x: mx.array) -> Optional[tuple[int, mx.array, mx.array]]:
        """(next layer, its guessed indices and scores ``[B, L, K]``),
        unevaluated; None after the last."""
        following = self.next_of.get(layer)
        if following is None:
            return None
        return (following, *self.routes[following](self.gates[following](x)))


def surest_first(inds: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The experts of a guessed routing, by their summed routing score, highest
    first (ties by id): the order their reads are queued in."""
    ids, where = np.unique(inds.ravel(), return_inverse=True)
    total = np.bincount(where, weights=scores.ravel().astype(np.float64), minlength=len(ids))
    return ids[np.argsort(-total, kind="stable")]


class HotPath:
    name = "hot"

    def __init__(
        self,
        hot: HotCache,
        exact: ExactPath,
        telemetry: Telemetry,
        compute_dtype: Optional[mx.Dtype],
        lookahead: Optional[NextLayerRouting] = None,
    ):
        self.hot = hot
        self.exact = exact
        self.telemetry = telemetry
        self.compute_dtype = compute_dtype
        self.lookahead = lookahead

    def begin(self, layer: int) -> None:
        pass

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        # Prompt chunks only: a decode step's compute between its layers' reads
        # is too short to hide the guesses' wrong reads behind (BENCHMARKS.md,
        # "Reading the next layer's guess ahead").
        chunk = x.shape[1] > 1
        guess = self.lookahead.guess(layer, x) if self.lookahead is not None and chunk else None
        if guess is not None:
            mx.eval(inds, guess[1], guess[2])  # the one host sync this call makes anyway
            following, likely, scores = guess
            guess = following, surest_first(np.array(likely), np.array(scores.astype(mx.float32)))
        union = routed_union(layer, inds, self.telemetry)
        return self.from_union(layer, x, inds, union, guess)

    def from_union(
        self, layer: int, x: mx.array, inds: mx.array, union: Union, guess: Optional[tuple[int, np.ndarray]] = None
    ) -> mx.array:
        """The experts of a routing whose union is on the host; ``guess``: the
        next layer and its likely experts, surest first, whose misses are
        queued to read into the hot cache behind this call's own
        (:class:`NextLayerRouting`)."""
        ids, local = union
        self.hot.settle_prefetch(layer, ids)  # what was read ahead for this call has landed
        pending = self.hot.start_fetch(layer, ids)
        if guess is not None:
            self.hot.start_prefetch(guess[0], guess[1], keep={(layer, int(e)) for e in ids})
        if pending is None:  # the routed set is larger than the whole cache
            return self.exact.from_union(layer, x, inds, union)
        rows, missed = pending.rows[local], pending.missed[local]
        # A decode call names its rows, so writes into other rows need not wait
        # for it; a chunk's larger output is kept only until the next write.
        named = rows if x.shape[1] == 1 else None
        if local.size != local.shape[-1] or missed.all() or not missed.any():
            self.hot.finish_fetch(pending)
            return self.hot.buffers.compute(x, mx.array(rows.astype(np.uint32)), self.compute_dtype, named, rows)
        # One token, some of its experts resident: compute those while the
        # others are read, so the disk and the compute work at once. Each
        # expert's output is the same product either way; they are put back in
        # the routed order, so the block's weighted sum adds them in the order
        # one call would.
        flat, lead = rows.ravel(), local.shape[:-1]

        def compute(picked: np.ndarray) -> mx.array:
            picked_rows = mx.array(flat[picked].astype(np.uint32)).reshape(*lead, -1)
            return self.hot.buffers.compute(x, picked_rows, self.compute_dtype, flat[picked])

        hits, misses = np.flatnonzero(~missed.ravel()), np.flatnonzero(missed.ravel())
        try:
            from_hits = compute(hits)
            mx.async_eval(from_hits)
        finally:  # the misses' rows are being written: settle them whatever happens
            self.hot.finish_fetch(pending)
        from_misses = compute(misses)
        self.telemetry.current.hot_overlapped += 1
        routed_order = mx.array(np.argsort(np.concatenate([hits, misses])).astype(np.uint32))
        return mx.take(mx.concatenate([from_hits, from_misses], axis=-2), routed_order, axis=-2)


class StagedPath:
    name = "staged"

    def __init__(
        self,
        buffers: dict[int, StagingBuffer],
        fallback: "ExactPath | HotPath",
        hot: Optional[HotCache],
        telemetry: Telemetry,
        compute_dtype: Optional[mx.Dtype],
    ):
        self.buffers = buffers
        self.fallback = fallback
        self.hot = hot
        self.telemetry = telemetry
        self.compute_dtype = compute_dtype

    def begin(self, layer: int) -> None:
        pass

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        union = routed_union(layer, inds, self.telemetry)
        buffer = self.buffers[layer]
        if len(union[0]) > buffer.capacity:
            self.telemetry.current.staged_fallbacks += 1
            return self.fallback.from_union(layer, x, inds, union)
        if self.hot is not None:  # a prompt chunk's guesses (hot path) for this layer: landed or dropped
            self.hot.settle_prefetch(layer, union[0])
        fill = buffer.stage(union[0], self.hot)
        try:
            fill.reads.wait()
        except BaseException:
            buffer.invalidate()
            raise
        return buffer.rows.compute(x, mx.take(fill.slot_table, inds), self.compute_dtype)


class WholeLayerPath:
    """Prompt chunks. With a hot cache, the layer's most-routed experts are
    copied into it from the whole-layer rows (:meth:`HotCache.copy_prompt_experts`):
    a decode after a long prompt then starts from them, not from an empty
    cache, for a memcpy instead of a read."""

    name = "whole-layer"

    def __init__(
        self,
        loader: WholeLayerLoader,
        telemetry: Telemetry,
        compute_dtype: Optional[mx.Dtype],
        hot: Optional[HotCache] = None,
    ):
        self.loader = loader
        self.telemetry = telemetry
        self.compute_dtype = compute_dtype
        self.hot = hot

    def begin(self, layer: int) -> None:
        self.loader.start(layer)

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        # Compute everything up to this router while this layer's read (started
        # by the previous layer) lands; then start the next layer's read.
        mx.eval(inds)
        rows = self.loader.take(layer)
        if self.hot is not None or self.telemetry.routing_counts is not None:
            host = np.array(inds)
            self.telemetry.count_routings(layer, host)
            if self.hot is not None:
                self.hot.copy_prompt_experts(layer, host.ravel(), rows, self.loader.row_of_expert)
        return expert_glu(x, self.loader.rows(inds), rows.weights().with_scales_dtype(self.compute_dtype))

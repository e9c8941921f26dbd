"""Execution paths of a streaming MoE block: where the stacked experts come from.

Every path ends in the same :func:`expert_glu` call; they differ only in the
weights they hand it (and so in what they read and when):

- ``ExactPath``: read the union of routed experts into one reused set of K
  rows (fresh buffers for a larger union, e.g. a prompt chunk).
- ``HotPath``: gather from the hot cache's rows, reading misses into it.
- ``StagedPath``: fill this layer's staged slots, gather via the
  device-side slot table (current-step routing until the prerouter predicts).
- ``WholeLayerPath``: prompt chunks; the whole layer, read ahead.

A path is chosen once per forward from the token count and the options
(:meth:`StreamingRuntime.path_for`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
import numpy as np

from .expert_math import expert_glu
from .slots import SlotBuffers

if TYPE_CHECKING:
    from .runtime import StreamingRuntime


class ExactPath:
    name = "exact"

    def __init__(self, runtime: "StreamingRuntime"):
        self.runtime = runtime
        # Rows for one routed set (K), reused by every call whose union fits:
        # allocating and zeroing a fresh buffer per decode call costs time on
        # every step (BENCHMARKS.md, "Measurements behind code comments").
        # Larger unions get fresh buffers.
        self.scratch: Optional[SlotBuffers] = None

    def begin(self, layer: int) -> None:
        pass

    def routed_union(self, layer: int, inds: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """Sorted unique experts and each index's position among them (host
        sync); appended to the runtime's routing trace when one is recording."""
        host = np.array(inds)  # evaluates the graph up to this layer's router
        ids, inverse = np.unique(host, return_inverse=True)
        trace = self.runtime.routing_trace
        if trace is not None:
            trace.append((layer, ids.tolist()))
        return ids, inverse.reshape(host.shape)

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        rt = self.runtime
        ids, local = self.routed_union(layer, inds)
        local = mx.array(local.astype(np.uint32))
        if len(ids) > max(rt.k_of.values()):
            return expert_glu(x, local, rt.store.read(layer, ids, rt.compute_dtype))
        if self.scratch is None:
            self.scratch = SlotBuffers(rt.store.geometry, max(rt.k_of.values()), rt.pool_dtype)
        # Rewriting the rows settles their readers: free in decode, where this
        # layer's sync evaluated them.
        rt.store.submit(layer, ids, range(len(ids)), self.scratch, urgent=True).wait()
        return self.scratch.compute(x, local, rt.compute_dtype)


class HotPath(ExactPath):
    name = "hot"

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        rt = self.runtime
        ids, local = self.routed_union(layer, inds)
        rows = rt.hot.fetch(layer, ids)
        if rows is None:  # the routed set is larger than the whole cache
            return rt.exact.experts(layer, x, inds)
        return rt.hot.buffers.compute(x, mx.array(rows[local].astype(np.uint32)), rt.compute_dtype)


class StagedPath(ExactPath):
    name = "staged"

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        rt = self.runtime
        ids, _ = self.routed_union(layer, inds)
        slots = rt.staged[layer]
        if len(ids) > slots.slots:
            rt.telemetry.current.staged_fallbacks += 1
            return rt.decode_fallback.experts(layer, x, inds)
        staged = slots.stage(ids, rt.hot)
        try:
            staged.reads.wait()
        except BaseException:
            slots.invalidate()
            raise
        return slots.buffers.compute(x, mx.take(staged.slot_table, inds), rt.compute_dtype)


class WholeLayerPath(ExactPath):
    name = "whole-layer"

    def begin(self, layer: int) -> None:
        self.runtime.loader.start(layer)

    def experts(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        rt = self.runtime
        # Compute everything up to this router while this layer's read (started
        # by the previous layer) lands; then start the next layer's read.
        mx.eval(inds)
        weights = rt.loader.take(layer).with_scales_dtype(rt.compute_dtype)
        return expert_glu(x, inds, weights)

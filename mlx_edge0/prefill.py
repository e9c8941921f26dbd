"""Whole-layer prefill: a prompt chunk reads each MoE layer whole, once.

A chunk of many tokens routes to most experts of every layer, so reading the
layer's file in a few large sequential ``preadv`` runs beats building it
expert by expert. When layer l is taken, the read of the next MoE layer
starts, so it overlaps layer l's compute; the main thread waits only at the
layer that needs the data. Rows are in expert-id order, so the routed indices
index the stack directly, exactly as the resident ``SwitchGLU`` does (an
expert-parallel rank reads only its own experts, and :meth:`rows` maps the
routed ids to their rows). Buffers
are released after use; at most two layers are held.

Page cache: explicit, ``Options.page_cache``. "keep" (default) leaves the
whole-layer reads in the OS page cache, so decode misses right after a prompt
hit memory; "drop-prefill" evicts them once they are in our buffers, so a
prompt does not pull the whole checkpoint into the page cache. Decode reads
are always left cached: they recur. Measured: BENCHMARKS.md, "Page-cache
policy".
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .slots import SlotBuffers
from .store import ExpertStore, ReadBatch


class WholeLayerLoader:
    """Reads whole MoE layers ahead of the compute that needs them."""

    def __init__(
        self,
        store: ExpertStore,
        moe_layers: Sequence[int],
        scales_dtype: Optional[mx.Dtype],
        drop_pages: bool = False,
        experts: Optional[Sequence[int]] = None,
    ):
        """``experts``: the sorted expert ids read of each layer (default all)."""
        self.store = store
        n = store.geometry.num_experts
        self.experts = list(range(n)) if experts is None else [int(e) for e in experts]
        row_of = np.zeros(n, np.uint32)
        row_of[self.experts] = np.arange(len(self.experts), dtype=np.uint32)
        self.row_of = None if len(self.experts) == n else mx.array(row_of)
        self.row_of_expert = {e: row for row, e in enumerate(self.experts)}  # a taken layer's rows
        self.drop_pages = drop_pages
        self.scales_dtype = scales_dtype
        self.next_layer = dict(zip(moe_layers, list(moe_layers[1:]) + [None]))
        self.pending: dict[int, tuple[SlotBuffers, ReadBatch]] = {}

    @property
    def layer_bytes(self) -> int:
        return len(self.experts) * self.store.geometry.bundle_bytes

    def start(self, layer: Optional[int]) -> None:
        """Begin reading ``layer`` whole (no-op if already pending)."""
        if layer is None or layer in self.pending:
            return
        n = len(self.experts)
        buffers = SlotBuffers(self.store.geometry, n, self.scales_dtype)
        reads = self.store.submit(layer, self.experts, range(n), buffers, drop_pages=self.drop_pages)
        self.pending[layer] = (buffers, reads)

    def take(self, layer: int) -> SlotBuffers:
        """The whole layer's rows (waiting for its reads); starts the next layer's
        read. A failed read drops the read-ahead too: the forward is over, and
        the next one must read the files as they are then."""
        self.start(layer)
        self.start(self.next_layer[layer])
        buffers, reads = self.pending.pop(layer)
        try:
            reads.wait()
        except BaseException:
            self.clear()
            raise
        self.store.telemetry.current.whole_layer_loads += 1
        return buffers

    def rows(self, inds: mx.array) -> mx.array:
        """The rows of a taken layer that hold routed experts ``inds``."""
        return inds if self.row_of is None else mx.take(self.row_of, inds)

    def clear(self) -> None:
        """Drop read-ahead layers (after their reads end): decode does not need them."""
        for _, reads in self.pending.values():
            reads.settle()
        self.pending.clear()

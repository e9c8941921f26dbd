"""Staged slots: per MoE layer, a fixed double buffer holding exactly the
experts a decode step computes with.

Each layer owns two :class:`SlotBuffers` of ``slots`` rows. A step fills the
buffer the previous step did *not* compute from, so a fill (later: the
prerouter's fill for step t+1, issued while step t computes) never writes a
row an unevaluated graph still reads. Filling is incremental: a slot whose
expert is unchanged is kept; a changed slot is copied from a resident bundle
(the other buffer, the hot cache) or read from disk in place. The device-side
slot table (expert id -> slot) turns routed indices into rows with a ``take``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .expert_math import ExpertWeights
from .hot import HotCache
from .slots import SlotBuffers
from .store import ExpertStore, ReadBatch


@dataclass(frozen=True)
class StagePlan:
    """Where each wanted expert will sit: kept in place, or rewritten."""

    slot_of: dict[int, int]  # expert -> slot, for every wanted expert
    kept: tuple[int, ...]  # experts already in their slot
    rewrites: tuple[tuple[int, int], ...]  # (slot, expert) to fill


def plan_staging(wanted: Sequence[int], contents: np.ndarray) -> StagePlan:
    """Keep wanted experts where they are; put the others into slots whose
    expert is not wanted (free slots first, then lowest index)."""
    where = {int(e): s for s, e in enumerate(contents) if e >= 0}
    wanted = [int(e) for e in wanted]
    if len(wanted) > len(contents):
        raise ValueError(f"{len(wanted)} experts do not fit {len(contents)} slots")
    kept = tuple(e for e in wanted if e in where)
    keep_slots = {where[e] for e in kept}
    open_slots = sorted(
        (s for s in range(len(contents)) if s not in keep_slots),
        key=lambda s: (contents[s] >= 0, s),
    )
    new = [e for e in wanted if e not in where]
    rewrites = tuple(zip(open_slots, new))
    slot_of = {e: where[e] for e in kept}
    slot_of.update({e: s for s, e in rewrites})
    return StagePlan(slot_of, kept, rewrites)


@dataclass(frozen=True)
class StagedSet:
    """One staged fill: which buffer, its slot table, the reads in flight."""

    buffer: int
    slot_table: mx.array  # [num_experts] int32, expert id -> slot
    reads: ReadBatch


class StagedSlots:
    """The double buffer of one MoE layer (see the module docstring)."""

    def __init__(self, store: ExpertStore, layer: int, slots: int, scales_dtype: Optional[mx.Dtype]):
        self.store = store
        self.layer = layer
        self.slots = slots
        self.buffers = [SlotBuffers(store.geometry, slots, scales_dtype) for _ in range(2)]
        self.contents = [np.full(slots, -1, np.int64) for _ in range(2)]
        self.active = 1  # the buffer the last step computed from

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def stage(self, ids: Sequence[int], hot: Optional[HotCache] = None, fill_hot: bool = True) -> StagedSet:
        """Fill the inactive buffer with experts ``ids`` and make it active.

        Bundles resident in the other buffer or the hot cache are copied. With
        ``fill_hot`` the misses are read through the hot cache first (disk ->
        cache -> slot, synchronously); without it they are read straight into
        the slots in the background, which is what a prediction-driven fill
        wants (so those reads are read-ahead; with ``fill_hot`` they are
        urgent: the caller waits for them next). Call on the compute thread
        once nothing unevaluated reads that buffer (it was last used two steps
        ago). Returns at once; wait on ``reads``.
        """
        b = 1 - self.active
        other = 1 - b
        self.buffers[b].settle_readers()
        plan = plan_staging(ids, self.contents[b])
        stats = self.store.telemetry.current
        stats.staged_kept += len(plan.kept)
        buf, contents = self.buffers[b], self.contents[b]
        in_other = {int(e): s for s, e in enumerate(self.contents[other]) if e >= 0}
        need = [(slot, e) for slot, e in plan.rewrites if e not in in_other]
        if hot is not None and need and fill_hot:
            rows = hot.fetch(self.layer, [e for _, e in need])
            from_hot = dict(zip(need, rows)) if rows is not None else {}
        elif hot is not None:
            from_hot = {(s, e): r for s, e in need if (r := hot.row(self.layer, e)) is not None}
        else:
            from_hot = {}
        to_read: list[tuple[int, int]] = []
        for slot, e in plan.rewrites:
            if e in in_other:
                buf.copy_row(self.buffers[other], in_other[e], slot)
                stats.staged_copied += 1
            elif (slot, e) in from_hot:
                buf.copy_row(hot.buffers, int(from_hot[(slot, e)]), slot)
                stats.staged_copied += 1
            else:
                to_read.append((slot, e))
            contents[slot] = e
        stats.staged_read += len(to_read)
        reads = self.store.submit(self.layer, [e for _, e in to_read], [s for s, _ in to_read], buf,
                                  urgent=fill_hot)
        table = np.zeros(self.store.geometry.num_experts, np.int32)
        for e, s in plan.slot_of.items():
            table[e] = s
        self.active = b
        return StagedSet(b, mx.array(table), reads)

    def grow(self, slots: int) -> None:
        """Hold at least ``slots`` experts per buffer (a batch's routed union
        can exceed K). New buffers start empty; graphs still reading the old
        ones keep them alive, so nothing in flight is overwritten."""
        if slots <= self.slots:
            return
        self.slots = slots
        self.buffers = [SlotBuffers(self.store.geometry, slots, self.buffers[0].scales_dtype) for _ in range(2)]
        self.contents = [np.full(slots, -1, np.int64) for _ in range(2)]

    def invalidate(self, buffer: int) -> None:
        """Forget a buffer's contents (after a failed fill its rows are garbage)."""
        self.contents[buffer][:] = -1

    def weights(self, buffer: int) -> ExpertWeights:
        return self.buffers[buffer].weights()

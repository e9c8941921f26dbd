"""Staging buffers: per MoE layer, one fixed buffer holding exactly the experts
a decode step computes with.

A :class:`StagingBuffer` is one :class:`SlotBuffers` of ``capacity`` rows
(slots). Staging a set of experts into it is a :class:`Fill`. A fill is
incremental: a slot whose expert is still wanted is kept in place; a changed
slot is copied from the hot cache or read from disk in place. Before any row
is rewritten, every computation recorded as reading the buffer is evaluated
(:meth:`SlotBuffers.rows_for_writing`), so a fill never changes a step that
already used the rows. That costs no overlap: the prerouter's fill for step
t+1 starts when step t+1 opens, after a sync that needs step t's heads, i.e.
nearly all of step t (at most the last layers are still computing, and their
fills are needed last). One buffer instead of two halves the staged memory
and removes the copies between buffers. The device-side slot table (expert
id -> slot) turns routed indices into rows with a ``take``.

A window (``Options.staged_window``) is a few of these buffers that
the prerouted layers take in turn (:meth:`StagingBuffer.retarget`), filled
while the layers a couple of places before them compute; an "auto" window
gets more of them between steps.
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
class Fill:
    """One staging of a set of experts: its slot table and the reads in flight."""

    slot_table: mx.array  # [num_experts] int32, expert id -> slot
    reads: ReadBatch
    read: tuple[tuple[int, int], ...] = ()  # (slot, expert) filled from disk


class StagingBuffer:
    """The staging buffer of one MoE layer (see the module docstring)."""

    def __init__(self, store: ExpertStore, layer: int, capacity: int, scales_dtype: Optional[mx.Dtype]):
        self.store = store
        self.layer = layer
        self.rows = SlotBuffers(store.geometry, capacity, scales_dtype)
        self.contents = np.full(capacity, -1, np.int64)  # expert in each slot, -1: none

    @property
    def capacity(self) -> int:
        return self.rows.capacity

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def stage(self, ids: Sequence[int], hot: Optional[HotCache] = None, fill_hot: bool = True) -> Fill:
        """Fill the buffer with experts ``ids``.

        Bundles resident in the hot cache are copied. With ``fill_hot`` the
        misses are read through the hot cache first (disk -> cache -> slot,
        synchronously); without it they are read straight into the slots in
        the background, which is what a prediction-driven fill wants (so
        those reads are read-ahead; with ``fill_hot`` they are urgent: the
        caller waits for them next), and :attr:`Fill.read` says which slots
        they filled, for the cache to keep copies once they land. Call on the compute thread; graphs still
        reading the buffer are evaluated first. Returns at once; wait on
        ``reads``.
        """
        buf, contents = self.rows, self.contents
        plan = plan_staging(ids, contents)
        stats = self.store.telemetry.current
        stats.staged_kept += len(plan.kept)
        need = list(plan.rewrites)
        if hot is not None and need and fill_hot:
            rows = hot.fetch(self.layer, [e for _, e in need])
            from_hot = dict(zip(need, rows)) if rows is not None else {}
        elif hot is not None:
            from_hot = {(s, e): r for s, e in need if (r := hot.row(self.layer, e)) is not None}
        else:
            from_hot = {}
        to_read: list[tuple[int, int]] = []
        for slot, e in plan.rewrites:
            if (slot, e) in from_hot:
                buf.copy_row(hot.buffers, int(from_hot[(slot, e)]), slot)
                stats.staged_copied += 1
            else:
                to_read.append((slot, e))
            contents[slot] = e
        stats.staged_read += len(to_read)
        reads = self.store.submit(self.layer, [e for _, e in to_read], [s for s, _ in to_read], buf, urgent=fill_hot)
        table = np.zeros(self.store.geometry.num_experts, np.int32)
        for e, s in plan.slot_of.items():
            table[e] = s
        return Fill(mx.array(table), reads, tuple(to_read))

    def grow(self, capacity: int) -> None:
        """Hold at least ``capacity`` experts (a batch's routed union can exceed
        K). The new rows start empty; graphs still reading the old ones keep
        them alive, so nothing in flight is overwritten."""
        if capacity <= self.capacity:
            return
        self.rows = SlotBuffers(self.store.geometry, capacity, self.rows.scales_dtype)
        self.contents = np.full(capacity, -1, np.int64)

    def retarget(self, layer: int) -> None:
        """Hold ``layer``'s experts from the next fill on (the buffers of a
        window serve each prerouted layer in turn): other layers'
        contents are never kept."""
        if layer != self.layer:
            self.layer = layer
            self.invalidate()

    def invalidate(self) -> None:
        """Forget the contents (after a failed fill its rows are garbage)."""
        self.contents[:] = -1

    def weights(self) -> ExpertWeights:
        return self.rows.weights()

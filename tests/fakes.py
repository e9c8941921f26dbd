"""Fakes for unit tests of the decode machinery without a model or files.

:class:`FakeStore` has the :class:`mlx_edge0.store.ExpertStore` interface the
paths, tiers and :class:`mlx_edge0.prerouting.Prerouting` use (``geometry``,
``telemetry``, ``submit``, ``read``): its "reads" copy real int4 bundles,
quantized from seeded random weights, into the target rows at once, through
the same :meth:`SlotBuffers.rows_for_writing` the store writes through.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_edge0.checkpoint import ExpertGeometry
from mlx_edge0.expert_math import ExpertWeights, Projection
from mlx_edge0.slots import SlotBuffers
from mlx_edge0.telemetry import Telemetry

GEOMETRY = ExpertGeometry(num_experts=8, hidden_size=64, intermediate_size=128, scales_dtype="F32")


class FakeReads:
    """A finished :class:`mlx_edge0.store.ReadBatch` (or a failed one)."""

    def __init__(self, loads: int, telemetry: Telemetry, error: Optional[BaseException] = None):
        self.loads, self.telemetry, self.error = loads, telemetry, error
        self.waited = False

    def done(self) -> bool:
        return True

    def settle(self) -> None:
        pass

    def wait(self) -> float:
        if self.waited:
            return 0.0
        self.waited = True
        if self.error is not None:
            self.telemetry.current.read_errors += 1
            raise self.error
        self.telemetry.current.expert_loads += self.loads
        return 0.0  # landed already: no wait


class FakeQueued(FakeReads):
    """One bundle's read from :meth:`FakeStore.queue_reads`: queued (it can be
    cancelled), running, or landed; waiting for it lands it."""

    def __init__(self, land, telemetry: Telemetry, error: Optional[BaseException]):
        super().__init__(1, telemetry, error)
        self.land, self.state = land, "queued"

    def run(self, finish: bool) -> None:
        """Start the read; with ``finish`` land it too."""
        if finish and self.state != "landed":
            if self.error is None:
                self.land()
            self.state = "landed"
        elif self.state == "queued":
            self.state = "running"

    def cancel(self) -> bool:
        if self.state == "queued":
            self.state = "cancelled"
        return self.state == "cancelled"

    def done(self) -> bool:
        return self.state == "landed"

    def wait(self) -> float:
        self.run(finish=True)
        return super().wait()


class FakeStore:
    """Every layer's experts in memory; ``submitted`` logs (layer, ids, urgent),
    or (layer, ids, "queue") for :meth:`queue_reads`, whose reads land at once
    unless ``hold_queue`` keeps them queued until :meth:`run_queue`."""

    def __init__(self, layers: Sequence[int] = (0, 1, 2, 3), geometry: ExpertGeometry = GEOMETRY, seed: int = 0):
        self.geometry = geometry
        self.telemetry = Telemetry()
        self.submitted: list[tuple[int, list[int], bool | str]] = []
        self.fail: Optional[BaseException] = None  # set to make the next reads fail
        self.hold_queue = False
        self.queue: list[FakeQueued] = []
        rng = np.random.default_rng(seed)
        self.bundles: dict[tuple[int, int], list[bytes]] = {}
        for layer in layers:
            for e in range(geometry.num_experts):
                parts = []
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    out_dims, in_dims = geometry.projection_dims(proj)
                    w = mx.array(rng.standard_normal((out_dims, in_dims)).astype(np.float32) * 0.1)
                    q = mx.quantize(w, group_size=geometry.group_size, bits=geometry.bits)
                    parts.extend(np.array(a).tobytes() for a in q)
                self.bundles[(layer, e)] = parts

    def submit(
        self,
        layer: int,
        ids: Sequence[int],
        rows: Sequence[int],
        target: SlotBuffers,
        drop_pages: bool = False,
        urgent: bool = False,
    ) -> FakeReads:
        ids = [int(e) for e in ids]
        self.submitted.append((layer, ids, urgent))
        views = target.rows_for_writing(list(rows))
        if self.fail is None:
            for e, row in zip(ids, views):
                for view, data in zip(row, self.bundles[(layer, e)]):
                    view[:] = data
        return FakeReads(len(ids), self.telemetry, self.fail)

    def queue_reads(self, layer: int, ids: Sequence[int], rows: Sequence[int], target: SlotBuffers) -> list[FakeQueued]:
        ids = [int(e) for e in ids]
        self.submitted.append((layer, ids, "queue"))
        views = target.rows_for_writing(list(rows))
        batches = []
        for e, row in zip(ids, views):

            def land(e=e, row=row):
                for view, data in zip(row, self.bundles[(layer, e)]):
                    view[:] = data

            batch = FakeQueued(land, self.telemetry, self.fail)
            if not self.hold_queue:
                batch.run(finish=True)
            batches.append(batch)
        self.queue.extend(batches)
        return batches

    def run_queue(self, landed: int, running: int = 0) -> None:
        """Land the first ``landed`` reads still queued, in order, and start the
        next ``running``, as the store's one queue thread would."""
        waiting = [b for b in self.queue if b.state in ("queued", "running")]
        for i, batch in enumerate(waiting[: landed + running]):
            batch.run(finish=i < landed)

    def read(self, layer: int, ids: Sequence[int], scales_dtype: Optional[mx.Dtype] = None) -> ExpertWeights:
        target = SlotBuffers(self.geometry, len(ids))
        self.submit(layer, ids, range(len(ids)), target, urgent=True).wait()
        return target.weights().with_scales_dtype(scales_dtype)

    def weights(self, layer: int) -> ExpertWeights:
        """All experts of ``layer`` stacked in id order (the reference)."""
        g = self.geometry
        arrays = []
        for i, (_, part, dtype, shape) in enumerate(g.parts()):
            dt = mx.uint32 if part == "weight" else mx.float32
            np_dt = np.uint32 if part == "weight" else np.float32
            stacked = np.stack(
                [np.frombuffer(self.bundles[(layer, e)][i], np_dt).reshape(shape) for e in range(g.num_experts)]
            )
            arrays.append(mx.array(stacked).astype(dt))
        return ExpertWeights(
            Projection(*arrays[0:3]), Projection(*arrays[3:6]), Projection(*arrays[6:9]), g.group_size, g.bits
        )

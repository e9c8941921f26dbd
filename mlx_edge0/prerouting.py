"""Prediction-as-routing at decode: the prerouter's prediction *is* the routing.

At step t, each owner layer N runs its head on its own input (the
post-attention-norm output) and its top-k one-hots at t and t-1, producing
router logits for the consumer layer N+1 at step t+1. When step t+1 opens
(its first MoE layer), all predictions are turned into routing at once — the
consumer's *own* routing math on the predicted logits, one host sync per step
— and every consumer's staged buffer starts filling with exactly that set. The
consumer layer later waits only for its own reads and computes with those
indices and weights: the staged set is the routed set, so nothing is dropped
and nothing falls back (counted in telemetry: ``prerouted``, ``staged_drops``).

Prefill does not predict, but the heads run on the last prompt token, so the
first decode step is already staged.

Scope: one sequence at a time. A forward with B > 1 (mlx_lm.server batching)
routes every layer with its gate and discards predictions, since per-sequence
prediction state does not yet live in the model's cache entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import mlx.core as mx
import numpy as np

from .expert_math import expert_glu
from .prerouter import PrerouterHead, topk_onehot
from .staged import StagedSet

if TYPE_CHECKING:
    from .runtime import StreamingRuntime
    from .streaming import StreamingMoE


@dataclass(frozen=True)
class Planned:
    """A consumer layer's routing for this step, decided from the prediction."""

    inds: mx.array  # [1, 1, K]
    scores: mx.array  # [1, 1, K]
    ids: np.ndarray  # the unique routed experts (== the staged set)
    staged: StagedSet


class Prerouting:
    """Owner heads, per-owner prediction state, and the staged fills they drive."""

    def __init__(self, runtime: "StreamingRuntime", heads: dict[int, PrerouterHead],
                 consumer_of: dict[int, int]):
        self.runtime = runtime
        self.heads = heads
        self.consumer_of = consumer_of
        self.blocks: dict[int, "StreamingMoE"] = {}
        self.state: dict[int, tuple[mx.array, mx.array]] = {}  # owner -> (onehot now, logits)
        self.planned: dict[int, Planned] = {}

    def begin_forward(self, batch: int, length: int) -> None:
        """Turn the last step's predictions into routing and start the fills."""
        self.planned.clear()
        if batch != 1 or length != 1:
            self.state.clear()  # a new prompt (or a batch): old predictions do not apply
            return
        routed = {
            consumer: self.blocks[consumer].route(self.state[owner][1][:, None, :])
            for owner, consumer in self.consumer_of.items()
            if owner in self.state
        }
        if not routed:
            return
        mx.eval([inds for inds, _ in routed.values()])  # the one sync per step
        rt = self.runtime
        for consumer, (inds, scores) in routed.items():
            ids = np.unique(np.array(inds))
            staged = rt.staged[consumer].stage(ids, rt.hot, fill_hot=False)
            self.planned[consumer] = Planned(inds, scores, ids, staged)

    def take(self, layer: int) -> Optional[Planned]:
        return self.planned.pop(layer, None)

    def experts(self, layer: int, x: mx.array, planned: Planned) -> mx.array:
        """Compute a prerouted layer from its staged buffer (waiting only for it)."""
        rt = self.runtime
        slots = rt.staged[layer]
        if not planned.staged.reads.done():
            mx.eval(x)  # compute everything up to here while the reads land
        try:
            planned.staged.reads.wait()
        except BaseException:
            slots.invalidate(planned.staged.buffer)
            raise
        stats = rt.telemetry.current
        stats.prerouted += 1
        staged = set(slots.contents[planned.staged.buffer].tolist())
        stats.staged_drops += sum(int(e) not in staged for e in planned.ids)
        local = mx.take(planned.staged.slot_table, planned.inds)
        weights = slots.weights(planned.staged.buffer).with_scales_dtype(rt.compute_dtype)
        return expert_glu(x, local, weights)

    def observe(self, layer: int, x: mx.array, inds: mx.array) -> None:
        """Owner layers: run the head on the last token, keep its prediction."""
        head = self.heads.get(layer)
        if head is None or x.shape[0] != 1:
            return
        num_experts = self.runtime.section.experts.num_experts
        now = topk_onehot(inds[:, -1], num_experts)
        if x.shape[1] > 1:
            prev = topk_onehot(inds[:, -2], num_experts)
        elif layer in self.state:
            prev = self.state[layer][0]
        else:
            prev = mx.zeros_like(now)
        self.state[layer] = (now, head(x[:, -1], now, prev))

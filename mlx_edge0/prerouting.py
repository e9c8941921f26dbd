"""Prediction-as-routing at decode: the prerouter's prediction *is* the routing.

At step t, each owner layer N runs its head on its own input (the
post-attention-norm output) and its top-k one-hots at t and t-1, producing
router logits for the consumer layer N+1 at step t+1, and routes them right
there with the consumer's *own* routing math (queued with that layer's
compute). When step t+1 opens (its first MoE layer), the host takes the
consumers in layer order, waits for each one's routed prediction (step t has
computed that far) and starts its staging buffer filling with exactly that
set (the union over the batch): the first consumers' reads start while step
t still computes its last layers and its LM head, so a read-bound disk does
not idle between steps. The consumer layer later waits only for its own
reads and computes with those indices and weights: the staged set is the
routed set, so nothing is dropped and nothing falls back (telemetry counts
``prerouted`` layer calls). With a hot cache and no window, a fill is the
cache's: hits stay in their rows, misses are read into rows of it, all
pinned until the layer computes from them (``HotCache.start_planned``), so
each expert is held once and the rows a staging buffer would take are the
cache's; a plan the cache has no room to pin routes on demand through
the hot path (``fallback``), with the same indices. Otherwise a fill stages
into a buffer: it copies what the hot cache holds and reads the rest; once
those reads land the cache keeps copies (``HotCache.admit``), so the
prerouted layers' experts are cached like every other layer's.

Per-sequence state (each owner's last one-hot, its prediction, whether that
prediction is valid, and the prediction routed) lives in one extra ``ArraysCache`` appended to the
model's ``make_cache()`` list, so mlx-lm's batching (merge, filter, extend,
extract) and prompt-cache reuse (``save_prompt_cache``/``load_prompt_cache``,
the server's prompt cache) carry it with the sequence. A sequence with no
valid prediction (a fresh cache) routes its first token with the gate.

Invariant: a token's routing on a prerouted layer is a function of the
token sequence alone, never of how it was split into forwards. Every token
after a sequence's first routes with its owner head's prediction made at the
token before — in a prompt chunk too, where the heads run on every position
(``lengths`` of a right-padded batch prompt are honoured) and the chunk's
first token takes the prediction carried in the state. So a prompt continued
from a saved cache, a prompt cut into chunks of any size and a decoded
sequence all compute the same numbers (the heads' rows do not depend on how
many rows are multiplied at once). Only decode stages: a prompt chunk routes
with the same predictions but reads its experts like any prefill.

With a window (``Options.staged_window`` = N staging buffers) the plans are
still made when the step opens, but only the first N prerouted layers'
fills start then; the others take the window's buffers in turn, each fill
starting when the host reaches the prerouted layer ``HOST_AHEAD`` places
before the buffer's next user, once that buffer's last reader has been
computed (:func:`window_buffer`, :func:`fills_at_open`, :func:`refill_at`).
An "auto" window grows between steps (:func:`grown_window` decides, the
runtime allocates, :meth:`Prerouting.add_window_buffer` takes the buffer):
the arithmetic reads the window's length when a step opens, and
:meth:`StagingBuffer.retarget` forgets a buffer's contents when its rank now
maps it to another layer, so a longer window never serves stale rows.

:class:`Prerouting` knows no blocks and no runtime: it receives the heads,
one route callable per consumer layer (that layer's routing math: logits
``[B, L, E]`` -> indices, scores ``[B, L, K]``), the staging buffers, the hot
cache and the telemetry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from .hot import HotCache, PendingFetch
from .options import MIN_STAGED_WINDOW
from .prerouter_heads import PrerouterHead, topk_onehot
from .staging import Fill, StagingBuffer
from .telemetry import Telemetry

Route = Callable[[mx.array], tuple[mx.array, mx.array]]  # logits [B, L, E] -> inds, scores [B, L, K]
# (layer, x, inds, (sorted unique experts, each index's position among them)) -> experts' outputs
OnDemand = Callable[[int, mx.array, mx.array, tuple[np.ndarray, np.ndarray]], mx.array]

# one-hot at the last token, predicted logits, valid, and the prediction routed
# (indices, scores): routed in the owner's layer, so the next step can start
# each consumer's fill as soon as the step before has computed that far
SLOTS_PER_OWNER = 5
# Prerouted layers the host may build ahead of compute in a window:
# refilling a buffer waits for its last reader, so the buffer refilled at a
# layer is the one read this many prerouted layers before.
HOST_AHEAD = MIN_STAGED_WINDOW - 1
# An "auto" window grows while a step's prerouted layers wait for their reads
# more than this share of the step (the exposed-wait target of issue 19).
WINDOW_WAIT_SHARE = 0.05


def window_buffer(rank: int, window: int) -> int:
    """The window buffer the ``rank``-th planned consumer of a step fills."""
    return rank % window


def fills_at_open(planned: int, window: int) -> range:
    """Ranks of the planned consumers whose fills start when the step opens:
    all of them without a window (``window`` 0), else the first ``window``."""
    return range(min(planned, window or planned))


def refill_at(rank: int, window: int) -> Optional[int]:
    """The rank whose fill starts when the host reaches the ``rank``-th
    planned consumer: the next user of the buffer read ``HOST_AHEAD`` planned
    consumers before (None without a window, or before that)."""
    if not window or rank < HOST_AHEAD:
        return None
    return rank - HOST_AHEAD + window


def grown_window(window: int, wait_s: float, step_s: float, limit: int) -> int:
    """The depth of an "auto" window for the next step, from the last one.

    Each buffer more starts every fill a prerouted layer earlier, so while
    the prerouted layers' exposed wait ``wait_s`` is over
    :data:`WINDOW_WAIT_SHARE` of the step's wall time ``step_s``, the window
    doubles, up to ``limit`` (one per prerouted layer: every fill starts
    when the step opens, as without a window). Doubling reaches any depth in
    a few steps (3 to 39 buffers in 4; a buffer per step would take 36);
    overshooting costs no memory the hot cache did not already leave for
    the largest window. It never shrinks:
    a step that stopped waiting is the deeper window at work, not a sign
    that a shallower one would do, and dropping a buffer throws away rows
    already filled (the hot cache's budget has room for the largest window
    anyway).
    """
    if window < limit and step_s > 0 and wait_s > WINDOW_WAIT_SHARE * step_s:
        return min(2 * window, limit)
    return window


@dataclass(frozen=True)
class Plan:
    """A consumer layer's routing for this step, decided from the prediction."""

    inds: mx.array  # [B, 1, K]
    scores: mx.array  # [B, 1, K]
    ids: np.ndarray  # the unique routed experts over the batch this process computes (== the staged set)
    fill: Optional[Fill] = None  # None: its fill has not started (a window)
    buffer: Optional[StagingBuffer] = None  # the staging buffer it fills
    cached: Optional[PendingFetch] = None  # its rows in the hot cache, pinned (a fill of the cache's)
    on_demand: bool = False  # the cache had no room to pin it: read when the layer computes


class Prerouting:
    """Owner heads, the bound per-sequence state, and the fills they drive."""

    def __init__(
        self,
        heads: dict[int, PrerouterHead],
        consumer_of: dict[int, int],
        routes: dict[int, Route],
        *,
        buffers: dict[int, StagingBuffer],
        window: list[StagingBuffer],
        hot: Optional[HotCache],
        telemetry: Telemetry,
        compute_dtype: Optional[mx.Dtype],
        num_experts: int,
        local: Callable[[np.ndarray], np.ndarray] = lambda ids: ids,
        fallback: Optional[OnDemand] = None,
    ):
        """
        Args:
            heads: owner layer -> its head.
            consumer_of: owner layer -> the layer its head predicts.
            routes: consumer layer -> its routing math.
            buffers: consumer layer -> its staging buffer (without a window).
            window: the window's staging buffers (empty: one per consumer):
                the caller's list, kept as is (one list of the window's
                buffers), and grown only by :meth:`add_window_buffer`.
            local: the experts of a routed set this process computes (an
                expert-parallel rank's own; default all): only those are staged.
            fallback: with ``hot`` and neither ``buffers`` nor ``window``
                (fills are the cache's), what computes a plan the cache had
                no room to pin: the hot path, reading on demand.
        """
        self.heads = heads
        self.consumer_of = consumer_of
        self.routes = {c: routes[c] for c in consumer_of.values()}
        self.buffers = buffers
        self.window = window
        self.hot = hot
        self.telemetry = telemetry
        self.compute_dtype = compute_dtype
        self.num_experts = num_experts
        self.local = local
        self.fallback = fallback
        self.cache_fills = hot is not None and not buffers and not window
        assert not self.cache_fills or fallback is not None, "fills of the cache's need a fallback"
        self.owners = sorted(consumer_of)
        self.owner_of = {c: o for o, c in consumer_of.items()}
        self.state: Optional[ArraysCache] = None
        self.planned: dict[int, Plan] = {}
        self.order: list[int] = []  # this step's planned consumers, in layer order
        self.window_user: dict[int, int] = {}  # window buffer -> consumer last staged into it
        # consumer -> (use [B, L], predicted logits [B, L, E]): positions routed with
        # a prediction where the plan does not cover the whole forward
        self.partial: dict[int, tuple[mx.array, mx.array]] = {}
        # routed predictions and staging-buffer readers not yet queued: the next prerouted
        # layer's async_eval takes them
        self.unqueued: list[mx.array] = []

    def add_window_buffer(self, buffer: StagingBuffer) -> None:
        """Give the window a buffer more, from the next step on. Between
        forwards only (nothing planned): a step's ranks keep their buffers."""
        assert self.window and not self.planned, "a window grows between steps"
        self.window.append(buffer)

    def make_cache(self) -> ArraysCache:
        """The per-sequence prediction state (see the module docstring)."""
        return ArraysCache(SLOTS_PER_OWNER * len(self.owners))

    def _slot(self, owner: int) -> int:
        return SLOTS_PER_OWNER * self.owners.index(owner)

    def bind(self, state: Optional[ArraysCache]) -> None:
        """Use ``state`` for the forward about to run (None: no prediction).

        Plans the last forward did not consume (it raised, e.g. on a failed
        read) are dropped: their reads are let finish and their buffers
        forgotten, so no later fill keeps or copies rows that never landed.
        """
        for planned in self.planned.values():
            self._drop(planned)
        self.state = state
        self.planned.clear()
        self.order.clear()
        self.window_user.clear()
        self.partial.clear()
        self.unqueued.clear()

    def _drop(self, plan: Plan) -> None:
        if plan.cached is not None:
            self.hot.drop_planned(plan.cached)
        elif plan.fill is not None:
            plan.fill.reads.settle()
            plan.buffer.invalidate()

    @property
    def cache_planned_layers(self) -> frozenset[int]:
        """The consumers whose decode fills are the hot cache's: their bundles
        are placed when each step opens, in layer order, before any call
        (:meth:`HotCache.start_planned`). None with staging buffers."""
        return frozenset(self.consumer_of.values()) if self.cache_fills else frozenset()

    def begin_forward(self, length: int, x: Optional[mx.array] = None) -> None:
        """Turn the last step's predictions into plans and start the fills.

        Consumer by consumer in layer order, the host waits for that
        consumer's routed prediction (queued with its owner's layer in the
        step before, see :meth:`experts`) and starts its fill, so the first
        consumers' reads begin while the step before still computes its last
        layers and its LM head: a read-bound disk does not idle between
        steps. Then ``x`` (the first MoE layer's input) is queued: it depends
        on the step before's token, and queuing it first would wait behind
        that LM head where MLX bounds the work in flight (its CPU backend).
        """
        state = self.state
        if state is None or length != 1:
            return
        self.unqueued.clear()
        for owner, consumer in sorted(self.consumer_of.items(), key=lambda oc: oc[1]):
            s = self._slot(owner)
            valid, inds, scores = state[s + 2], state[s + 3], state[s + 4]
            if valid is None:
                continue
            mx.eval(inds, valid)  # waits for the step before up to this owner's layer
            valid_host = np.array(valid)
            if not valid_host.any():
                continue
            if not valid_host.all():  # mixed batch: gate for the rest, on demand
                self.partial[consumer] = (valid[:, None], state[s + 1][:, None, :])
                continue
            self.planned[consumer] = Plan(inds, scores, self.local(np.unique(np.array(inds))))
            if self.telemetry.routing_trace is not None:
                self.telemetry.routing_trace.append((consumer, self.planned[consumer].ids.tolist()))
            rank = len(self.order)
            self.order.append(consumer)
            if rank in fills_at_open(rank + 1, len(self.window)):
                self._start(rank)
        if x is not None:
            mx.async_eval(x)

    def _start(self, rank: Optional[int]) -> Optional[Plan]:
        """Start the fill of the ``rank``-th planned consumer (no-op when
        started, taken or out of range)."""
        if rank is None or rank >= len(self.order) or (plan := self.planned.get(self.order[rank])) is None:
            return None
        if plan.fill is not None or plan.on_demand:
            return plan
        consumer = self.order[rank]
        if self.cache_fills:
            cached = self.hot.start_planned(consumer, plan.ids)
            if cached is None:
                plan = replace(plan, on_demand=True)
            else:
                table = np.zeros(self.num_experts, np.int32)
                table[plan.ids] = cached.rows
                plan = replace(plan, fill=Fill(mx.array(table), cached.reads), cached=cached)
            self.planned[consumer] = plan
            return plan
        if self.window:
            index = window_buffer(rank, len(self.window))
            buffer = self.window[index]
            earlier = self.planned.pop(self.window_user.get(index, -1), None)
            if earlier is not None:  # never taken this step: it loses the buffer
                self._drop(earlier)
            self.window_user[index] = consumer
            buffer.retarget(consumer)
        else:
            buffer = self.buffers[consumer]
        if len(plan.ids) > buffer.capacity:
            buffer.grow(len(plan.ids))
        plan = replace(plan, fill=buffer.stage(plan.ids, self.hot, fill_hot=False), buffer=buffer)
        self.planned[consumer] = plan
        return plan

    def take(self, layer: int) -> Optional[Plan]:
        """This step's plan for ``layer`` (its fill started), or None."""
        if layer not in self.planned:
            return None
        plan = self._start(self.order.index(layer))
        del self.planned[layer]
        return plan

    def mix(self, layer: int, inds: mx.array, scores: mx.array) -> tuple[mx.array, mx.array]:
        """Routing for a forward the plan does not cover (a prompt chunk, or a
        batch where only some sequences have a prediction): the predictions,
        through the layer's own routing math, where there are any; the gate's
        ``inds``/``scores`` elsewhere. Routed apart and then selected, so a
        predicted position gets exactly what decode gives it."""
        part = self.partial.pop(layer, None)
        if part is None:
            return inds, scores
        use, logits = part  # [B, L], [B, L, E]
        p_inds, p_scores = self.routes[layer](logits)
        use = use[..., None]
        return mx.where(use, p_inds, inds), mx.where(use, p_scores, scores)

    def experts(self, layer: int, x: mx.array, inds: mx.array, plan: Plan) -> mx.array:
        """Compute a prerouted layer's experts ``inds`` (the plan's, or this
        process's share of them) from its fill (the hot cache's rows or its
        staging buffer), waiting only for its reads."""
        # the compute thread runs everything up to here while the reads land; the routed
        # predictions made since are queued with it, so the next step can wait for each alone
        mx.async_eval(x, *self.unqueued)
        self.unqueued.clear()
        self._start(refill_at(self.order.index(layer), len(self.window)))
        stats = self.telemetry.current
        stats.prerouted += 1
        if plan.on_demand:
            ids, where = np.unique(np.array(inds), return_inverse=True)
            return self.fallback(layer, x, inds, (ids, where.reshape(inds.shape)))
        try:
            waited = plan.fill.reads.wait()
        except BaseException:
            self._drop(plan)
            raise
        stats.prerouted_wait_s += waited
        table = mx.take(plan.fill.slot_table, inds)
        if plan.cached is not None:
            self.hot.finish_planned(plan.cached)
            y = self.hot.buffers.compute(x, table, self.compute_dtype, plan.cached.rows)
        else:
            if self.hot is not None:  # the cache learns the prerouted layers' experts too
                self.hot.admit(layer, plan.ids, plan.fill.read, plan.buffer.rows)
            y = plan.buffer.rows.compute(x, table, self.compute_dtype)
        # the buffer's reader, queued with the next prerouted layer: the next step's fill
        # into this buffer waits for it alone, not for the whole step
        self.unqueued.append(y)
        return y

    def observe(self, layer: int, x: mx.array, inds: mx.array) -> None:
        """Owner layers: run the head on every position; keep the prediction
        made at each sequence's last token, and hand a prompt chunk's
        predictions to the consumer for the positions after each one."""
        head = self.heads.get(layer)
        state = self.state
        if head is None or state is None:
            return
        # x: [B, L, D]; inds: [B, L, K]; one-hots, predictions: [B, L, E]
        B, L = x.shape[0], x.shape[1]
        s = self._slot(layer)
        old_now, old_logits, old_valid = state[s], state[s + 1], state[s + 2]
        onehots = topk_onehot(inds, self.num_experts)
        carried = mx.zeros_like(onehots[:, 0]) if old_now is None else old_now * old_valid[:, None]
        prevs = mx.concatenate([carried[:, None], onehots[:, :-1]], axis=1)
        predicted = head(x, onehots, prevs)  # made at t, for t + 1
        if L > 1:
            self._hand_on(self.consumer_of[layer], predicted, old_logits, old_valid)
        rows = mx.arange(B)
        if state.lengths is not None:  # a right-padded batch prompt chunk
            remaining = state.lengths.astype(mx.int32)
            last = mx.clip(remaining - 1, 0, L - 1)
            update = remaining > 0
        else:
            last = mx.full((B,), L - 1, mx.int32)
            update = None
        now, logits = onehots[rows, last], predicted[rows, last]
        valid = mx.ones((B,), mx.bool_)
        if update is not None and old_valid is not None:
            now = mx.where(update[:, None], now, old_now)
            logits = mx.where(update[:, None], logits, old_logits)
            valid = mx.where(update, valid, old_valid)
        elif update is not None:
            valid = update
        inds, scores = self.routes[self.consumer_of[layer]](logits[:, None, :])
        state[s], state[s + 1], state[s + 2], state[s + 3], state[s + 4] = now, logits, valid, inds, scores
        self.unqueued.extend((inds, scores, valid))

    def _hand_on(
        self, consumer: int, predicted: mx.array, carried: Optional[mx.array], carried_valid: Optional[mx.array]
    ) -> None:
        """A prompt chunk's routing for ``consumer``: position t takes the
        prediction made at t - 1; the first position the carried one, if valid."""
        B, L, E = predicted.shape
        if carried is None:
            carried, carried_valid = mx.zeros((B, E), predicted.dtype), mx.zeros((B,), mx.bool_)
        logits = mx.concatenate([carried[:, None].astype(predicted.dtype), predicted[:, :-1]], axis=1)
        use = mx.concatenate([carried_valid[:, None], mx.ones((B, L - 1), mx.bool_)], axis=1)
        self.partial[consumer] = (use, logits)

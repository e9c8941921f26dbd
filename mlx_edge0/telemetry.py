"""Telemetry: what each forward read, hit, rewrote and waited for.

One record type, :class:`Stats`, with ``__add__`` and ``as_dict`` so a step,
the running total and a report can never drift apart. Counting is a few
integer additions per MoE layer, cheap enough to leave on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Optional

import numpy as np


@dataclass
class Stats:
    """Counters of one forward (a *step*) or a sum of steps.

    Attributes:
        steps: model forwards (prefill chunks and decode steps).
        tokens: tokens those forwards processed (batch x sequence).
        expert_loads: expert bundles read from disk.
        bytes_read: bytes read from disk (alignment padding included).
        reads: ``preadv`` calls (coalesced runs).
        exposed_wait_s: time the host blocked waiting for reads (on
            ``hot_overlapped`` calls the hits may compute meanwhile, so there
            it bounds the compute's idle time from above).
        prerouted_wait_s: the part of ``exposed_wait_s`` spent on prerouted
            layers' fills (what a deeper staged window would hide).
        planning_s: host time the hot cache spent giving misses their rows
            (free rows, then the policy's victims): Python work on the step's
            path, before the misses' reads start.
        step_s: wall time from a step's opening to the next one's (the host's
            work between forwards included); 0 while the step is open.
        hot_hits / hot_misses: routed experts found / not found in the hot cache
            (a bundle read ahead for the call counts in ``lookahead_hits``).
        hot_overlapped: hot-path calls of one token that computed its resident
            experts while its misses were read.
        lookahead_read: expert bundles queued to read into the hot cache for
            the next layer before it routed (``lookahead``: its router on this
            layer's input); those not started when it routes are dropped, the
            loads and bytes of those that landed count when a call settles them.
        lookahead_hits: routed experts found in the hot cache because they were
            read ahead for this call (neither ``hot_hits`` nor ``hot_misses``).
        staged_kept / staged_copied / staged_read: slots of staging buffers
            already holding the expert, filled by copying a resident bundle,
            filled from disk; ``slot_rewrites`` = copied + read.
        staged_fallbacks: staged-path calls whose routed set did not fit the
            layer's staging buffer (computed by the hot or exact path).
        whole_layer_loads: layers read whole for a prompt chunk.
        prompt_copied: expert bundles of those whole layers copied into the
            hot cache (no read: :meth:`mlx_edge0.hot.HotCache.copy_prompt_experts`).
        held_released: held bundles (:meth:`mlx_edge0.hot.HotCache.add_held`)
            handed to the policy because the cache had to evict.
        prerouted: layer calls routed by the prerouter's prediction and
            computed from the staging buffer filled with exactly that routing.
        read_errors: read batches that failed (raised in the caller).
    """

    steps: int = 0
    tokens: int = 0
    expert_loads: int = 0
    bytes_read: int = 0
    reads: int = 0
    exposed_wait_s: float = 0.0
    prerouted_wait_s: float = 0.0
    planning_s: float = 0.0
    step_s: float = 0.0
    hot_hits: int = 0
    hot_misses: int = 0
    hot_overlapped: int = 0
    lookahead_read: int = 0
    lookahead_hits: int = 0
    staged_kept: int = 0
    staged_copied: int = 0
    staged_read: int = 0
    staged_fallbacks: int = 0
    whole_layer_loads: int = 0
    prompt_copied: int = 0
    held_released: int = 0
    prerouted: int = 0
    read_errors: int = 0

    def __add__(self, other: "Stats") -> "Stats":
        return Stats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def slot_rewrites(self) -> int:
        return self.staged_copied + self.staged_read

    def as_dict(self) -> dict:
        """Every counter by name; times in ms (``exposed_wait_s`` -> ``exposed_wait_ms``)."""
        d = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                d[f.name.removesuffix("_s") + "_ms"] = round(value * 1e3, 3)
            else:
                d[f.name] = value
        d["slot_rewrites"] = self.slot_rewrites
        return d


@dataclass
class Telemetry:
    """The running total and the last completed step.

    ``routing_trace``: set it to a list to record ``(layer, routed expert
    ids)`` of every MoE call that brings its routing to the host, prerouted
    ones included (e.g. to compare cache policies on a real trace); an
    expert-parallel rank records the experts it computes. ``read_trace``: set it to a list
    to record ``(layer, expert ids)`` of every read the store starts (e.g. to
    check which experts a rank reads). ``routing_counts``: set it to a dict to
    count, per MoE layer, each expert's routings over every call the
    on-demand and whole-layer paths make, a prompt chunk's tokens each
    counted (prerouted calls are not: ``edge0 profile`` loads with the
    prerouter off); ``counted_layer``, when set, is called with each counted
    call's layer (``edge0 profile``'s progress: a 1,024-token forward of a
    large model can take an hour on a CPU).
    """

    total: Stats = field(default_factory=Stats)
    current: Stats = field(default_factory=Stats)
    last_step: Stats = field(default_factory=Stats)
    routing_trace: Optional[list[tuple[int, list[int]]]] = None
    read_trace: Optional[list[tuple[int, list[int]]]] = None
    routing_counts: Optional[dict[int, np.ndarray]] = None
    counted_layer: Optional[Callable[[int], None]] = None
    opened_at: float = 0.0  # time.perf_counter() when the running step opened

    def begin_step(self, tokens: int) -> Optional[Stats]:
        """Close the running step (if any) and open a new one; returns the
        closed step (its ``step_s`` set), or None."""
        now = time.perf_counter()
        closed = None
        if self.current.steps:
            self.current.step_s = now - self.opened_at
            closed = self.last_step = self.current
            self.total = self.total + self.current
        self.current = Stats(steps=1, tokens=tokens)
        self.opened_at = now
        return closed

    def count_routings(self, layer: int, inds: np.ndarray) -> None:
        """Add a call's routed expert ids (any shape) to ``routing_counts``
        when it is counting."""
        if self.routing_counts is None:
            return
        counts = np.bincount(inds.ravel().astype(np.int64))
        held = self.routing_counts.get(layer)
        if held is not None:
            if len(held) > len(counts):
                held, counts = counts, held
            counts[: len(held)] += held
        self.routing_counts[layer] = counts
        if self.counted_layer is not None:
            self.counted_layer(layer)

    def summed(self) -> Stats:
        return self.total + self.current

    def reset(self) -> None:
        self.total, self.current, self.last_step = Stats(), Stats(), Stats()


def hot_hit_rate(counters: Mapping[str, float]) -> Optional[float]:
    """The share of the hot path's routings it found resident, from
    :meth:`Stats.as_dict`-shaped counters (a bundle read ahead for its call
    was read, not held: it counts as routed, not as a hit); None when nothing
    was routed through the hot cache."""
    hits = counters.get("hot_hits", 0)
    routed = hits + counters.get("hot_misses", 0) + counters.get("lookahead_hits", 0)
    return hits / routed if routed else None


def format_stats(stats: dict) -> str:
    """A readable summary of ``model.stats()`` (``edge0 generate --stats``;
    ``--json`` prints the dict itself)."""
    from .checkpoint import human_bytes

    hits, misses, ahead = stats["hot_hits"], stats["hot_misses"], stats["lookahead_hits"]
    rate = hot_hit_rate(stats)
    hit_rate = f" ({100 * rate:.0f}% hits)" if rate is not None else ""
    resident = ", ".join(f"{name.replace('_', ' ')} {human_bytes(n)}" for name, n in stats["resident_bytes"].items())
    last = stats["last_step"]
    lines = [
        f"edge0 stats: {stats['steps']} forwards, {stats['tokens']} tokens, decode path "
        f"{stats['decode_path']}, prerouter {'on' if stats['prerouter'] else 'off'}",
        f"  expert reads    {stats['expert_loads']} experts, {human_bytes(stats['bytes_read'])} in "
        f"{stats['reads']} reads ({stats['whole_layer_loads']} whole layers), {stats['read_errors']} errors",
        f"  exposed wait    {stats['exposed_wait_ms']:.1f} ms in all, {last['exposed_wait_ms']:.1f} ms "
        "on the last step",
        f"  hot cache       {hits} hits, {misses} misses{hit_rate}, {stats['prompt_copied']} copied from prompts, "
        f"{stats['hot_overlapped']} calls computed hits while reading misses, "
        f"{stats['planning_ms']:.1f} ms choosing rows",
        f"  read ahead      {stats['lookahead_read']} experts queued for the next layer, {ahead} routed there",
        f"  staged slots    {stats['staged_kept']} kept, {stats['staged_copied']} copied, "
        f"{stats['staged_read']} read, {stats['staged_fallbacks']} fallbacks",
        f"  prerouted       {stats['prerouted']} layer calls, {stats['prerouted_wait_ms']:.1f} ms exposed wait, "
        + (f"a staged window of {stats['staged_window']}" if stats["staged_window"] else "no staged window"),
        f"  resident        {resident}",
        f"  peak memory     {human_bytes(stats['peak_memory'])} (MLX)",
    ]
    return "\n".join(lines)

"""Which expert bundles a full hot cache evicts: the policies, and the
planner that gives a call's misses their rows.

Pure bookkeeping over hashable keys (no MLX, no reads), so the offline
replay (:mod:`mlx_edge0.bench.eviction`) runs the runtime's own choices on a
recorded trace. :class:`FrequencyPolicy` (LFU with periodic halving, ties
broken by recency) is the default because it measured a higher hit rate than
LRU on the routing traces in BENCHMARKS.md: MoE routing has persistently
popular experts per layer, and pure recency evicts them during a burst of
rare ones. :class:`LRUPolicy` stays for comparison (``hot_policy="lru"``).

Not every miss costs the same: with the prerouter, a prerouted layer's misses
are read behind the compute, while a layer no head predicts (the first MoE
layer) is read when it routes and the compute waits. LFU weighs such a
layer's bundles by :data:`WAITED_MISS_COST` (:meth:`FrequencyPolicy.set_cost`),
as cost-aware caches weigh frequency by the price of a miss.
"""

from __future__ import annotations

from itertools import repeat
from typing import AbstractSet, Callable, Hashable, Iterable, Mapping, Optional, Sequence

import numpy as np

LFU_AGING = 32  # FrequencyPolicy's counts halve every LFU_AGING x capacity touches
# A use of a bundle whose miss the compute waits for counts as this many uses
# of one read behind the compute. Any weight above 1 lets such a bundle
# outrank prerouted bundles that are used about as often. On the replayed
# decodes in BENCHMARKS.md ("Misses the compute waits for"), 1.5 to 4 kept
# the same bundles with a routing profile; without one, 4 began to cost the
# other layers' hits.
WAITED_MISS_COST = 2.0
# Among this many times the victims needed, the candidates the policy ranks
# lowest, a settled bundle (its layer has routed in this forward, not to it)
# goes first (plan_fill). On the decodes replayed in BENCHMARKS.md ("Victims
# whose layer has routed"), 8 to 16 kept the most. With no span at all, a
# popular bundle of a layer that has routed went before a rare one of a layer
# still to route, and the replays lost hits.
SETTLED_SPAN = 8


class LRUPolicy:
    """Evict the least recently used bundle."""

    name = "lru"

    def __init__(self, capacity: int):
        self.clock = 0
        self.last: dict[Hashable, int] = {}

    def state(self) -> dict:
        """What the policy has learned, JSON-able (each key a list): a replay
        that restores it (:meth:`restore`) ranks as the runtime did then."""
        return {"policy": self.name, "clock": self.clock, "last": [[list(k), v] for k, v in self.last.items()]}

    def restore(self, state: Mapping) -> None:
        """Learn what :meth:`state` recorded, of a policy of this kind.

        Raises:
            ValueError: ``state`` is another policy's.
        """
        if state.get("policy") != self.name:
            raise ValueError(f"a {state.get('policy')!r} policy's state cannot start a {self.name!r} policy")
        self.clock = int(state["clock"])
        self.last = {tuple(k): int(v) for k, v in state["last"]}

    def touch(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            self.clock += 1
            self.last[k] = self.clock

    def forget(self, key: Hashable) -> None:
        self.last.pop(key, None)

    def add_uses(self, uses: Mapping[Hashable, int]) -> None:
        """Count ``uses`` as that many touches of each key, in its order,
        without a step per use (a long prompt routes millions of times)."""
        for k, n in uses.items():
            self.clock += n
            self.last[k] = self.clock

    def add_prior(self, counts: Mapping[Hashable, float]) -> None:
        """A routing profile's counts (:meth:`FrequencyPolicy.add_prior`):
        recency has no use for them."""

    def set_cost(self, keys: Iterable[Hashable], cost: float) -> None:
        """What a miss of each of ``keys`` costs (:meth:`FrequencyPolicy.set_cost`):
        recency has no use for it."""

    def priority(self, key: Hashable):
        """How much the policy wants ``key`` kept: victims are the lowest."""
        return self.last.get(key, 0)

    def order(self, keys: Sequence[Hashable]) -> np.ndarray:
        """Indices of ``keys`` from the lowest :meth:`priority` up, ties in
        their order (a stable sort): a victim choice ranks every resident
        bundle, so the priorities are looked up and sorted without a Python
        call per key."""
        return np.argsort(np.fromiter(map(self.last.get, keys, repeat(0)), np.int64, len(keys)), kind="stable")

    def victims(self, candidates: Sequence[Hashable], n: int) -> list[Hashable]:
        """The ``n`` lowest ranked of ``candidates`` (:meth:`order`)."""
        return [candidates[i] for i in self.order(candidates)[:n].tolist()]


class FrequencyPolicy(LRUPolicy):
    """Evict the least frequently used bundle; counts halve every
    ``aging x capacity`` touches (never with ``aging`` 0) so yesterday's
    favourites age out. The default, :data:`LFU_AGING`, came within a point
    or so of the best aging on every trace replayed in BENCHMARKS.md ("How
    long LFU remembers"): a shorter memory forgets popular experts between
    their uses, a longer one (or none) keeps stale ones when the text changes."""

    name = "lfu"

    def __init__(self, capacity: int, aging: int = LFU_AGING):
        super().__init__(capacity)
        self.count: dict[Hashable, float] = {}  # each key's uses, each weighted by its cost
        self.cost: dict[Hashable, float] = {}  # a property of the key: kept when it is evicted
        if aging < 0:
            raise ValueError(f"aging must be >= 0, got {aging}")
        self.period = max(aging * capacity, 64) if aging else 0

    def touch(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            self.clock += 1
            self.last[k] = self.clock
            self.count[k] = self.count.get(k, 0.0) + self.cost.get(k, 1.0)
            if self.period and self.clock % self.period == 0:
                self.count = {key: c / 2 for key, c in self.count.items()}

    def add_uses(self, uses: Mapping[Hashable, int]) -> None:
        """As :meth:`LRUPolicy.add_uses`; a halving that falls within a key's
        uses halves every count, that key's included."""
        for k, n in uses.items():
            halvings = (self.clock + n) // self.period - self.clock // self.period if self.period else 0
            self.clock += n
            self.last[k] = self.clock
            self.count[k] = self.count.get(k, 0.0) + n * self.cost.get(k, 1.0)
            if halvings:
                self.count = {key: c / 2**halvings for key, c in self.count.items()}

    def add_prior(self, counts: Mapping[Hashable, float]) -> None:
        """Start from ``counts`` uses of each key, seen before any touch (a
        routing profile's, :func:`mlx_edge0.popularity.prior_counts`); they
        halve with the rest."""
        for k, c in counts.items():
            self.count[k] = self.count.get(k, 0.0) + c * self.cost.get(k, 1.0)

    def set_cost(self, keys: Iterable[Hashable], cost: float) -> None:
        """Rank each of ``keys`` by its uses times ``cost`` (1 for every key
        not set): what a miss of it costs against one read behind the compute.
        Each use counts ``cost`` when it is counted (the uses already counted
        are rescaled), so ranking a victim's candidates costs nothing more."""
        if cost <= 0:
            raise ValueError(f"a miss's cost must be > 0, got {cost}")
        for k in keys:
            if k in self.count:
                self.count[k] *= cost / self.cost.get(k, 1.0)
            self.cost[k] = float(cost)

    def state(self) -> dict:
        return super().state() | {
            "count": [[list(k), c] for k, c in self.count.items()],
            "cost": [[list(k), c] for k, c in self.cost.items()],
        }

    def restore(self, state: Mapping) -> None:
        super().restore(state)
        self.count = {tuple(k): float(c) for k, c in state["count"]}
        self.cost = {tuple(k): float(c) for k, c in state["cost"]}

    def priority(self, key: Hashable):
        return self.count.get(key, 0.0), self.last.get(key, 0)

    def order(self, keys: Sequence[Hashable]) -> np.ndarray:
        count = np.fromiter(map(self.count.get, keys, repeat(0.0)), np.float64, len(keys))
        last = np.fromiter(map(self.last.get, keys, repeat(0)), np.int64, len(keys))
        return np.lexsort((last, count))  # stable, by count then recency


POLICIES = {"lfu": FrequencyPolicy, "lru": LRUPolicy}


def plan_fill(
    wanted: Sequence[Hashable],
    resident: dict[Hashable, int],
    free: list[int],
    policy: LRUPolicy,
    permanent: AbstractSet[Hashable] = frozenset(),
    settled: Optional[Callable[[Hashable], bool]] = None,
    span: int = SETTLED_SPAN,
) -> tuple[dict[Hashable, int], list[Hashable]]:
    """Rows for the misses of ``wanted``: free rows first, then policy victims
    among resident keys that are neither wanted now nor ``permanent``. Returns
    (miss -> row, evicted).

    ``settled`` says which keys cannot be wanted again in this forward (their
    layer has routed, to other experts): among the ``span`` x victims lowest
    ranked (:data:`SETTLED_SPAN`) they go first, in the policy's order. A key
    of a layer still to route may be wanted a few calls later, and read twice."""
    misses = [k for k in wanted if k not in resident]
    rows = free[: len(misses)]
    need = len(misses) - len(rows)
    if not need:
        return dict(zip(misses, rows)), []
    kept = {*permanent, *wanted}
    candidates = [k for k in resident if k not in kept]
    if settled is not None:
        lowest = policy.victims(candidates, need * span)
        evicted = sorted(lowest, key=lambda k: not settled(k))[:need]  # stable: the policy's order within each
    else:
        evicted = policy.victims(candidates, need)
    if len(evicted) < need:
        raise ValueError("hot cache too small for the routed set")
    rows = rows + [resident[k] for k in evicted]
    return dict(zip(misses, rows)), evicted

"""Offline replay of a routing trace through the hot cache's eviction policies,
and through the offline optimum they are measured against.

The simulated cache is the runtime's (``mlx_edge0.hot``): ``capacity`` expert
slots shared by all MoE layers, filled one MoE call at a time by the same
planner, :func:`mlx_edge0.cache_policy.plan_fill` (a call's routed set is made resident
together: misses take free slots first, then victims among resident experts
the call does not route to). Only the choice of victims differs:

- ``lru``, ``lfu``: the runtime's own policies (``cache_policy.POLICIES``).
- ``min``: Belady's MIN, the resident expert whose next use is farthest in
  the future (never used again counts as infinitely far). Optimal for a fixed
  trace and capacity: no policy that only chooses victims gets more hits.
- ``lru+next``, ``lfu+next``: the base policy, except that it never evicts an
  expert the next ``lookahead`` MoE calls route to while it has another
  candidate. With ``lookahead`` = the number of MoE layers (the default) that
  is one token of calls: the rest of this token's layers and the next
  token's layers up to this one, what a prerouter predicting one token ahead
  knows when the call is made. The trace itself is the prediction (a perfect
  prerouter) unless a predicted trace of the same shape is given.
- ``popularity``: evict the expert with the lowest given popularity (the
  probability a token routes to it). Given the true popularity of a trace
  whose tokens route independently (a synthetic one,
  ``synthetic_routing.generate_with_popularity``), this is the optimal
  online policy for independent references (Aho, Denning and Ullman's A0):
  in the long run no victim choice that learns popularity from past uses
  does better on average, so its distance to MIN is the part of a gap that
  only knowing the future closes.

Misses are reads: each costs one bundle from the device, so bytes read per
token are ``misses * bundle_bytes / tokens``. The cache starts empty but for
``permanent`` keys (the runtime's layers no owner predicts: read at load,
never a victim, their rows out of every other layer's reach) and, if given,
``resident`` keys: what the runtime's cache held when the replayed calls
began (a decode trace follows a prompt and warm-up steps that filled it; a
replay from empty counts their experts as misses the runtime never had).
Resident keys are ordinary victims, but the policies know nothing of their
past uses. The first use of every other expert is a miss under every
policy; :func:`ceiling` is the hit rate of an unbounded cache.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import AbstractSet, Hashable, Iterable, Mapping, Optional, Sequence

from ..cache_policy import (
    LFU_AGING,
    POLICIES,
    SETTLED_SPAN,
    WAITED_MISS_COST,
    FrequencyPolicy,
    LRUPolicy,
    plan_fill,
)
from ..telemetry import hot_hit_rate
from .locality import RoutingTrace

Key = tuple[int, int]  # (layer, expert)
BASE_POLICIES = tuple(POLICIES)  # "lfu", "lru"
PREDICTION_AWARE = tuple(f"{name}+next" for name in BASE_POLICIES)
POLICY_NAMES = ("lru", "lfu", "min", "lru+next", "lfu+next")
POPULARITY = "popularity"  # needs the experts' popularity: not in POLICY_NAMES


def call_keys(trace: RoutingTrace) -> list[list[Key]]:
    """The ``(layer, expert)`` keys of every MoE call, in forward order."""
    return [[(layer, e) for e in ids] for layer, ids in trace.calls()]


class BeladyPolicy:
    """Belady's MIN over a known sequence of calls: victims are the
    candidates used farthest in the future. ``touch`` advances one call."""

    def __init__(self, calls: Sequence[Sequence[Key]]):
        self.now = 0
        self.uses: dict[Key, list[int]] = {}
        for position, keys in enumerate(calls):
            for k in keys:
                self.uses.setdefault(k, []).append(position)

    def next_use(self, key: Key) -> float:
        uses = self.uses.get(key, [])
        i = bisect.bisect_left(uses, self.now)
        return uses[i] if i < len(uses) else float("inf")

    def touch(self, keys: Iterable[Hashable]) -> None:
        self.now += 1

    def forget(self, key: Hashable) -> None:
        pass

    def victims(self, candidates: Sequence[Key], n: int) -> list[Key]:
        return sorted(candidates, key=lambda k: (-self.next_use(k), k))[:n]


class PredictionAware:
    """A base policy that spares the experts of the next ``lookahead`` calls
    (as ``predicted`` says) while it has other candidates."""

    def __init__(self, base: LRUPolicy, predicted: Sequence[Sequence[Key]], lookahead: int):
        self.base = base
        self.predicted = predicted
        self.lookahead = lookahead
        self.now = 0

    def protected(self) -> set[Key]:
        return {k for keys in self.predicted[self.now + 1 : self.now + 1 + self.lookahead] for k in keys}

    def touch(self, keys: Iterable[Hashable]) -> None:
        self.base.touch(keys)
        self.now += 1

    def forget(self, key: Hashable) -> None:
        self.base.forget(key)

    def victims(self, candidates: Sequence[Key], n: int) -> list[Key]:
        keep = self.protected()
        spare = [k for k in candidates if k not in keep]
        kept = [k for k in candidates if k in keep]
        return (self.base.victims(spare, len(spare)) + self.base.victims(kept, len(kept)))[:n]


class PopularityPolicy:
    """Evict the least popular candidates (ties by key); keys without a
    popularity count as 0."""

    def __init__(self, popularity: Mapping[Key, float]):
        self.popularity = popularity

    def touch(self, keys: Iterable[Hashable]) -> None:
        pass

    def forget(self, key: Hashable) -> None:
        pass

    def victims(self, candidates: Sequence[Key], n: int) -> list[Key]:
        return sorted(candidates, key=lambda k: (self.popularity.get(k, 0.0), k))[:n]


def measured_popularity(trace: RoutingTrace) -> dict[Key, float]:
    """Each expert's share of its layer's routings in ``trace``: a profile
    measured on one text, for :class:`PopularityPolicy` on another."""
    counts: dict[Key, int] = {}
    per_layer: dict[int, int] = {}
    for keys in call_keys(trace):
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
            per_layer[k[0]] = per_layer.get(k[0], 0) + 1
    return {k: c / per_layer[k[0]] for k, c in counts.items()}


@dataclass(frozen=True)
class CacheResult:
    """One policy's replay of one trace at one capacity."""

    policy: str
    capacity: int
    tokens: int
    accesses: int
    hits: int
    bundle_bytes: int = 0
    waited_misses: int = 0  # misses of the keys given as ``waited``

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.misses * self.bundle_bytes / self.tokens if self.tokens else float("nan")

    def as_dict(self) -> dict:
        return asdict(self) | {
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "bytes_per_token": self.bytes_per_token,
        }


def make_policy(
    name: str,
    calls: Sequence[Sequence[Key]],
    capacity: int,
    predicted: Optional[Sequence[Sequence[Key]]] = None,
    lookahead: int = 1,
    popularity: Optional[Mapping[Key, float]] = None,
    lfu_aging: int = LFU_AGING,
    prior: Optional[Mapping[Key, float]] = None,
    waited: AbstractSet[Key] = frozenset(),
    waited_cost: float = WAITED_MISS_COST,
    state: Optional[Mapping] = None,
):
    """The victim chooser called ``name`` (one of :data:`POLICY_NAMES`, or
    :data:`POPULARITY` with ``popularity`` given); LFU's counts halve every
    ``lfu_aging`` x ``capacity`` touches (0: never); ``prior``: counts the
    runtime's policies start from (a routing profile's,
    :func:`mlx_edge0.popularity.prior_counts`); ``waited``: keys whose misses
    the runtime waits for, each use worth ``waited_cost``
    (:meth:`mlx_edge0.cache_policy.FrequencyPolicy.set_cost`); ``state``: a
    runtime policy's :meth:`~mlx_edge0.cache_policy.LRUPolicy.state`, which
    a policy of its kind starts from instead (its prior and costs are in it)."""

    def base(base_name: str) -> LRUPolicy:
        policy = FrequencyPolicy(capacity, lfu_aging) if base_name == "lfu" else POLICIES[base_name](capacity)
        if state is not None and state.get("policy") == base_name:
            policy.restore(state)
            return policy
        if prior:
            policy.add_prior(prior)
        if waited:
            policy.set_cost(waited, waited_cost)
        return policy

    if name == "min":
        return BeladyPolicy(calls)
    if name == POPULARITY:
        if popularity is None:
            raise ValueError("the popularity policy needs the experts' popularity")
        return PopularityPolicy(popularity)
    if name in POLICIES:
        return base(name)
    if name in PREDICTION_AWARE:
        return PredictionAware(base(name.removesuffix("+next")), calls if predicted is None else predicted, lookahead)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def simulate(
    trace: RoutingTrace,
    capacity: int,
    policy: str,
    *,
    bundle_bytes: int = 0,
    predicted: Optional[RoutingTrace] = None,
    lookahead: Optional[int] = None,
    permanent: AbstractSet[Key] = frozenset(),
    resident: Sequence[Key] = (),
    popularity: Optional[Mapping[Key, float]] = None,
    lfu_aging: int = LFU_AGING,
    prior: Optional[Mapping[Key, float]] = None,
    waited: AbstractSet[Key] = frozenset(),
    waited_cost: float = WAITED_MISS_COST,
    planned: AbstractSet[int] = frozenset(),
    prefer_settled: bool = True,
    settled_span: int = SETTLED_SPAN,
    policy_state: Optional[Mapping] = None,
) -> CacheResult:
    """Replay ``trace`` through a cache of ``capacity`` slots under ``policy``.

    Args:
        trace: the routing to replay.
        capacity: expert slots shared by all layers.
        policy: one of :data:`POLICY_NAMES`.
        bundle_bytes: bytes one miss reads from the device (an expert bundle).
        predicted: for ``*+next``, the prerouter's predicted routing (same
            tokens and layers as ``trace``); default: ``trace`` itself.
        lookahead: MoE calls a ``*+next`` policy protects; default: one token
            (the number of MoE layers).
        permanent: keys resident from the start and never evicted.
        resident: further keys resident from the start (evictable), in
            the order their rows were filled.
        popularity: for :data:`POPULARITY`, each key's popularity.
        lfu_aging: LFU's counts halve every ``lfu_aging`` x ``capacity``
            touches (0: never); the runtime's is the default.
        prior: counts LFU (and ``lfu+next``) starts from, as the runtime's
            cache does from a routing profile.
        waited: keys whose misses the runtime waits for (a layer no head
            predicts): LFU counts each of their uses ``waited_cost`` times,
            as the runtime's cache does.
        planned: layers a prerouted decode plans when each token's step
            opens, in the runtime's order: their misses are placed in layer
            order, pinned, before the other layers' calls, and their uses
            counted after those (``HotCache.start_planned``). The runtime's
            policies only; MIN and the others replay call by call.
        prefer_settled: the runtime's policies take settled victims first
            (:func:`mlx_edge0.cache_policy.plan_fill`): bundles of a layer
            that has routed in this token, among ``settled_span`` x misses
            of the lowest ranked (the runtime's by default).
        policy_state: what the runtime's policy had learned when the trace
            began (:meth:`mlx_edge0.cache_policy.LRUPolicy.state`: the
            prompt's and warm-up's uses, the prior, the costs); a policy of
            its kind starts from it instead of ``prior`` and ``waited``'s
            costs, so with the runtime's start it replays what the runtime
            served.

    Raises:
        ValueError: the capacity left by ``permanent`` is smaller than a
            routed set (the runtime bypasses the cache then; a replay
            cannot), ``permanent`` and ``resident`` together exceed it, or
            ``predicted`` does not match ``trace``'s shape.
    """
    calls = call_keys(trace)
    largest = max((len(keys) for keys in calls), default=0)
    if capacity - len(permanent) < largest:
        raise ValueError(
            f"capacity {capacity} less {len(permanent)} permanent is smaller than a routed set of {largest} experts"
        )
    start = sorted(permanent) + [k for k in dict.fromkeys(resident) if k not in permanent]
    if len(start) > capacity:
        raise ValueError(f"{len(start)} keys resident at the start exceed the capacity {capacity}")
    if predicted is not None and (predicted.layers, len(predicted.tokens)) != (trace.layers, len(trace.tokens)):
        raise ValueError("the predicted trace must have the replayed trace's layers and token count")
    victims = make_policy(
        policy,
        calls,
        capacity,
        None if predicted is None else call_keys(predicted),
        len(trace.layers) if lookahead is None else lookahead,
        popularity,
        lfu_aging,
        prior,
        waited,
        waited_cost,
        policy_state,
    )
    cached: dict[Key, int] = {k: row for row, k in enumerate(start)}
    free = list(range(len(cached), capacity))
    runtime = policy in POLICIES
    hits = accesses = waited_misses = 0
    for token in trace.tokens:  # as the runtime's HotCache, without the reads
        routed: set[int] = set()  # layers that have routed in this token
        pinned: set[Key] = set()
        settled = (lambda k: k[0] in routed) if runtime and prefer_settled else None
        for first_pass in (True, False):  # the planned layers when the step opens, then every call
            for layer, ids in zip(trace.layers, token):
                keys = [(layer, e) for e in ids]
                plans = runtime and layer in planned
                if plans and not first_pass:
                    pinned.difference_update(keys)
                    victims.touch(keys)  # the planned call computes: its use counts now
                    continue
                if plans != first_pass:
                    continue
                routed.add(layer)
                placed, evicted = plan_fill(keys, cached, free, victims, permanent | pinned, settled, settled_span)
                for k in evicted:
                    del cached[k]
                    victims.forget(k)
                free = free[len(placed) - len(evicted) :]
                cached.update(placed)
                if plans:
                    pinned.update(keys)
                else:
                    victims.touch(keys)
                hits += len(keys) - len(placed)
                accesses += len(keys)
                waited_misses += sum(k in waited for k in placed)
    return CacheResult(policy, capacity, len(trace.tokens), accesses, hits, bundle_bytes, waited_misses)


@dataclass(frozen=True)
class RecordedDecode:
    """A bench run's decode routing and the hot cache it began with (``edge0
    bench`` keeps both), so the decode replays offline under any policy from
    the runtime's own start.

    Attributes:
        trace: the decoded tokens' routing.
        capacity: the hot cache's rows.
        permanent: bundles never evicted (the prerouter's unowned layers).
        resident: what the cache held when the timed decode began.
        waited: bundles whose uses the policy weighed by the cost of a
            waited miss (the unowned layers that are not permanent; empty in
            records made before the runtime weighed them).
        planned: layers whose bundles the cache placed when each step
            opened (empty in records made before the bench recorded them:
            they replay call by call).
        runtime_hit_rate: the share of the decode's routings the runtime
            served from its cache.
        policy_state: what the runtime's policy had learned when the decode
            began (the prompt's and warm-up's uses among it; None in records
            made before the bench kept it): :meth:`runtime_start`.
    """

    trace: RoutingTrace
    capacity: int
    permanent: frozenset[Key]
    resident: list[Key]
    runtime_hit_rate: float
    waited: frozenset[Key] = frozenset()
    planned: frozenset[int] = frozenset()
    policy_state: Optional[dict] = None

    def start(self) -> dict:
        """``simulate``'s keyword arguments for the cache this decode began
        with, and the order the runtime placed its bundles in; the policy
        starts from the counts a replay gives it (``prior``)."""
        return {"permanent": self.permanent, "resident": self.resident, "waited": self.waited, "planned": self.planned}

    def runtime_start(self) -> dict:
        """:meth:`start` with the runtime's policy as it was then, where the
        record kept it: its kind replays what the runtime served (a
        ``prior`` given beside it is not used)."""
        return self.start() | {"policy_state": self.policy_state}

    @classmethod
    def of(cls, run: Mapping) -> Optional["RecordedDecode"]:
        """The recorded decode of one run of a results JSON's ``runs``, or
        None for a run that kept no routing or no cache start (an arm without
        a hot cache, an older record)."""
        replay = run.get("eviction_replay", {})
        if "routing" not in run or "resident_keys" not in replay:
            return None
        rate = hot_hit_rate(run["decode_counters"])
        return cls(
            RoutingTrace(**run["routing"]),
            replay["capacity"],
            frozenset(tuple(k) for k in replay["permanent_keys"]),
            [tuple(k) for k in replay["resident_keys"]],
            float("nan") if rate is None else rate,
            frozenset(tuple(k) for k in replay.get("waited_keys", [])),
            frozenset(replay.get("planned_layers", [])),
            replay.get("policy_at_start"),
        )


def recorded_decodes(path: Path) -> list[tuple[dict, RecordedDecode]]:
    """The runs of an ``edge0 bench`` results file that recorded their decode,
    each with it.

    Raises:
        ValueError: ``path`` is not a readable results JSON (named in the message).
    """
    try:
        runs = json.loads(Path(path).read_text())["runs"]
        return [(run, decode) for run in runs if (decode := RecordedDecode.of(run)) is not None]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not an edge0 bench results file with recorded runs ({e!r})") from None


def ceiling(trace: RoutingTrace, permanent: AbstractSet[Key] = frozenset(), resident: Iterable[Key] = ()) -> float:
    """Hit rate of an unbounded cache: every routing but each expert's first
    (``permanent`` and ``resident`` experts are resident before theirs)."""
    first = len({k for keys in call_keys(trace) for k in keys} - set(permanent) - set(resident))
    return 1 - first / trace.routings if trace.routings else float("nan")


def compare(
    trace: RoutingTrace,
    capacities: Iterable[int],
    policies: Sequence[str] = POLICY_NAMES,
    *,
    bundle_bytes: int = 0,
    predicted: Optional[RoutingTrace] = None,
    permanent: AbstractSet[Key] = frozenset(),
    resident: Sequence[Key] = (),
    popularity: Optional[Mapping[Key, float]] = None,
    waited: AbstractSet[Key] = frozenset(),
    planned: AbstractSet[int] = frozenset(),
    prior: Optional[Mapping[Key, float]] = None,
    policy_state: Optional[Mapping] = None,
) -> list[CacheResult]:
    """Every policy at every capacity (capacities whose rows left by
    ``permanent`` are fewer than a routed set, or too few for ``resident``,
    skipped)."""
    largest = max((len(ids) for tok in trace.tokens for ids in tok), default=0)
    start = len(set(permanent) | set(resident))
    return [
        simulate(
            trace,
            c,
            p,
            bundle_bytes=bundle_bytes,
            predicted=predicted,
            permanent=permanent,
            resident=resident,
            popularity=popularity,
            waited=waited,
            planned=planned,
            prior=prior,
            policy_state=policy_state,
        )
        for c in capacities
        if c - len(permanent) >= largest and c >= start
        for p in policies
    ]

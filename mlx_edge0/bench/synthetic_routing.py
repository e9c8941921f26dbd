"""Synthetic routing traces whose locality is a documented knob.

A random-weight checkpoint routes however its random routers happen to, so
the cache numbers it gives say little about a trained model. These traces
stand in for a router with a chosen locality, with the shape (layers, E, K,
tokens) of a real trace:

- ``uniform``: every token draws K distinct experts uniformly, independently
  of the previous token (reuse K/E, no popular experts): the floor.
- ``calibrated``: per layer a Zipf popularity over a random order of the
  experts (``p ∝ 1 / rank^s``) and token-to-token stickiness (each expert of
  the previous token's set is kept with probability ``keep``; the rest of
  the K are drawn from the popularity without replacement). ``s`` and
  ``keep`` are solved (:func:`calibrate`) so that a long trace measures the
  published figures below; the solution depends on E and K.

Published figures (sources in BENCHMARKS.md, "Routing locality"):

- :data:`CALIBRATED_COVERAGE90` = 0.51: Qwen3-30B-A3B needs 65 of its 128
  experts per layer, hottest first, to cover 90% of its routings on a mixed
  prose/code/math workload (45% on single-domain Python).
- :data:`CALIBRATED_REUSE` = 0.25: adjacent tokens share about 25% of a
  layer's experts (the Edge0 paper, Qwen3.6-35B-A3B).

When popularity alone already gives more reuse than the target (small E with
large K/E), ``keep`` is 0 and the measured reuse is reported as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from .locality import RoutingTrace, coverage_per_layer, reuse_per_layer

LOCALITIES = ("uniform", "calibrated")
CALIBRATED_COVERAGE90 = 0.51
CALIBRATED_REUSE = 0.25
CALIBRATION_TOKENS = 800
BISECTION_STEPS = 14


@dataclass(frozen=True)
class TraceShape:
    """A trace shape and the cache it is replayed through."""

    layers: int
    experts: int
    k: int
    capacity: int  # cache rows shared by all layers
    coverage90: float
    reuse: float


# The calibrated 35B's K=4 trace and its 2 GiB hot cache (BENCHMARKS.md, "A 2 GiB hot
# cache"): held-out coverage90 0.51 and reuse 0.107, 1,092 rows.
CALIBRATED_35B_2GIB = TraceShape(layers=40, experts=256, k=4, capacity=1092, coverage90=0.51, reuse=0.107)


@dataclass(frozen=True)
class Locality:
    """The generator's knobs.

    Attributes:
        popularity: Zipf exponent ``s`` (0 = every expert equally popular).
        keep: probability that an expert of the previous token's set is
            routed again (0 = independent tokens).
    """

    popularity: float = 0.0
    keep: float = 0.0

    def __post_init__(self):
        if self.popularity < 0 or not 0 <= self.keep <= 1:
            raise ValueError(f"popularity must be >= 0 and keep in [0, 1], got {self}")


def _layer_sets(
    rng: np.random.Generator, num_experts: int, k: int, tokens: int, knobs: Locality
) -> tuple[list[tuple], np.ndarray]:
    """One layer's routed sets and its draw weights (the Zipf popularity)."""
    order = rng.permutation(num_experts)
    p = np.empty(num_experts)
    p[order] = 1.0 / np.arange(1, num_experts + 1) ** knobs.popularity
    sets: list[tuple] = []
    previous: list[int] = []
    for _ in range(tokens):
        kept = [e for e in previous if rng.random() < knobs.keep]
        weights = p.copy()
        weights[kept] = 0.0
        drawn = rng.choice(num_experts, size=k - len(kept), replace=False, p=weights / weights.sum())
        previous = kept + [int(e) for e in drawn]
        sets.append(tuple(sorted(previous)))
    return sets, p / p.sum()


def generate_with_popularity(
    layers: Sequence[int], num_experts: int, k: int, tokens: int, knobs: Locality, seed: int = 0, source: str = ""
) -> tuple[RoutingTrace, np.ndarray]:
    """A trace with the given knobs (the same seed gives the same trace) and
    each layer's popularity, ``[len(layers), E]``: the generator's draw
    weights, summing to 1 per layer. With ``keep`` 0 tokens are independent
    draws from it, so it is everything a cache could know in advance."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"K must be in [1, E={num_experts}], got {k}")
    rng = np.random.default_rng(seed)
    per_layer = [_layer_sets(rng, num_experts, k, tokens, knobs) for _ in layers]
    trace_tokens = tuple(tuple(per_layer[i][0][t] for i in range(len(layers))) for t in range(tokens))
    trace = RoutingTrace(tuple(layers), num_experts, k, trace_tokens, source or f"synthetic {knobs}, seed {seed}")
    return trace, np.stack([weights for _, weights in per_layer])


def generate(
    layers: Sequence[int], num_experts: int, k: int, tokens: int, knobs: Locality, seed: int = 0, source: str = ""
) -> RoutingTrace:
    """A trace with the given knobs; the same seed gives the same trace."""
    return generate_with_popularity(layers, num_experts, k, tokens, knobs, seed, source)[0]


def _measure(num_experts: int, k: int, knobs: Locality) -> tuple[float, float]:
    t = generate((0,), num_experts, k, CALIBRATION_TOKENS, knobs, seed=12345)
    return coverage_per_layer(t)[0], reuse_per_layer(t)[0]


def _bisect(f, lo: float, hi: float, target: float, increasing: bool) -> float:
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@lru_cache(maxsize=None)
def calibrate(
    num_experts: int, k: int, coverage90: float = CALIBRATED_COVERAGE90, reuse: float = CALIBRATED_REUSE
) -> Locality:
    """Knobs whose trace measures ``coverage90`` and ``reuse`` (deterministic;
    a coverage or reuse the generator cannot reach gives the nearest knob)."""
    keep = 0.0
    for _ in range(2):  # keep shifts the popularity a little: solve twice
        s = _bisect(lambda x: _measure(num_experts, k, Locality(x, keep))[0], 0.0, 4.0, coverage90, False)
        keep = _bisect(lambda x: _measure(num_experts, k, Locality(s, x))[1], 0.0, 1.0, reuse, True)
        if _measure(num_experts, k, Locality(s, 0.0))[1] >= reuse:
            keep = 0.0
    return Locality(s, keep)


def synthetic_trace(
    layers: Sequence[int], num_experts: int, k: int, tokens: int, *, locality: str, seed: int = 0
) -> RoutingTrace:
    """A ``uniform`` or ``calibrated`` trace of the given shape."""
    if locality == "uniform":
        knobs = Locality()
    elif locality == "calibrated":
        knobs = calibrate(num_experts, k)
    else:
        raise ValueError(f"unknown locality {locality!r}; choose one of {', '.join(LOCALITIES)}")
    return generate(layers, num_experts, k, tokens, knobs, seed, f"synthetic {locality} {knobs}, seed {seed}")

"""Synthetic routing traces: the knobs do what the docstring says."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_edge0.bench.locality import coverage_per_layer, reuse_per_layer
from mlx_edge0.bench.synthetic_routing import Locality, calibrate, generate, generate_with_popularity, synthetic_trace


def test_uniform_has_no_locality_beyond_chance():
    t = synthetic_trace((0, 3), 16, 4, 400, locality="uniform")
    assert t.layers == (0, 3) and len(t.tokens) == 400 and all(len(ids) == 4 for tok in t.tokens for ids in tok)
    assert all(abs(r - 4 / 16) < 0.04 for r in reuse_per_layer(t))
    assert synthetic_trace((0, 3), 16, 4, 400, locality="uniform") == t  # seeded


def test_keep_sets_reuse_and_popularity_sets_coverage():
    sticky = generate((0,), 64, 4, 400, Locality(keep=0.8))
    assert 0.78 < reuse_per_layer(sticky)[0] < 0.86
    skewed = generate((0,), 64, 4, 400, Locality(popularity=1.5))
    assert coverage_per_layer(skewed)[0] < 0.5 < coverage_per_layer(generate((0,), 64, 4, 400, Locality()))[0]


def test_calibrated_reaches_the_published_coverage():
    knobs = calibrate(16, 4)
    t = synthetic_trace((0,), 16, 4, 800, locality="calibrated")
    assert 0.5 <= coverage_per_layer(t)[0] <= 0.5625  # 8 or 9 of 16 experts: 0.51 lies between
    assert knobs.keep == 0.0  # at K/E = 1/4 that skew alone gives more than 25% reuse
    with pytest.raises(ValueError, match="unknown locality 'zipf'"):
        synthetic_trace((0,), 16, 4, 8, locality="zipf")
    with pytest.raises(ValueError, match="keep in"):
        Locality(keep=1.5)


def test_the_popularity_returned_is_what_the_tokens_were_drawn_from():
    """The same trace as ``generate`` for the seed, and per layer weights
    summing to 1: equal without skew; with skew the heaviest expert is the
    one routed most over a long trace."""
    knobs = Locality(popularity=1.5)
    t, weights = generate_with_popularity((0, 5), 32, 2, 600, knobs, seed=3)
    assert t == generate((0, 5), 32, 2, 600, knobs, seed=3)
    assert weights.shape == (2, 32) and np.allclose(weights.sum(axis=1), 1.0)
    counts = np.zeros((2, 32))
    for tok in t.tokens:
        for i, ids in enumerate(tok):
            counts[i, list(ids)] += 1
    assert (counts.argmax(axis=1) == weights.argmax(axis=1)).all()
    _, flat = generate_with_popularity((0,), 8, 2, 10, Locality())
    assert np.allclose(flat, 1 / 8)

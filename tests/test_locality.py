"""Routing-trace locality measurements on hand-made traces with known values."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import load_benchmark_script

from mlx_edge0.bench.locality import (
    LocalitySummary,
    RoutingTrace,
    coverage_per_layer,
    distinct_per_layer,
    reuse_per_layer,
    top_count,
    top_share_per_layer,
    uniform_reuse,
    uniform_top_share,
)
from mlx_edge0.bench.synthetic_routing import Locality, generate


def hand_trace() -> RoutingTrace:
    """Two MoE layers (0 and 2), E=4, K=2, three tokens:

    layer 0: {0,1} {1,2} {1,3}   distinct 4; reuse (1/2 + 1/2)/2 = 0.5
                                 counts 1,3,1,1: top expert 3/6 = 0.5; 90% of 6 needs all 4
    layer 2: {2,3} {2,3} {0,2}   distinct 3; reuse (2/2 + 1/2)/2 = 0.75
                                 counts 1,0,3,2: top expert 3/6 = 0.5; 90% needs 3 of 4
    """
    return RoutingTrace(
        layers=(0, 2),
        num_experts=4,
        k=2,
        tokens=(((1, 0), (2, 3)), ((1, 2), (3, 2)), ((1, 3), (0, 2))),
        source="hand",
    )


def test_hand_trace_values():
    t = hand_trace()
    assert distinct_per_layer(t) == [4, 3]
    assert reuse_per_layer(t) == [0.5, 0.75]
    assert top_count(4) == 1 and top_count(16) == 2 and top_count(128) == 13
    assert top_share_per_layer(t) == [0.5, 0.5]
    assert coverage_per_layer(t) == [1.0, 0.75]
    assert uniform_reuse(t) == 0.5 and uniform_top_share(t) == 0.25
    s = LocalitySummary.of(t)
    assert s.mean("reuse") == 0.625 and s.as_dict()["mean_distinct"] == 3.5
    assert t.routings == 12
    assert t.routed_k() == (2, 2)
    k_tier = RoutingTrace((1, 2), 8, 4, (((0, 1, 2, 3), (4, 5)), ((1, 2, 3, 4), (5, 6))))
    assert k_tier.routed_k() == (4, 2)  # the first MoE layer at the checkpoint's K, the rest at the heads'


def test_identical_tokens_reuse_everything_and_one_token_has_no_reuse():
    same = RoutingTrace((0,), 8, 2, (((3, 5),),) * 4)
    assert reuse_per_layer(same) == [1.0] and distinct_per_layer(same) == [2]
    assert math.isnan(reuse_per_layer(RoutingTrace((0,), 8, 2, (((3, 5),),)))[0])


def test_from_calls_groups_tokens_and_round_trips(tmp_path):
    t = hand_trace()
    calls = [(layer, list(ids)) for layer, ids in t.calls()]
    assert calls[:2] == [(0, [0, 1]), (2, [2, 3])]
    assert RoutingTrace.from_calls(calls, 4, 2, source="hand") == t
    t.save(tmp_path / "t.json")
    assert RoutingTrace.load(tmp_path / "t.json") == t


def test_bad_traces_are_refused(tmp_path):
    with pytest.raises(ValueError, match="visits MoE layers"):
        RoutingTrace.from_calls([(0, [1]), (2, [1]), (0, [1])], 4, 1)
    with pytest.raises(ValueError, match="routed sets for 2 MoE layers"):
        RoutingTrace((0, 1), 4, 1, (((1,),),))
    with pytest.raises(ValueError, match=r"distinct ids in \[0, 4\)"):
        RoutingTrace((0,), 4, 1, (((4,),),))
    (tmp_path / "x.json").write_text('{"layers": []}')
    with pytest.raises(ValueError, match="not an edge0-routing-trace"):
        RoutingTrace.load(tmp_path / "x.json")


def test_reuse_by_distance_against_popularity_alone(tmp_path, monkeypatch):
    script = load_benchmark_script("reuse_by_distance")
    # E=4, K=1: 0 0 1 1. At d=1 two of three pairs repeat, at d=2 none; popularity
    # alone (two experts used twice each in four tokens): 2 * 2 * 1 / (4 * 3) = 1/3.
    hand = RoutingTrace((0,), 4, 1, (((0,),), ((0,),), ((1,),), ((1,),)))
    used = script.usage(hand)
    assert script.reuse_at(used, 1) == pytest.approx(2 / 3)
    assert script.reuse_at(used, 2) == 0.0
    assert math.isnan(script.reuse_at(used, 4))
    assert script.memoryless_reuse(used) == pytest.approx(1 / 3)
    # Independent tokens: the ratio is 1 at every distance; a sticky trace's is above 1 near.
    free = generate((0, 1, 2), 32, 4, 2000, Locality(popularity=1.0), seed=3)
    sticky = generate((0, 1, 2), 32, 4, 2000, Locality(popularity=1.0, keep=0.5), seed=3)
    free_row = script.measure("free", free, [1, 8, 64])
    sticky_row = script.measure("sticky", sticky, [1, 8, 64])
    for d in ("1", "8", "64"):
        assert free_row["ratio"][d] == pytest.approx(1.0, abs=0.03)
    assert sticky_row["ratio"]["1"] > 1.3
    hand.save(tmp_path / "hand.json")
    out = tmp_path / "reuse.json"
    argv = ["reuse_by_distance.py", "--trace", str(tmp_path / "hand.json"), "--distances", "1,2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    data = json.loads(out.read_text())
    assert data["traces"][0]["reuse"] == {"1": pytest.approx(2 / 3), "2": 0.0}
    assert out.with_suffix(".svg").read_text().startswith("<svg")


def test_reuse_by_distance_names_bad_input(tmp_path, monkeypatch):
    script = load_benchmark_script("reuse_by_distance")
    (tmp_path / "junk.json").write_text("{not json")
    RoutingTrace((0,), 4, 1, (((0,),),)).save(tmp_path / "one.json")
    out = str(tmp_path / "r.json")
    for argv, message in [
        (["--trace", str(tmp_path / "junk.json")], "junk.json: not a readable routing trace"),
        (["--bench", str(tmp_path / "junk.json")], "junk.json: not an edge0 bench results file"),
        (["--trace", str(tmp_path / "one.json")], "one.json: 1 tokens, and a reuse needs two"),
        (["--trace", str(tmp_path / "one.json"), "--distances", "0,1"], "every distance must be at least 1"),
        (["--trace", str(tmp_path / "one.json"), "--distances", "a"], "not a comma-separated list"),
    ]:
        monkeypatch.setattr(sys, "argv", ["reuse_by_distance.py", *argv, "--out", out])
        with pytest.raises(SystemExit, match=message):
            script.main()
    assert not (tmp_path / "r.json").exists()

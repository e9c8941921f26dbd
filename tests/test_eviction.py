"""Eviction policies replayed on hand-made traces with known optima, and
Belady's MIN checked against an exhaustive search on random small traces."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_edge0.bench.eviction import (
    POLICY_NAMES,
    POPULARITY,
    RecordedDecode,
    call_keys,
    ceiling,
    compare,
    measured_popularity,
    recorded_decodes,
    simulate,
)
from mlx_edge0.bench.locality import RoutingTrace
from mlx_edge0.cache_policy import SETTLED_SPAN, WAITED_MISS_COST, FrequencyPolicy, LRUPolicy, plan_fill

from conftest import load_benchmark_script

PROPERTY = settings(
    max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def one_layer(ids: list[int], num_experts: int) -> RoutingTrace:
    """One MoE layer, K=1: token t routes to ``ids[t]``."""
    return RoutingTrace((0,), num_experts, 1, tuple(((e,),) for e in ids))


def test_cyclic_pattern_defeats_lru_and_lfu_but_not_min():
    """Experts 0 1 2 cycled three times through 2 slots.

    LRU always evicts the expert needed next: 0 hits of 9. MIN, by hand:
    0m 1m 2m (evict 1: next 0 at call 3, next 1 at 4) 0h 1m (evict 0: next 2
    at 5, 0 at 6) 2h 0m (evict 2: 1 at 7, 2 at 8) 1h 2m -> 3 hits.
    The runtime's LFU keeps counts across evictions and ties on count go to
    the older expert, which is again the next one: 0 hits. Sparing the next
    call's expert (a perfect one-token prediction, one layer) makes LRU
    evict exactly as MIN does here: 3 hits.
    """
    t = one_layer([0, 1, 2] * 3, 3)
    hits = {p: simulate(t, 2, p).hits for p in POLICY_NAMES}
    assert hits == {"lru": 0, "lfu": 0, "min": 3, "lru+next": 3, "lfu+next": 3}


def test_min_on_sets_across_layers():
    """Two layers, E=3, K=2, 4 slots shared, three tokens:

    call: c0 L0{0,1}  c1 L1{0,1}  c2 L0{0,2}  c3 L1{0,1}  c4 L0{0,1}  c5 L1{1,2}

    c0, c1 fill the 4 slots (4 misses). c2: (0,2) misses; of the residents
    not routed now, (0,1) is next used at c4, (1,0) and (1,1) at c3: MIN
    evicts (0,1). c3: 2 hits. c4: (0,0) hits, (0,1) misses; (0,2) and (1,0)
    are never used again, evict one. c5: (1,1) hits, (1,2) misses.
    Hits 1 + 2 + 1 + 1 = 5 of 12; 6 (the ceiling) would need (0,1) to
    survive c2 at the cost of a miss at c3, so 5 is the optimum.
    """
    t = RoutingTrace(
        (0, 1),
        3,
        2,
        (((0, 1), (0, 1)), ((0, 2), (0, 1)), ((0, 1), (1, 2))),
    )
    r = simulate(t, 4, "min", bundle_bytes=1000)
    assert (r.hits, r.accesses, r.misses) == (5, 12, 7)
    assert r.bytes_per_token == pytest.approx(7000 / 3)
    assert ceiling(t) == 0.5
    assert optimum(t, 4) == 5
    assert all(simulate(t, 4, p).hits <= 5 for p in POLICY_NAMES)


def test_prediction_aware_uses_the_given_prediction():
    """A prediction that only ever names expert 3, which is never routed,
    protects nothing: prediction-aware LRU is plain LRU. The perfect one is
    the trace itself (the default)."""
    t = one_layer([0, 1, 2] * 3, 4)
    useless = one_layer([3] * 9, 4)
    assert simulate(t, 2, "lru+next", predicted=useless).hits == simulate(t, 2, "lru").hits == 0
    assert simulate(t, 2, "lru+next", predicted=t).hits == simulate(t, 2, "lru+next").hits == 3
    with pytest.raises(ValueError, match="same|layers and token count"):
        simulate(t, 2, "lru+next", predicted=one_layer([3] * 4, 4))


def test_knowing_the_popularity_keeps_what_learning_from_the_past_evicts():
    """One layer, 2 rows, experts 1 2 0 1 0 1, expert 2 the least popular.
    At call 2 (expert 0) LRU and LFU evict 1 (used once, longer ago) and then
    miss it at call 3: 2 hits (calls 4 and 5). The popularity policy evicts
    2, the expert never routed again, as MIN does: 3 hits (calls 3-5). A key
    with no popularity given counts as the least popular."""
    t = one_layer([1, 2, 0, 1, 0, 1], 3)
    popularity = {(0, 0): 0.5, (0, 1): 0.4, (0, 2): 0.1}
    hits = {p: simulate(t, 2, p, popularity=popularity).hits for p in ("lru", "lfu", POPULARITY, "min")}
    assert hits == {"lru": 2, "lfu": 2, POPULARITY: 3, "min": 3}
    assert simulate(t, 2, POPULARITY, popularity={(0, 0): 0.5, (0, 1): 0.4}).hits == 3
    with pytest.raises(ValueError, match="needs the experts' popularity"):
        simulate(t, 2, POPULARITY)


def test_a_profile_is_each_experts_share_of_its_layers_routings():
    """Layers 3 and 7, K=2, two tokens: layer 3 routes 0 1 then 0 2 (0 takes
    half its routings), layer 7 routes 1 2 twice. The one-layer trace of the
    popularity test, profiled on itself (2 the least routed), makes the
    policy evict 2 as MIN does: 3 hits; ``compare`` hands the profile on."""
    t = RoutingTrace((3, 7), 3, 2, (((0, 1), (1, 2)), ((0, 2), (1, 2))))
    profile = measured_popularity(t)
    assert profile == {(3, 0): 0.5, (3, 1): 0.25, (3, 2): 0.25, (7, 1): 0.5, (7, 2): 0.5}
    replay = one_layer([1, 2, 0, 1, 0, 1], 3)
    assert simulate(replay, 2, POPULARITY, popularity=measured_popularity(replay)).hits == 3
    assert [r.policy for r in compare(replay, [2], ["lfu", POPULARITY], popularity=profile)] == ["lfu", POPULARITY]


def test_an_unbounded_cache_reaches_the_ceiling_under_every_policy():
    t = RoutingTrace((0, 1), 3, 2, (((0, 1), (0, 1)), ((0, 2), (0, 1)), ((0, 1), (1, 2))))
    for r in compare(t, [6]):
        assert r.hit_rate == ceiling(t)


def test_capacity_below_a_routed_set_is_refused():
    t = RoutingTrace((0,), 4, 2, (((0, 1),),))
    with pytest.raises(ValueError, match="smaller than a routed set of 2"):
        simulate(t, 1, "lru")
    assert compare(t, [1, 2], ["lru"])[0].capacity == 2  # compare skips it
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        simulate(t, 2, "fifo")


def test_permanent_keys_hit_from_the_start_and_leave_the_rest_to_the_other_layers():
    """Two layers, E=2, K=1, both routing 0 1 0 1, 3 rows, layer 0 permanent
    (as the runtime holds the first MoE layer with the prerouter on): its 4
    calls hit, and layer 1 cycles two experts through the one row left, 4
    misses, under every policy. Without it MIN gets 3 hits (c3 evicts (0,1),
    c4 and c5 hit, c6 misses, c7 hits)."""
    t = RoutingTrace((0, 1), 2, 1, tuple(((e,), (e,)) for e in (0, 1, 0, 1)))
    layer0 = frozenset({(0, 0), (0, 1)})
    assert {p: simulate(t, 3, p, permanent=layer0).hits for p in POLICY_NAMES} == dict.fromkeys(POLICY_NAMES, 4)
    assert simulate(t, 3, "min").hits == 3
    assert ceiling(t) == 0.5 and ceiling(t, layer0) == 0.75
    with pytest.raises(ValueError, match="capacity 2 less 2 permanent is smaller than a routed set of 1"):
        simulate(t, 2, "lru", permanent=layer0)
    assert [r.capacity for r in compare(t, [2, 3], ["lru"], permanent=layer0)] == [3]


def test_a_replay_can_start_from_the_cache_the_runtime_had():
    """One layer, 2 rows holding experts 0 then 2 when the replay starts
    (the runtime's cache after the prompt and warm-up), then 1 0 2 0. By hand:
    LRU and LFU know no past use of 0 or 2 and evict 0 (filled first) for 1,
    then 2 for 0, then 1 for 2: one hit (the last 0). MIN evicts 2 (next use
    call 2) for 1, hits 0, evicts 1 (never again) for 2, hits 0: two. From
    an empty cache MIN gets one (the last 0). Ceilings: 3 of 4 (only 1 is a
    first use) against 1 of 4."""
    t = one_layer([1, 0, 2, 0], 3)
    start = [(0, 0), (0, 2)]
    assert {p: simulate(t, 2, p, resident=start).hits for p in ("lru", "lfu", "min")} == {"lru": 1, "lfu": 1, "min": 2}
    assert simulate(t, 2, "min").hits == 1
    assert ceiling(t, resident=start) == 0.75 and ceiling(t) == 0.25
    assert simulate(t, 3, "lru", resident=start).hits == ceiling(t, resident=start) * 4
    with pytest.raises(ValueError, match="2 keys resident at the start exceed the capacity 1"):
        simulate(t, 1, "lru", resident=start)
    assert [r.capacity for r in compare(t, [1, 2], ["lru"], resident=start)] == [2]


def test_a_waited_bundle_outranks_a_prerouted_one_used_about_as_often():
    """One layer, 2 rows, 0 0 1 1 1 2 0, expert 0's misses waited for. At
    call 6 (expert 2) the victim is 0 (2 uses) or 1 (3 uses): plain LFU
    evicts 0, and the last 0 misses again (hits: calls 2, 4, 5; two waited
    misses); at the default cost 2, 0's uses count 4, 1 goes, and the last 0
    hits, as under MIN. LRU has no use for a cost: 0 is least recent."""
    t = one_layer([0, 0, 1, 1, 1, 2, 0], 3)
    waited = frozenset({(0, 0)})
    plain = simulate(t, 2, "lfu", waited=waited, waited_cost=1)
    weighted = simulate(t, 2, "lfu", waited=waited)
    assert (plain.hits, plain.waited_misses) == (3, 2) and (weighted.hits, weighted.waited_misses) == (4, 1)
    assert weighted.hits == simulate(t, 2, "min").hits
    assert (simulate(t, 2, "lru", waited=waited).hits, simulate(t, 2, "lfu").waited_misses) == (3, 0)
    policy = FrequencyPolicy(4)
    policy.touch(["w", "p", "p", "p"])
    policy.set_cost(["w"], WAITED_MISS_COST)
    assert policy.priority("w") == (2.0, 1) and policy.victims(["w", "p"], 1) == ["w"]  # a tie: 'w' is older
    policy.forget("w")
    policy.touch(["w", "w"])
    assert policy.priority("w") == (6.0, 6) and policy.victims(["w", "p"], 1) == [
        "p"
    ]  # its count and cost outlive a forget
    with pytest.raises(ValueError, match="a miss's cost must be > 0, got 0"):
        policy.set_cost(["w"], 0)
    before, after = FrequencyPolicy(4), FrequencyPolicy(4)  # uses counted before a cost is set are rescaled
    before.add_prior({"w": 1.5})
    before.add_uses({"w": 2})
    before.set_cost(["w"], 3)
    after.set_cost(["w"], 3)
    after.add_prior({"w": 1.5})
    after.add_uses({"w": 2})
    assert before.priority("w") == after.priority("w") == (10.5, 2)


@settings(max_examples=200, deadline=None)
@given(
    touches=st.lists(st.sampled_from("abcdef"), max_size=150),
    prior=st.dictionaries(st.sampled_from("abcdefxy"), st.sampled_from([0.5, 1.0, 2.0]), max_size=4),
    candidates=st.lists(st.sampled_from("abcdefxyz"), unique=True),
    n=st.integers(0, 10),
)
def test_victims_are_the_first_of_a_stable_sort_by_priority(touches, prior, candidates, n):
    """``victims`` ranks without a Python call per key (``order``) and picks
    what sorting by ``priority`` picked: ties (keys never touched, equal
    counts and recency) stay in the candidates' order. Counts halve every 64
    touches of a 2-row LFU, so long traces halve too."""
    for policy in (LRUPolicy(2), FrequencyPolicy(2)):
        policy.add_prior(prior)
        policy.touch(touches)
        assert policy.victims(candidates, n) == sorted(candidates, key=policy.priority)[:n]


def test_a_policy_restored_from_its_state_ranks_and_learns_as_the_original():
    """A replay that starts from the runtime policy's ``state`` (JSON and
    back: keys become lists) ranks as it did, and goes on the same: counts,
    costs, recency and the halving clock are all in it."""
    keys = [(layer, e) for layer in range(3) for e in range(5)]
    for cls in (LRUPolicy, FrequencyPolicy):
        original = cls(4)
        original.add_prior({(0, 1): 3.0, (2, 4): 1.5})
        original.set_cost([(0, e) for e in range(5)], WAITED_MISS_COST)
        original.touch([keys[i % 7 * 2] for i in range(150)])  # LFU at 4 rows halves every 128 touches
        restored = cls(4)
        restored.restore(json.loads(json.dumps(original.state())))
        for policy in (original, restored):
            policy.touch([(1, 3), (0, 2), (1, 3), (2, 2)] * 30)  # the next halving; (0, 2)'s uses weigh its cost
        assert restored.victims(keys, 15) == original.victims(keys, 15)
        assert [restored.priority(k) for k in keys] == [original.priority(k) for k in keys]
    with pytest.raises(ValueError, match="a 'lru' policy's state cannot start a 'lfu' policy"):
        FrequencyPolicy(4).restore(LRUPolicy(4).state())


def test_a_settled_victim_goes_first_among_the_lowest_ranked_only():
    """LRU over keys 0..19 touched in order: 0 is the victim. A settled key
    among the SETTLED_SPAN x misses lowest goes first, in the policy's
    order; one ranked above them does not."""
    policy = LRUPolicy(20)
    policy.touch(range(20))
    resident = {k: k for k in range(20)}
    assert plan_fill(["new"], resident, [], policy, settled=lambda k: k in (5, 6))[1] == [5]
    assert plan_fill(["new"], resident, [], policy, settled=lambda k: k == SETTLED_SPAN)[1] == [0]
    assert plan_fill(["a", "b"], resident, [], policy, settled=lambda k: k == 9)[1] == [9, 0]
    assert plan_fill(["new"], resident, [], policy)[1] == [0]


def test_a_recorded_decode_replays_from_its_json_record():
    """A results JSON keeps a run's routing and cache start as lists; read
    back they replay as the test above, and the runtime's served share comes
    from its counters. A run with no start recorded (no hot cache) is None."""
    t = one_layer([1, 0, 2, 0], 3)
    run = {
        "routing": t.as_dict(),
        "eviction_replay": {"capacity": 2, "permanent_keys": [], "resident_keys": [[0, 0], [0, 2]]},
        "decode_counters": {"hot_hits": 3, "hot_misses": 1},
    }
    decode = RecordedDecode.of(json.loads(json.dumps(run)))
    assert decode.trace == t and decode.capacity == 2 and decode.runtime_hit_rate == 0.75
    assert decode.resident == [(0, 0), (0, 2)] and decode.permanent == decode.waited == frozenset()
    assert simulate(decode.trace, decode.capacity, "min", **decode.start()).hits == 2
    waited = RecordedDecode.of(
        json.loads(json.dumps(run | {"eviction_replay": run["eviction_replay"] | {"waited_keys": [[0, 1]]}}))
    )
    assert waited.start() == {
        "permanent": frozenset(),
        "resident": [(0, 0), (0, 2)],
        "waited": frozenset({(0, 1)}),
        "planned": frozenset(),
    }
    planned = RecordedDecode.of(run | {"eviction_replay": run["eviction_replay"] | {"planned_layers": [1, 2]}})
    assert planned.start()["planned"] == frozenset({1, 2})
    assert RecordedDecode.of({"arm": "edge0-exact", "decode_counters": {}}) is None
    assert RecordedDecode.of(run | {"eviction_replay": {"capacity": 2}}) is None


def test_a_results_file_gives_its_recorded_decodes_or_a_clear_error(tmp_path):
    t = one_layer([1, 0, 2, 0], 3)
    run = {
        "routing": t.as_dict(),
        "eviction_replay": {"capacity": 2, "permanent_keys": [], "resident_keys": [[0, 0]]},
        "decode_counters": {"hot_hits": 1, "hot_misses": 3},
    }
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [run, {"arm": "stock", "ok": False}]}))
    [(kept, decode)] = recorded_decodes(results)
    assert kept == json.loads(json.dumps(run)) and decode.resident == [(0, 0)] and decode.runtime_hit_rate == 0.25
    for bad, text in ((tmp_path / "missing.json", None), (tmp_path / "other.json", "[1, 2]")):
        if text is not None:
            bad.write_text(text)
        with pytest.raises(ValueError, match=f"{bad.name}: not an edge0 bench results file"):
            recorded_decodes(bad)


def optimum(trace: RoutingTrace, capacity: int) -> int:
    """Most hits any eviction choice gets (exhaustive over minimal evictions)."""
    calls = [frozenset(keys) for keys in call_keys(trace)]

    @lru_cache(maxsize=None)
    def best(i: int, resident: frozenset) -> int:
        if i == len(calls):
            return 0
        wanted = calls[i]
        hits = len(wanted & resident)
        over = len(resident | wanted) - capacity
        if over <= 0:
            return hits + best(i + 1, resident | wanted)
        return hits + max(
            best(i + 1, (resident - set(out)) | wanted)
            for out in itertools.combinations(sorted(resident - wanted), over)
        )

    return best(0, frozenset())


@st.composite
def small_traces(draw):
    layers = draw(st.integers(1, 2))
    experts = draw(st.integers(2, 5))
    k = draw(st.integers(1, min(3, experts)))
    tokens = draw(st.integers(1, 8))
    routed = st.sets(st.integers(0, experts - 1), min_size=k, max_size=k)
    trace = RoutingTrace(
        tuple(range(layers)),
        experts,
        k,
        tuple(tuple(tuple(draw(routed)) for _ in range(layers)) for _ in range(tokens)),
    )
    capacity = draw(st.integers(k, layers * experts))
    return trace, capacity


@PROPERTY
@given(small_traces())
def test_min_is_the_optimum_and_no_policy_beats_it(case):
    trace, capacity = case
    results = {r.policy: r.hits for r in compare(trace, [capacity])}
    assert results["min"] == optimum(trace, capacity)
    assert all(hits <= results["min"] for hits in results.values())


def test_waited_cost_replays_a_record_at_each_cost_and_names_an_older_records_first_layer():
    """``benchmarks/waited_cost.py`` on the trace of the test above: cost 1
    gives 3 hits of 7 and two waited misses, cost 2 four and one, ``inf``
    (expert 0 permanent) five and none; with one row a permanent expert
    leaves none for the others (no result). A prerouter record made before
    the runtime weighed bundles has its first MoE layer taken; a hot arm's,
    or one whose layer is permanent, has none."""
    script = load_benchmark_script("waited_cost")
    trace = one_layer([0, 0, 1, 1, 1, 2, 0], 3)
    run = {
        "arm": "edge0-prerouter+bypass",
        "routing": trace.as_dict(),
        "eviction_replay": {"capacity": 2, "permanent_keys": [], "resident_keys": []},
        "decode_counters": {"hot_hits": 3, "hot_misses": 4},
    }
    decode = RecordedDecode.of(json.loads(json.dumps(run)))
    waited = frozenset({(0, 0)})
    rates = {c: script.replay(decode, waited, c, None) for c in (1.0, 2.0, float("inf"))}
    assert {c: (round(r["hit_rate"] * 7), round(r["waited_misses_per_token"] * 7)) for c, r in rates.items()} == {
        1.0: (3, 2),
        2.0: (4, 1),
        float("inf"): (5, 0),
    }
    assert (
        script.replay(
            RecordedDecode.of(run | {"eviction_replay": run["eviction_replay"] | {"capacity": 1}}),
            waited,
            float("inf"),
            None,
        )
        is None
    )
    assert script.waited_keys(run, decode) == {(0, 0), (0, 1), (0, 2)}
    assert script.waited_keys(run | {"arm": "edge0-hot+bypass"}, decode) == frozenset()
    permanent = RecordedDecode.of(run | {"eviction_replay": run["eviction_replay"] | {"permanent_keys": [[0, 0]]}})
    assert script.waited_keys(run, permanent) == frozenset()
    assert script.parse_costs("1,2,inf") == [1.0, 2.0, float("inf")]
    for bad in ("0,2", "a", "nan"):
        with pytest.raises(SystemExit, match="--costs: give positive numbers"):
            script.parse_costs(bad)


def test_settled_victims_replays_a_record_in_each_order_and_names_an_older_records_planned_layers(tmp_path):
    """``benchmarks/settled_victims.py`` on the two-layer trace of
    ``test_a_planned_miss_takes_a_settled_victim_and_the_replay_takes_the_same``
    (test_decode_parts.py): call by call 1 hit of 4, in the runtime's order 0,
    settled victims first 1 again at span 8 or with no span (span 1 leaves
    the policy's one lowest, no choice: 0). A prerouter record made before
    the bench kept its planned layers plans every layer but the first; a hot
    arm's or a window's none. Its table and JSON come from the script itself."""
    script = load_benchmark_script("settled_victims")
    trace = RoutingTrace((0, 1), 3, 1, (((0,), (1,)), ((0,), (2,))))
    run = {
        "arm": "edge0-prerouter+bypass",
        "round": 0,
        "routing": trace.as_dict(),
        "eviction_replay": {"capacity": 2, "permanent_keys": [], "resident_keys": []},
        "decode_counters": {"hot_hits": 1, "hot_misses": 3},
    }
    decode = RecordedDecode.of(json.loads(json.dumps(run)))
    assert script.planned_layers(run, decode) == {1}
    assert script.planned_layers(run | {"arm": "edge0-hot+bypass"}, decode) == frozenset()
    assert script.planned_layers(run | {"arm": "edge0-prerouter-window+bypass"}, decode) == frozenset()
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [run]}))
    out = tmp_path / "out.json"
    script_path = Path(__file__).parent.parent / "benchmarks" / "settled_victims.py"
    cmd = [sys.executable, str(script_path), "--bench", str(results), "--spans", "1,8,0", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert (row["call_by_call"], row["step_order"], row["min"], row["runtime_hit_rate"]) == (0.25, 0.0, 0.25, 0.25)
    assert row["settled_first"] == {"1": 0.0, "8": 0.25, "0": 0.25} and row["planned_layers"] == [1]
    assert "| 0.250 | 0.250 | 0.000 | 0.000 | 0.250 | 0.250 | 0.250 |" in done.stdout
    # A record that kept its LFU's state starts from it: told (0, 0) was used 10 times, the
    # runtime's order evicts (1, 1) for the planned (1, 2) instead, and layer 0 hits.
    state = {"policy": "lfu", "clock": 0, "last": [], "count": [[[0, 0], 10.0]], "cost": []}
    kept = run | {"eviction_replay": run["eviction_replay"] | {"policy_at_start": state}}
    results.write_text(json.dumps({"runs": [kept]}))
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["from_runtime_state"] is True and row["step_order"] == 0.25
    for bad in ("-1", "a", ""):
        with pytest.raises(SystemExit, match="--spans: give whole numbers"):
            script.parse_spans(bad)
    bad = subprocess.run(cmd[:2] + ["--bench", str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert bad.returncode != 0 and "missing.json: not an edge0 bench results file" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_gap_by_length_replays_each_prefix_from_the_runtimes_state(tmp_path):
    """``benchmarks/gap_by_length.py`` on one layer routing experts 0, 1, 2, 0
    through 2 rows: over the first 3 tokens every routing is a first use;
    over all 4, LFU told by the kept state that 0 was used 10 times keeps it
    for its return, as MIN does (1 hit of 4), where LFU from nothing evicts
    it, the oldest (0 hits, 25 points from MIN). A length past the decode is
    left out."""
    script = load_benchmark_script("gap_by_length")
    trace = RoutingTrace((0,), 3, 1, (((0,),), ((1,),), ((2,),), ((0,),)))
    state = {"policy": "lfu", "clock": 0, "last": [], "count": [[[0, 0], 10.0]], "cost": []}
    replay = {"capacity": 2, "permanent_keys": [], "resident_keys": []}
    run = {"arm": "edge0-hot+bypass", "round": 0, "routing": trace.as_dict(), "eviction_replay": replay}
    runs = [run | {"decode_counters": {"hot_hits": h, "hot_misses": 4 - h}} for h in (1, 0)]
    runs[0]["eviction_replay"] = replay | {"policy_at_start": state}
    results, out = tmp_path / "results.json", tmp_path / "out.json"
    results.write_text(json.dumps({"runs": runs}))
    script_path = Path(__file__).parent.parent / "benchmarks" / "gap_by_length.py"
    cmd = [sys.executable, str(script_path), "--bench", str(results), "--lengths", "3,4,5", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kept, cold = json.loads(out.read_text())["rows"]
    assert (kept["from_runtime_state"], cold["from_runtime_state"]) == (True, False)
    assert [(g["tokens"], g["policy"], g["min"], g["gap_points"]) for g in kept["lengths"]] == [
        (3, 0.0, 0.0, 0.0),
        (4, 0.25, 0.25, 0.0),
    ]
    assert [(g["policy"], g["gap_points"]) for g in cold["lengths"]] == [(0.0, 0.0), (0.0, 25.0)]
    assert "| yes | 0.250 | 0.000 / 0.000 (0.0) | 0.250 / 0.250 (0.0) | - |" in done.stdout
    for bad in ("0", "a", "", "96,32"):
        with pytest.raises(SystemExit, match="--lengths: give increasing whole numbers"):
            script.parse_lengths(bad)


def test_eviction_bound_replays_a_recorded_decode_from_the_runtimes_state():
    """``benchmarks/eviction_bound.py``'s recorded replay, on one layer routing
    experts 0, 1, 2, 0 through 2 rows: LFU told by the kept state that 0 was
    used 10 times keeps it for its return (1 hit of 4, as MIN and the
    decode's own popularity do), and so does ``lfu+next`` built on it; LRU,
    which the state is not, evicts 0, the oldest, and so does LFU in the
    record that kept no state."""
    script = load_benchmark_script("eviction_bound")
    trace = RoutingTrace((0,), 3, 1, (((0,),), ((1,),), ((2,),), ((0,),)))
    state = {"policy": "lfu", "clock": 0, "last": [], "count": [[[0, 0], 10.0]], "cost": []}
    replay = {"capacity": 2, "permanent_keys": [], "resident_keys": []}
    run = {"arm": "edge0-hot+bypass", "round": 0, "routing": trace.as_dict(), "eviction_replay": replay}
    run["decode_counters"] = {"hot_hits": 1, "hot_misses": 3}
    kept = RecordedDecode.of(run | {"eviction_replay": replay | {"policy_at_start": state}})
    cold = RecordedDecode.of(run)
    rows = [script.replay_recorded(Path("r.json"), run, d) for d in (kept, cold)]
    assert [r["from_runtime_state"] for r in rows] == [True, False]
    assert rows[0]["hit_rate"] == {"lru": 0.0, "lfu": 0.25, "lfu+next": 0.25, "popularity": 0.25, "min": 0.25}
    assert (rows[1]["hit_rate"]["lfu"], rows[1]["hit_rate"]["min"]) == (0.0, 0.25)


def test_eviction_bound_replays_the_next_token_known_some_layers_behind():
    """``--next-lags``: one layer routing experts 0, 1, 2, 0 through 2 rows,
    LFU told that 1 was used 10 times. Knowing the next token with no lag,
    the third call spares 0 (the fourth's) and evicts 1: 1 hit of 4, as MIN;
    one layer behind it knows nothing of the next token and LFU evicts 0."""
    script = load_benchmark_script("eviction_bound")
    trace = RoutingTrace((0,), 3, 1, (((0,),), ((1,),), ((2,),), ((0,),)))
    state = {"policy": "lfu", "clock": 0, "last": [], "count": [[[0, 1], 10.0]], "cost": []}
    replay = {"capacity": 2, "permanent_keys": [], "resident_keys": [], "policy_at_start": state}
    run = {"arm": "edge0-prerouter+bypass", "round": 0, "routing": trace.as_dict(), "eviction_replay": replay}
    run["decode_counters"] = {"hot_hits": 0, "hot_misses": 4}
    row = script.replay_recorded(Path("r.json"), run, RecordedDecode.of(run), next_lags=(0, 1))
    assert row["next_lag_hit_rate"] == {0: 0.25, 1: 0.0}
    assert (row["hit_rate"]["lfu"], row["hit_rate"]["min"]) == (0.0, 0.25)
    assert "| /r.json: edge0-prerouter+bypass round 0 | 0.0000 (25.0) | 0.2500 (0.0) | 0.0000 (25.0) | 0.2500 |" in (
        script.lag_table([row])
    )

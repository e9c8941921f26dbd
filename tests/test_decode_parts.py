"""The decode machinery without a model: paths, Prerouting and the window
arithmetic, on a :class:`fakes.FakeStore` and fake route callables and heads.

Every output is compared with :func:`expert_glu` on the reference weights of
the fake store: identity, not tolerance (the same products on the same rows).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from fakes import FakeStore
from mlx_edge0.expert_math import expert_glu
from mlx_edge0.hot import HotCache, kept_fits, permanent_fits
from mlx_edge0.paths import ExactPath, HotPath, NextLayerRouting, StagedPath, WholeLayerPath
from mlx_edge0.prefill import WholeLayerLoader
from mlx_edge0.prerouting import (
    HOST_AHEAD,
    WINDOW_WAIT_SHARE,
    Prerouting,
    SLOTS_PER_OWNER,
    fills_at_open,
    grown_window,
    refill_at,
    window_buffer,
)
from mlx_edge0.routing import softmax_topk
from mlx_edge0.staging import StagingBuffer
from mlx_edge0.store import ExpertReadError

K = 2
LAYERS = [0, 1, 2, 3, 4, 5]


def route(logits: mx.array) -> tuple[mx.array, mx.array]:
    return softmax_topk(logits, K, True)


def _x(store, batch, length, seed=0):
    return mx.random.normal((batch, length, store.geometry.hidden_size), key=mx.random.key(seed))


def _inds(store, batch, length, seed=0):
    logits = mx.random.normal((batch, length, store.geometry.num_experts), key=mx.random.key(100 + seed))
    return route(logits)[0]


def _paths(store, hot_rows=6, staged_rows=K):
    tel = store.telemetry
    exact = ExactPath(store, tel, None, None, rows=K)
    hot = HotCache(store, hot_rows, None)
    hot_path = HotPath(hot, exact, tel, None)
    staging = {layer: StagingBuffer(store, layer, staged_rows, None) for layer in LAYERS}
    staged = StagedPath(staging, hot_path, hot, tel, None)
    whole = WholeLayerPath(WholeLayerLoader(store, LAYERS, None), tel, None)
    return exact, hot_path, staged, whole


# -------------------------------------------------------------------- paths


@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 5)])
def test_every_path_computes_the_routed_experts(shape):
    store = FakeStore(LAYERS)
    store.telemetry.routing_trace = trace = []
    for path in _paths(store):
        for layer in (0, 3):
            x, inds = _x(store, *shape, seed=layer), _inds(store, *shape, seed=layer)
            path.begin(layer)
            got = path.experts(layer, x, inds)
            assert mx.array_equal(got, expert_glu(x, inds, store.weights(layer))).item(), (path.name, shape)
    assert trace and all(len(ids) <= store.geometry.num_experts for _, ids in trace)


def test_hot_path_hits_what_it_read_and_falls_back_to_exact_beyond_the_cache():
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=3)
    x = _x(store, 1, 1)
    inds = mx.array([[[1, 5]]], mx.uint32)
    hot.experts(0, x, inds)
    hot.experts(0, x, inds)
    s = store.telemetry.current
    assert (s.hot_misses, s.hot_hits) == (2, 2)
    assert 0 < s.planning_s < 1  # both calls chose rows (the first two free ones, then none), on the host
    wide = mx.array([[[0, 1]], [[2, 3]]], mx.uint32)  # 4 experts > 3 rows
    got = hot.experts(1, _x(store, 2, 1), wide)
    assert mx.array_equal(got, expert_glu(_x(store, 2, 1), wide, store.weights(1))).item()
    assert store.submitted[-1] == (1, [0, 1, 2, 3], True)  # read by the exact path


def test_hot_path_computes_resident_experts_while_it_reads_the_misses():
    """One token with some experts resident: :meth:`HotPath.from_union` computes
    those while the misses are read, and puts the outputs back in the routed
    order (identity with expert_glu, a miss routed first included); a prompt
    chunk, or a token with no hit, is computed in one call."""
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=4)
    s = store.telemetry.current
    hot.experts(0, _x(store, 1, 1), mx.array([[[1, 5]]], mx.uint32))  # both miss
    assert s.hot_overlapped == 0
    for seed, inds in enumerate([[[[3, 1]]], [[[5, 6]]]]):  # a miss first, then a hit first
        x, inds = _x(store, 1, 1, seed), mx.array(inds, mx.uint32)
        assert mx.array_equal(hot.experts(0, x, inds), expert_glu(x, inds, store.weights(0))).item()
        assert s.hot_overlapped == seed + 1
    assert (s.hot_hits, s.hot_misses) == (2, 4)
    chunk = mx.array([[[1, 2], [4, 3]]], mx.uint32)  # 1 and 3 resident, 2 and 4 not
    x = _x(store, 1, 2)
    assert mx.array_equal(hot.experts(0, x, chunk), expert_glu(x, chunk, store.weights(0))).item()
    assert s.hot_overlapped == 2


def test_a_failed_miss_read_leaves_the_hits_resident_and_the_miss_out():
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=4)
    x = _x(store, 1, 1)
    hot.experts(1, x, mx.array([[[2, 7]]], mx.uint32))
    store.fail = ExpertReadError("layer_001.safetensors: read failed")
    with pytest.raises(ExpertReadError):
        hot.experts(1, x, mx.array([[[7, 4]]], mx.uint32))
    assert set(hot.hot.row_of) == {(1, 2), (1, 7)} and len(hot.hot.free) == 2
    store.fail = None
    inds = mx.array([[[7, 4]]], mx.uint32)
    assert mx.array_equal(hot.experts(1, x, inds), expert_glu(x, inds, store.weights(1))).item()
    assert store.submitted[-1] == (1, [4], True)


def test_an_error_while_the_hits_are_built_still_settles_the_misses(monkeypatch):
    """The misses' reads are in flight while the hits' experts are built: if
    building fails, the reads are still waited for and their rows kept, not
    stranded between free and resident."""
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=4)
    x = _x(store, 1, 1)
    hot.experts(1, x, mx.array([[[2, 7]]], mx.uint32))

    def broken(*args, **kwargs):
        raise RuntimeError("graph building failed")

    monkeypatch.setattr(hot.hot.buffers, "compute", broken)
    with pytest.raises(RuntimeError, match="graph building"):
        hot.experts(1, x, mx.array([[[7, 4]]], mx.uint32))
    monkeypatch.undo()
    assert set(hot.hot.row_of) == {(1, 2), (1, 7), (1, 4)} and len(hot.hot.free) == 1
    inds = mx.array([[[4, 7]]], mx.uint32)
    assert mx.array_equal(hot.experts(1, x, inds), expert_glu(x, inds, store.weights(1))).item()


def _guessing(store, guesses: dict[int, list[int]]) -> NextLayerRouting:
    """A lookahead whose guess for layer ``l`` is ``guesses[l]`` (the gate
    ranks those experts first, whatever the input)."""

    def gate(layer):
        logits = np.zeros(store.geometry.num_experts, np.float32)
        logits[guesses.get(layer, [])] = [10.0 - i for i in range(len(guesses.get(layer, [])))]
        return lambda x: mx.broadcast_to(mx.array(logits), (*x.shape[:-1], len(logits)))

    return NextLayerRouting(LAYERS, {layer: gate(layer) for layer in LAYERS}, {layer: route for layer in LAYERS})


def test_lookahead_queues_the_next_layers_guess_behind_a_chunks_own_misses():
    """With a lookahead a prompt chunk on the hot path queues reads of the
    next layer's guessed misses, surest first, behind its own misses; the
    next layer finds them resident, counted as ``lookahead_hits``, and
    computes exactly its routed experts. A decode step (one token) never
    guesses."""
    store = FakeStore(LAYERS)
    exact, hot, _, _ = _paths(store, hot_rows=6)
    hot.lookahead = _guessing(store, {1: [4, 3], 2: [5, 6], 3: [0, 1], 4: [2, 3]})
    s = store.telemetry.current
    x = _x(store, 1, 2)
    for layer, inds in ((0, [[[1, 5], [5, 1]]]), (1, [[[6, 3], [3, 6]]])):
        inds = mx.array(inds, mx.uint32)
        assert mx.array_equal(hot.experts(layer, x, inds), expert_glu(x, inds, store.weights(layer))).item()
    assert store.submitted == [(0, [1, 5], True), (1, [4, 3], "queue"), (1, [6], True), (2, [5, 6], "queue")]
    assert (s.hot_hits, s.hot_misses, s.lookahead_hits, s.lookahead_read) == (0, 3, 1, 4)
    assert s.expert_loads == 5  # the layer-2 guess lands by the next call
    inds = mx.array([[[2, 6], [6, 5]]], mx.uint32)
    assert mx.array_equal(hot.experts(2, x, inds), expert_glu(x, inds, store.weights(2))).item()
    assert (s.lookahead_hits, s.expert_loads) == (3, 8) and set(hot.hot.ahead) == {(3, 0), (3, 1)}
    assert store.submitted[-2:] == [(2, [2], True), (3, [0, 1], "queue")]
    one = _x(store, 1, 1)
    inds = mx.array([[[0, 7]]], mx.uint32)
    assert mx.array_equal(hot.experts(3, one, inds), expert_glu(one, inds, store.weights(3))).item()
    assert store.submitted[-1] == (3, [7], True) and s.lookahead_read == 6  # no guess for layer 4


def test_rows_being_read_ahead_are_never_a_victim():
    """Until :meth:`HotCache.settle_prefetch` finds a read ahead landed, its row
    is out of every victim choice and copy; a guess takes only the rows not
    routed now, surest first."""
    store = FakeStore(LAYERS)
    store.hold_queue = True
    hot = HotCache(store, 4, None)
    hot.fetch(0, [1, 2])
    assert hot.start_prefetch(1, [3, 4], keep={(0, 1), (0, 2)}) == 2
    hot.fetch(2, [5, 6])  # two victims: only layer 0's rows may go
    assert set(hot.row_of) == {(1, 3), (1, 4), (2, 5), (2, 6)}
    assert hot.row(1, 3) is None and hot.row(2, 5) is not None  # nothing copies from a row still read
    store.run_queue(landed=2)
    hot.settle_prefetch(1, [3])
    assert hot.row(1, 3) is not None and not hot.ahead
    assert hot.start_prefetch(3, [1, 2, 7], keep=set(hot.row_of) - {(1, 3)}) == 1  # 3 misses, 1 spare row
    assert store.submitted[-1] == (3, [1], "queue") and hot.row(1, 3) is None


def _row_holds(store, hot, layer, expert) -> bool:
    """Whether ``expert`` of ``layer``'s row computes as the expert does."""
    x, row = _x(store, 1, 1), hot.row_of[(layer, expert)]
    got = hot.buffers.compute(x, mx.array([[[row]]], mx.uint32), None)
    return mx.array_equal(got, expert_glu(x, mx.array([[[expert]]], mx.uint32), store.weights(layer))).item()


def test_reads_ahead_not_started_are_dropped_and_give_their_rows_back():
    """When the layer routes, a guess still queued is dropped and the bundle
    it displaced is resident again in its untouched row; one being read that
    the layer does not route keeps its row out of use until it lands; one it
    routes is waited for."""
    store = FakeStore(LAYERS)
    store.hold_queue = True
    hot = HotCache(store, 4, None)
    hot.fetch(0, [1, 2, 3])
    row_of_3 = hot.row_of[(0, 3)]
    assert hot.start_prefetch(1, [4, 5, 6], keep={(0, 1)}) == 3  # a free row, then (0, 2)'s and (0, 3)'s
    store.run_queue(landed=1, running=1)  # 4 landed, 5 being read, 6 still queued
    hot.settle_prefetch(1, [4, 7])
    assert set(hot.ahead) == {(1, 5)} and hot.row(1, 5) is None
    assert hot.row(0, 3) == row_of_3 and _row_holds(store, hot, 0, 3)  # given back with its bytes
    assert (1, 6) not in hot.row_of and (0, 2) not in hot.row_of
    hot.fetch(1, [4, 7])  # the victim for 7 is not the row still being read
    s = store.telemetry.current
    assert (s.lookahead_hits, s.lookahead_read, hot.row(1, 5)) == (1, 3, None) and (1, 7) in hot.row_of
    store.run_queue(landed=1)
    hot.settle_prefetch(2, [])
    assert not hot.ahead and _row_holds(store, hot, 1, 5) and _row_holds(store, hot, 1, 4)
    assert hot.start_prefetch(2, [0]) == 1
    store.run_queue(landed=0, running=1)
    hot.settle_prefetch(2, [0])  # routed while being read: waited for
    assert not hot.ahead and _row_holds(store, hot, 2, 0) and s.expert_loads == 3 + 1 + 1 + 1 + 1


def test_a_staged_decode_settles_what_a_chunk_read_ahead_for_its_layer():
    """Staged decode after a short prompt on the hot path (the prerouter off):
    the staged call of the guessed layer drops the guesses not started, so no
    row stays out of use, and finds a landed one resident: only the other
    expert is read."""
    store = FakeStore(LAYERS)
    _, hot, staged, _ = _paths(store, hot_rows=6)
    hot.lookahead = _guessing(store, {1: [3, 4]})
    x = _x(store, 1, 2)
    store.hold_queue = True
    hot.experts(0, x, mx.array([[[1, 5], [5, 1]]], mx.uint32))
    store.run_queue(landed=1)  # 3 landed, 4 still queued
    one, inds = _x(store, 1, 1), mx.array([[[3, 6]]], mx.uint32)
    assert mx.array_equal(staged.experts(1, one, inds), expert_glu(one, inds, store.weights(1))).item()
    assert not hot.hot.ahead and (1, 4) not in hot.hot.row_of
    s = store.telemetry.current
    assert store.submitted[-2:] == [(1, [6], True), (1, [], True)]  # through the hot cache: copies only
    assert (s.lookahead_hits, s.hot_misses, s.staged_copied) == (1, 3, 2)


def test_a_failed_read_ahead_is_raised_by_the_next_call_and_leaves_nothing_resident():
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=6)
    hot.lookahead = _guessing(store, {1: [3, 4]})
    x = _x(store, 1, 2)
    store.fail = ExpertReadError("layer_001.safetensors: read failed")
    with pytest.raises(ExpertReadError):  # its own misses, then the guess for layer 1, fail
        hot.experts(0, x, mx.array([[[1, 5], [5, 1]]], mx.uint32))
    store.fail = None
    with pytest.raises(ExpertReadError):
        hot.experts(1, x, mx.array([[[7, 2], [2, 7]]], mx.uint32))
    assert not {(1, 3), (1, 4)} & set(hot.hot.row_of) and len(hot.hot.free) == 6
    inds = mx.array([[[3, 2], [2, 3]]], mx.uint32)
    assert mx.array_equal(hot.experts(1, x, inds), expert_glu(x, inds, store.weights(1))).item()
    assert store.submitted[-2] == (1, [2, 3], True)
    assert store.telemetry.current.read_errors == 3  # the misses' batch, and each bundle read ahead


def test_permanent_experts_are_read_once_and_never_evicted():
    """What :meth:`HotCache.add_permanent` holds (a layer no owner predicts)
    is read at once, then hit every time, while other layers' misses evict
    only each other."""
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=6)
    hot.hot.add_permanent(0, [1, 3, 5])
    assert store.submitted == [(0, [1, 3, 5], True)]
    for seed, layer in enumerate([1, 2, 3, 1, 4]):  # more experts than the 3 other rows
        inds = mx.array([[[seed % 4, 4 + seed % 4]]], mx.uint32)
        hot.experts(layer, _x(store, 1, 1, seed), inds)
    assert {(0, 1), (0, 3), (0, 5)} <= set(hot.hot.row_of)
    store.telemetry.begin_step(1)
    x, inds = _x(store, 1, 1), mx.array([[[5, 1]]], mx.uint32)
    got = hot.experts(0, x, inds)
    assert mx.array_equal(got, expert_glu(x, inds, store.weights(0))).item()
    s = store.telemetry.current
    assert (s.hot_hits, s.hot_misses) == (2, 0)
    with pytest.raises(ValueError, match="too few"):  # at most half the rows
        hot.hot.add_permanent(2, [0])


def test_held_experts_stay_until_the_cache_first_evicts_then_the_policy_ranks_them():
    """What :meth:`HotCache.add_held` reads at load is hit and never a victim
    while misses find free rows; the first miss that finds none hands them to
    the policy (counted once), which then evicts the least used of them first."""
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=6)
    hot.hot.add_held(0, [1, 3, 5])
    assert store.submitted == [(0, [1, 3, 5], True)] and hot.hot.held == {(0, e) for e in (1, 3, 5)}
    store.telemetry.begin_step(1)
    x, inds = _x(store, 1, 1), mx.array([[[5, 1]]], mx.uint32)
    assert mx.array_equal(hot.experts(0, x, inds), expert_glu(x, inds, store.weights(0))).item()
    hot.experts(1, _x(store, 1, 1, 1), mx.array([[[0, 2]]], mx.uint32))  # two of the three free rows
    s = store.telemetry.current
    assert (s.hot_hits, s.hot_misses, s.held_released, len(hot.hot.free)) == (2, 2, 0, 1)
    assert len(hot.hot.held) == 3
    hot.experts(2, _x(store, 1, 1, 2), mx.array([[[0, 2]]], mx.uint32))  # one free row: the cache evicts
    assert hot.hot.held == set() and store.telemetry.current.held_released == 3
    # LFU: (0, 3) was used once (its load), longest ago: the victim
    assert set(hot.hot.row_of) == {(0, 1), (0, 5), (1, 0), (1, 2), (2, 0), (2, 2)}
    with pytest.raises(ValueError, match="too few"):  # permanent and held: at most half the rows
        hot.hot.add_permanent(3, range(4))


def test_a_prompt_keeps_its_most_routed_experts_without_reading_them():
    """:meth:`HotCache.copy_prompt_experts`: the whole-layer path copies a prompt's
    experts into the cache best first (LFU: most routed, ties by recency), and
    replaces a resident only where the policy ranks the newcomer higher; the
    decode then computes from the copies without a read."""
    store = FakeStore(LAYERS)
    _, hot, _, _ = _paths(store, hot_rows=3)
    whole = WholeLayerPath(WholeLayerLoader(store, LAYERS, None), store.telemetry, None, hot.hot)
    prompt = mx.array([[[3, 1], [3, 5], [3, 1], [6, 3], [1, 7]]], mx.uint32)  # 3: 4 uses, 1: 3, 5/6/7: 1
    x = _x(store, 1, 5)
    whole.begin(0)
    assert mx.array_equal(whole.experts(0, x, prompt), expert_glu(x, prompt, store.weights(0))).item()
    assert set(hot.hot.row_of) == {(0, 3), (0, 1), (0, 7)}  # 7: the highest id of the single uses
    whole.begin(1)
    whole.experts(1, _x(store, 1, 1), mx.array([[[0, 2]]], mx.uint32))
    # one use each, newer than (0, 7)'s: (1, 2), the newest, takes its row; (0, 1) ranks above (1, 0)
    assert set(hot.hot.row_of) == {(0, 3), (0, 1), (1, 2)}
    assert store.telemetry.current.prompt_copied == 4
    reads = list(store.submitted)
    assert all(len(ids) == store.geometry.num_experts for _, ids, _ in reads)  # whole layers only
    store.telemetry.begin_step(1)
    x, inds = _x(store, 1, 1, seed=3), mx.array([[[1, 3]]], mx.uint32)
    assert mx.array_equal(hot.experts(0, x, inds), expert_glu(x, inds, store.weights(0))).item()
    s = store.telemetry.current
    assert (s.hot_hits, s.hot_misses) == (2, 0) and store.submitted == reads


def test_permanent_only_in_a_cache_of_every_expert_else_held_up_to_half():
    assert permanent_fits(768, 768)  # the cache holds every expert: nothing is displaced
    assert not permanent_fits(767, 768) and not permanent_fits(512, 4096)  # any smaller share: held
    assert kept_fits(256, 512) and not kept_fits(257, 512)  # held: up to half


def test_staged_path_keeps_slots_and_counts_fallbacks():
    store = FakeStore(LAYERS)
    _, _, staged, _ = _paths(store, hot_rows=0 + 6)
    x = _x(store, 1, 1)
    staged.experts(2, x, mx.array([[[1, 5]]], mx.uint32))
    staged.experts(2, x, mx.array([[[5, 7]]], mx.uint32))
    s = store.telemetry.current
    assert s.staged_kept == 1 and s.staged_fallbacks == 0
    batch = mx.array([[[0, 1]], [[2, 3]]], mx.uint32)  # a union of 4 > K slots
    got = staged.experts(2, _x(store, 2, 1), batch)
    assert s.staged_fallbacks == 1
    assert mx.array_equal(got, expert_glu(_x(store, 2, 1), batch, store.weights(2))).item()


def test_a_failed_fill_raises_and_forgets_the_buffer():
    store = FakeStore(LAYERS)
    _, _, staged, _ = _paths(store, hot_rows=1)  # hot too small for K: reads go to the slots
    store.fail = ExpertReadError("layer_002.safetensors: read failed")
    with pytest.raises(ExpertReadError):
        staged.experts(2, _x(store, 1, 1), mx.array([[[1, 5]]], mx.uint32))
    assert (staged.buffers[2].contents == -1).all()
    store.fail = None
    inds = mx.array([[[1, 5]]], mx.uint32)
    got = staged.experts(2, _x(store, 1, 1), inds)
    assert mx.array_equal(got, expert_glu(_x(store, 1, 1), inds, store.weights(2))).item()


# -------------------------------------------------------- window arithmetic


@pytest.mark.parametrize("window", [3, 4, 5])
@pytest.mark.parametrize("consumers", [1, 2, 3, 5, 8, 13])
def test_window_fills_each_consumer_once_ahead_of_it_and_after_its_buffer_is_free(window, consumers):
    started = {rank: -1 for rank in fills_at_open(consumers, window)}  # rank -> host rank it started at
    for host in range(consumers):
        assert host in started, "a consumer is reached before its fill started"
        nxt = refill_at(host, window)
        if nxt is not None and nxt < consumers:
            assert nxt not in started
            started[nxt] = host
    assert sorted(started) == list(range(consumers))
    for rank, host in started.items():
        if rank >= window:  # the buffer's last user was reached HOST_AHEAD consumers before
            assert window_buffer(rank, window) == window_buffer(rank - window, window)
            assert host - (rank - window) == HOST_AHEAD
    assert list(fills_at_open(consumers, 0)) == list(range(consumers)) and refill_at(5, 0) is None


def test_an_auto_window_doubles_while_reads_stall_compute_up_to_a_buffer_per_layer():
    assert WINDOW_WAIT_SHARE == 0.05
    assert grown_window(3, wait_s=0.06, step_s=1.0, limit=39) == 6  # waited 6% of the step
    assert grown_window(3, wait_s=0.05, step_s=1.0, limit=39) == 3  # at the share: deep enough
    assert grown_window(4, wait_s=0.0, step_s=1.0, limit=39) == 4  # never shrinks
    assert grown_window(4, wait_s=0.9, step_s=1.0, limit=5) == 5
    assert grown_window(5, wait_s=0.9, step_s=1.0, limit=5) == 5  # one buffer per prerouted layer at most
    depths = [3]
    while depths[-1] < 39:
        depths.append(grown_window(depths[-1], wait_s=0.2, step_s=1.0, limit=39))
    assert depths == [3, 6, 12, 24, 39]  # a 40-layer model's limit in 4 steps
    assert grown_window(3, wait_s=0.2, step_s=0.0, limit=5) == 3  # no step time: nothing to compare with


# --------------------------------------------------------------- prerouting


class FixedHead:
    """A head predicting fixed logits per position (the fake owner head)."""

    def __init__(self, logits: mx.array):
        self.logits = logits  # [E]

    def __call__(self, h, onehot_now, onehot_prev):
        return mx.broadcast_to(self.logits, (*h.shape[:2], self.logits.shape[0]))


def _prerouting(store, window=0, hot=None, cache_fills=False):
    """Fills into staging buffers (one per consumer, or a window), or with
    ``cache_fills`` the hot cache's (the hot path reads what it cannot pin)."""
    consumer_of = {o: o + 1 for o in LAYERS[:-1]}
    rng = np.random.default_rng(0)
    heads = {o: FixedHead(mx.array(rng.standard_normal(store.geometry.num_experts).astype(np.float32)))
             for o in consumer_of}  # fmt: skip
    staged = not (window or cache_fills)
    buffers = {c: StagingBuffer(store, c, K, None) for c in consumer_of.values()} if staged else {}
    windows = [StagingBuffer(store, -1, K, None) for _ in range(window)]
    fallback = HotPath(hot, ExactPath(store, store.telemetry, None, None, K), store.telemetry, None).from_union
    pre = Prerouting(
        heads, consumer_of, {layer: route for layer in LAYERS}, buffers=buffers, window=windows, hot=hot,
        telemetry=store.telemetry, compute_dtype=None, num_experts=store.geometry.num_experts,
        fallback=fallback if cache_fills else None,
    )  # fmt: skip
    return pre, heads


def _decode_state(pre, heads, valid):
    """A state as a prompt leaves it: every owner's prediction, ``valid`` per row."""
    E = next(iter(heads.values())).logits.shape[0]
    state = pre.make_cache()
    for i, owner in enumerate(pre.owners):
        B, s = len(valid), SLOTS_PER_OWNER * i
        logits = mx.broadcast_to(heads[owner].logits, (B, E))
        inds, scores = pre.routes[pre.consumer_of[owner]](logits[:, None, :])
        state[s], state[s + 1], state[s + 2], state[s + 3], state[s + 4] = (
            mx.zeros((B, E)),
            logits,
            mx.array(valid),
            inds,
            scores,
        )
    return state


@pytest.mark.parametrize("window", [0, 3])
def test_prerouted_step_computes_the_predicted_routing_from_its_fills(window):
    store = FakeStore(LAYERS)
    pre, heads = _prerouting(store, window)
    pre.bind(_decode_state(pre, heads, [True, True]))
    x = _x(store, 2, 1)
    pre.begin_forward(1, x)
    assert pre.order == LAYERS[1:]
    assert sum(p.fill is not None for p in pre.planned.values()) == (window or 5)
    assert pre.take(LAYERS[0]) is None
    for consumer in LAYERS[1:]:
        plan = pre.take(consumer)
        want_inds, want_scores = route(mx.broadcast_to(heads[consumer - 1].logits, (2, 1, 8)))
        assert mx.array_equal(plan.inds, want_inds).item() and mx.array_equal(plan.scores, want_scores).item()
        got = pre.experts(consumer, x, plan.inds, plan)
        assert mx.array_equal(got, expert_glu(x, plan.inds, store.weights(consumer))).item()
        pre.observe(consumer, x, plan.inds)
    assert store.telemetry.current.prerouted == 5 and not pre.planned
    if window:
        assert [b.layer for b in pre.window] == [4, 5, 3]


def test_an_owner_routes_its_prediction_in_its_own_layer_and_the_next_step_plans_from_it():
    """The next step opens without routing anything: it waits for each routed
    prediction, queued with the step before's layers, and starts that fill
    (routing at the open would queue behind the step before's LM head)."""
    store = FakeStore(LAYERS)
    pre, heads = _prerouting(store)
    state = _decode_state(pre, heads, [True])
    pre.bind(state)
    x = _x(store, 1, 1)
    pre.begin_forward(1, x)
    pre.take(LAYERS[0])
    for consumer in LAYERS[1:]:
        plan = pre.take(consumer)
        y = pre.experts(consumer, x, plan.inds, plan)
        # the owner's routed prediction and the last buffer's reader went with this layer's
        # queue; this buffer's reader goes with the next
        assert len(pre.unqueued) == 1 and pre.unqueued[0] is y
        pre.observe(consumer, x, plan.inds)
        if consumer != LAYERS[-1]:
            assert len(pre.unqueued) == 4  # + the routed prediction: indices, scores, valid
    owner, consumer = LAYERS[1], LAYERS[2]
    s = SLOTS_PER_OWNER * pre.owners.index(owner)
    assert mx.array_equal(state[s + 3], route(state[s + 1][:, None, :])[0]).item()
    state[s + 3] = mx.array([[[6, 7]]], mx.uint32)  # what the owner's layer routed is what the next step plans
    pre.bind(state)
    pre.begin_forward(1, x)
    assert pre.planned[consumer].ids.tolist() == [6, 7]


@pytest.mark.parametrize("window", [0, 3])
def test_the_hot_cache_keeps_what_prerouted_fills_read(window):
    """A prerouted fill reads its misses into staging slots; the cache keeps
    copies, so the next step's fills copy them instead of reading again."""
    store = FakeStore(LAYERS)
    hot = HotCache(store, 5 * K, None)
    pre, heads = _prerouting(store, window, hot)
    x = _x(store, 1, 1)

    def step() -> tuple[int, int]:
        store.telemetry.begin_step(1)
        pre.bind(_decode_state(pre, heads, [True]))  # the same prediction every step
        pre.begin_forward(1, x)
        for consumer in LAYERS[1:]:
            plan = pre.take(consumer)
            got = pre.experts(consumer, x, plan.inds, plan)
            assert mx.array_equal(got, expert_glu(x, plan.inds, store.weights(consumer))).item()
        s = store.telemetry.current
        return s.staged_read, s.staged_copied + s.staged_kept

    read, _ = step()
    assert read == 5 * K  # every consumer's K experts from disk
    assert len(hot.row_of) == 5 * K and {layer for layer, _ in hot.row_of} == set(LAYERS[1:])
    read, from_memory = step()
    assert read == 0 and from_memory == 5 * K


def _cache_step(store, pre, heads, x, batch=1) -> list[mx.array]:
    """One prerouted decode step; each consumer's output against the reference."""
    store.telemetry.begin_step(batch)
    pre.bind(_decode_state(pre, heads, [True] * batch))  # the same prediction every step
    pre.hot.open_forward()
    pre.begin_forward(1, x)
    outputs = []
    for consumer in LAYERS[1:]:
        plan = pre.take(consumer)
        got = pre.experts(consumer, x, plan.inds, plan)
        assert mx.array_equal(got, expert_glu(x, plan.inds, store.weights(consumer))).item()
        outputs.append(got)
    return outputs


def test_fills_of_the_cache_compute_from_its_rows_pinned_until_their_layer_computes():
    """Without staging buffers, a step's plans are placed in the hot cache when
    it opens (misses read into its rows) and pinned; each layer computes from
    the rows, and the next step finds them all resident: nothing is read,
    nothing copied."""
    store = FakeStore(LAYERS)
    hot = HotCache(store, 4 * 5 * K, None)
    pre, heads = _prerouting(store, hot=hot, cache_fills=True)
    x = _x(store, 1, 1)
    store.telemetry.begin_step(1)
    pre.bind(_decode_state(pre, heads, [True]))
    pre.begin_forward(1, x)
    planned = {(c, int(e)) for c, p in pre.planned.items() for e in p.ids}
    assert all(p.cached is not None for p in pre.planned.values()) and len(planned) == 5 * K
    assert hot.pinned == planned and [s[1] for s in store.submitted] == [list(p.ids) for p in pre.planned.values()]
    pre.bind(None)
    _cache_step(store, pre, heads, x)
    s = store.telemetry.current
    assert (s.hot_misses, s.hot_hits, s.prerouted, s.staged_read + s.staged_copied) == (5 * K, 0, 5, 0)
    assert hot.pinned == set() and set(hot.row_of) == planned
    store.submitted.clear()
    _cache_step(store, pre, heads, x)
    s = store.telemetry.current
    assert (s.hot_misses, s.hot_hits, s.prerouted) == (0, 5 * K, 5) and store.submitted == [
        (c, [], False) for c in LAYERS[1:]
    ]


def test_a_planned_miss_takes_a_settled_victim_and_the_replay_takes_the_same():
    """Two rows; token 0 routes expert 0 of layer 0, then expert 1 of layer
    1; token 1 routes 0 again, and 2 of layer 1, planned when the step opens
    (before layer 0 routes). LFU ranks (0, 0) lowest (both used once, it
    earlier), but layer 1 has routed in this forward, not to 1: (1, 1) is
    settled and goes instead, so layer 0's call hits. The replay in the
    runtime's order makes the same choice; without the preference it reads
    (0, 0) twice."""
    from mlx_edge0.bench.eviction import simulate
    from mlx_edge0.bench.locality import RoutingTrace

    store = FakeStore(LAYERS)
    hot = HotCache(store, 2, None)
    hot.open_forward()
    hot.fetch(0, [0])
    hot.fetch(1, [1])
    hot.open_forward()
    assert hot.routed == set()
    planned = hot.start_planned(1, [2])
    assert hot.routed == {1} and set(hot.row_of) == {(0, 0)}  # (1, 1) went, though ranked above (0, 0)
    hot.fetch(0, [0])
    hot.finish_planned(planned)
    assert store.telemetry.current.hot_hits == 1 and set(hot.row_of) == {(0, 0), (1, 2)}
    trace = RoutingTrace((0, 1), 3, 1, (((0,), (1,)), ((0,), (2,))))
    assert simulate(trace, 2, "lfu", planned={1}).hits == 1
    assert simulate(trace, 2, "lfu", planned={1}, prefer_settled=False).hits == 0
    assert simulate(trace, 2, "lfu").hits == simulate(trace, 2, "min", planned={1}).hits == 1  # call by call


def test_plans_the_cache_cannot_pin_read_on_demand_around_the_pinned_rows():
    """A cache of 8 rows pins at most 4 (half): the first two consumers' plans;
    the other three read on demand, with their planned indices, into the
    other rows, never into a pinned one: computed first here, they leave the
    pinned plans' rows as their reads wrote them."""
    store = FakeStore(LAYERS)
    hot = HotCache(store, 8, None)
    pre, heads = _prerouting(store, hot=hot, cache_fills=True)
    x = _x(store, 1, 1)
    for _ in range(2):
        store.telemetry.begin_step(1)
        pre.bind(_decode_state(pre, heads, [True]))
        hot.open_forward()
        pre.begin_forward(1, x)
        plans = {c: pre.take(c) for c in reversed(LAYERS[1:])}
        assert [plans[c].cached is not None for c in LAYERS[1:]] == [True, True, False, False, False]
        assert all(plans[c].on_demand for c in LAYERS[3:]) and len(hot.pinned) == 2 * K
        for consumer, plan in plans.items():
            got = pre.experts(consumer, x, plan.inds, plan)
            assert mx.array_equal(got, expert_glu(x, plan.inds, store.weights(consumer))).item()
        assert store.telemetry.current.prerouted == 5 and hot.pinned == set()


def test_a_failed_fill_of_the_cache_raises_frees_its_rows_and_unpins_them():
    store = FakeStore(LAYERS)
    hot = HotCache(store, 40, None)
    pre, heads = _prerouting(store, hot=hot, cache_fills=True)
    x = _x(store, 1, 1)
    store.fail = ExpertReadError("layer_002.safetensors: read failed")
    store.telemetry.begin_step(1)
    pre.bind(_decode_state(pre, heads, [True]))
    pre.begin_forward(1, x)
    store.fail = None
    plan = pre.take(LAYERS[1])
    with pytest.raises(ExpertReadError):
        pre.experts(LAYERS[1], x, plan.inds, plan)
    assert not {k for k in hot.pinned if k[0] == LAYERS[1]} and not hot.row_of
    pre.bind(None)  # the forward raised: the other plans are dropped too
    assert hot.pinned == set() and len(hot.free) == 40 and not hot.row_of
    _cache_step(store, pre, heads, x)  # read again, whole
    assert len(hot.row_of) == 5 * K


def test_a_write_waits_only_for_the_computations_that_read_its_rows(monkeypatch):
    """A computation that names its rows is evaluated before a write into one
    of them, not before a write into another; one that names none, before
    any write. Computations two forwards old are evaluated when a forward opens."""
    from mlx_edge0.slots import SlotBuffers

    store = FakeStore(LAYERS)
    buffers = SlotBuffers(store.geometry, 4)
    store.submit(0, [1, 2, 3, 4], range(4), buffers)
    evaluated = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.append(len(a[0]) if len(a) == 1 else len(a)), real_eval(*a)))
    x = _x(store, 1, 1)
    y = buffers.compute(x, mx.array([[[0, 1]]], mx.uint32), None, np.array([0, 1]))
    store.submit(0, [5], [2], buffers)
    assert evaluated == []
    store.submit(0, [6], [1], buffers)  # row 1: y first
    assert (
        evaluated == [1] and mx.array_equal(y, expert_glu(x, mx.array([[[1, 2]]], mx.uint32), store.weights(0))).item()
    )
    buffers.compute(x, mx.array([[[2]]], mx.uint32), None)  # names no rows
    store.submit(0, [7], [3], buffers)
    assert evaluated == [1, 1]
    buffers.compute(x, mx.array([[[3]]], mx.uint32), None, np.array([3]))
    buffers.open_forward()  # the next forward: the step before may still compute
    assert evaluated == [1, 1]
    buffers.open_forward()  # the one after: evaluated in a decode loop already
    assert evaluated == [1, 1, 1]


def test_a_window_grown_between_steps_computes_the_predicted_routing_from_its_fills():
    """Each step's ranks map to the window as long as it is then; a buffer
    whose rank now maps it to another layer forgets what it held."""
    store = FakeStore(LAYERS)
    pre, heads = _prerouting(store, window=3)
    x = _x(store, 1, 1)
    layers = []
    for depth in (3, 4, 5):
        if depth > len(pre.window):
            pre.add_window_buffer(StagingBuffer(store, -1, K, None))
        pre.bind(_decode_state(pre, heads, [True]))
        pre.begin_forward(1, x)
        assert sum(p.fill is not None for p in pre.planned.values()) == depth
        with pytest.raises(AssertionError, match="between steps"):
            pre.add_window_buffer(StagingBuffer(store, -1, K, None))
        for consumer in LAYERS[1:]:
            plan = pre.take(consumer)
            got = pre.experts(consumer, x, plan.inds, plan)
            assert mx.array_equal(got, expert_glu(x, plan.inds, store.weights(consumer))).item()
        pre.bind(None)
        layers.append([b.layer for b in pre.window])
    assert layers == [[4, 5, 3], [5, 2, 3, 4], [1, 2, 3, 4, 5]]


def test_unconsumed_plans_are_dropped_and_their_buffers_forgotten():
    store = FakeStore(LAYERS)
    pre, heads = _prerouting(store)
    pre.bind(_decode_state(pre, heads, [True]))
    pre.begin_forward(1, _x(store, 1, 1))
    assert (pre.buffers[3].contents >= 0).all()
    pre.bind(None)  # the forward raised before layer 3
    assert not pre.planned and (pre.buffers[3].contents == -1).all()


def test_a_mixed_batch_routes_each_row_by_its_own_source():
    store = FakeStore(LAYERS)
    pre, heads = _prerouting(store)
    pre.bind(_decode_state(pre, heads, [True, False]))
    pre.begin_forward(1, _x(store, 2, 1))
    assert pre.take(2) is None  # no plan: on demand
    gate = route(mx.random.normal((2, 1, 8), key=mx.random.key(7)))
    inds, scores = pre.mix(2, *gate)
    predicted = route(mx.broadcast_to(heads[1].logits, (2, 1, 8)))
    assert mx.array_equal(inds[0], predicted[0][0]).item() and mx.array_equal(inds[1], gate[0][1]).item()
    assert mx.array_equal(scores[1], gate[1][1]).item()


def test_a_prompt_chunk_routes_every_position_after_the_first_with_the_prediction():
    store = FakeStore(LAYERS)
    pre, heads = _prerouting(store)
    state = ArraysCache(3 * len(pre.owners))  # a fresh cache: no prediction yet
    pre.bind(state)
    x = _x(store, 1, 4)
    pre.begin_forward(4, x)
    assert not pre.planned
    pre.observe(0, x, _inds(store, 1, 4))
    gate = route(mx.random.normal((1, 4, 8), key=mx.random.key(9)))
    inds, _ = pre.mix(1, *gate)
    predicted = route(mx.broadcast_to(heads[0].logits, (1, 4, 8)))[0]
    assert mx.array_equal(inds[:, 0], gate[0][:, 0]).item()  # the first token: the gate
    assert mx.array_equal(inds[:, 1:], predicted[:, 1:]).item()
    assert state[2].tolist() == [True] and mx.array_equal(state[1][0], heads[0].logits).item()

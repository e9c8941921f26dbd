"""Fast paths (hot, staged, whole-layer) against the exact path and stock mlx-lm.

Identity, not tolerance: every path runs the same gather_qmm products on the
same int4 rows, so for the same routing the outputs are bit-identical (the
staged path sorts rows by slot instead of expert id, which reorders rows but
not the arithmetic inside each row).
"""

from __future__ import annotations

import os
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.expert_math import ExpertWeights, expert_glu
from mlx_edge0.slots import SlotBuffers
from mlx_edge0.cache_policy import LFU_AGING, FrequencyPolicy, LRUPolicy, plan_fill
from mlx_edge0.staging import plan_staging
from mlx_edge0.store import ExpertReadError
from mlx_edge0.streaming import StreamingMoE

from conftest import FAMILIES, load_stock
from test_equivalence import greedy

TINY_BUNDLE_GIB = 13824 / 2**30  # one tiny-model expert bundle (bf16 scales)
PATHS = {
    "exact": dict(cache_gib=0, staged=False, prefill="exact"),
    "hot": dict(cache_gib=40 * TINY_BUNDLE_GIB, staged=False, prefill="exact"),
    "staged": dict(cache_gib=0, staged=True, prefill="exact"),
    "staged+hot": dict(cache_gib=20 * TINY_BUNDLE_GIB, staged=True, prefill="exact"),
    "whole-layer": dict(cache_gib=0, staged=False, prefill="whole-layer"),
    "whole-layer+hot": dict(cache_gib=40 * TINY_BUNDLE_GIB, staged=False, prefill="whole-layer"),
}


def _blocks(model):
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, StreamingMoE)]


# ------------------------------------------------------------------ pure plans


def test_plan_staging_keeps_and_rewrites_minimum():
    plan = plan_staging([3, 7, 9, 1], np.array([7, 5, -1, 3]))
    assert set(plan.kept) == {3, 7}
    assert dict((e, s) for s, e in plan.rewrites) == {9: 2, 1: 1}  # free slot first
    assert plan.slot_of == {7: 0, 3: 3, 9: 2, 1: 1}
    assert plan_staging([], np.array([1, 2])).rewrites == ()
    with pytest.raises(ValueError):
        plan_staging([1, 2, 3], np.array([-1, -1]))


@pytest.mark.parametrize("policy", [LRUPolicy, FrequencyPolicy])
def test_plan_fill_uses_free_rows_then_victims_never_wanted(policy):
    p = policy(3)
    resident = {(0, 1): 0, (0, 2): 1, (0, 3): 2}
    p.touch([(0, 1), (0, 2), (0, 2), (0, 3)])
    placed, evicted = plan_fill([(0, 3), (0, 9)], resident, [], p)
    assert (0, 3) not in evicted and len(evicted) == 1
    assert placed == {(0, 9): resident[evicted[0]]}
    placed, evicted = plan_fill([(0, 9)], resident, [5], p)
    assert placed == {(0, 9): 5} and evicted == []


def test_frequency_policy_keeps_popular_experts_through_a_burst():
    lru, lfu = LRUPolicy(2), FrequencyPolicy(2)
    for p in (lru, lfu):
        p.touch([("hot",)] * 10)
        p.touch([("a",), ("b",)])
    assert lru.victims([("hot",), ("a",), ("b",)], 1) == [("hot",)]
    assert lfu.victims([("hot",), ("a",), ("b",)], 1) == [("a",)]


def test_frequency_counts_halve_every_aging_times_capacity_touches():
    """Capacity 2, aging 40: counts halve at the 80th touch. A popular
    expert touched 79 times then keeps 39.5 after one more (the 80th) touch of
    another; with aging 0 it never halves. The runtime's default is LFU_AGING."""
    aged, kept = FrequencyPolicy(2, aging=40), FrequencyPolicy(2, aging=0)
    for p in (aged, kept):
        p.touch([("hot",)] * 79 + [("new",)])
    assert aged.count == {("hot",): 39.5, ("new",): 0.5}
    assert kept.count == {("hot",): 79.0, ("new",): 1.0}
    assert FrequencyPolicy(2).period == max(LFU_AGING * 2, 64)
    with pytest.raises(ValueError, match="aging must be >= 0"):
        FrequencyPolicy(2, aging=-1)


def test_counted_uses_equal_their_touches():
    """``add_uses`` (a prompt's routings, counted) leaves the counts and the
    victim order that touching each use would, the halving included."""
    for aging in (0, 40):
        touched, counted = FrequencyPolicy(2, aging=aging), FrequencyPolicy(2, aging=aging)
        touched.touch([("b",)] + [("a",)] * 3 + [("c",)] * 76)
        counted.add_uses({("b",): 1, ("a",): 3, ("c",): 76})
        assert touched.count == counted.count and touched.clock == counted.clock == 80
        assert counted.victims([("a",), ("b",), ("c",)], 3) == touched.victims([("a",), ("b",), ("c",)], 3)
    lru = LRUPolicy(2)
    lru.add_uses({("a",): 5, ("b",): 1})
    assert lru.victims([("a",), ("b",)], 1) == [("a",)]  # b's use comes last


# ------------------------------------------------------------ path identities


@pytest.mark.parametrize("family", FAMILIES)
def test_paths_equal_exact_elementwise(converted, family):
    path = converted(family).edge0
    model = mlx_edge0.load_model(path, cache_gib=40 * TINY_BUNDLE_GIB, staged=True)
    rt = model.edge0_runtime
    mx.random.seed(0)
    for block in _blocks(model):
        for shape in [(1, 1), (3, 1), (2, 9)]:
            x = mx.random.normal((*shape, model.edge0_section.experts.hidden_size))
            inds, _ = block.route(block.router_logits(x))
            want = rt.exact.experts(block.layer, x, inds)
            for p in (rt.decode_fallback, rt.decode):
                got = p.experts(block.layer, x, inds)
                assert mx.array_equal(got, want).item(), (p.name, shape)
            rt.whole_layer.begin(block.layer)
            assert mx.array_equal(rt.whole_layer.experts(block.layer, x, inds), want).item()
    assert rt.decode.name == "staged" and rt.decode_fallback.name == "hot"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_64_tokens_identical_on_every_path(converted, family):
    c = converted(family)
    _, tokenizer = mlx_edge0.load(c.edge0)
    ids = tokenizer.encode("import collections\nclass Counter(dict):")
    want = greedy(load_stock(c.source), ids)
    for name, options in PATHS.items():
        model = mlx_edge0.load_model(c.edge0, **options)
        assert greedy(model, ids) == want, name
        stats = model.stats()
        if name == "hot":  # real reads landing while the resident experts compute
            assert stats["hot_hits"] > 0 and stats["hot_misses"] > 0 and stats["hot_overlapped"] > 0
        if name.startswith("staged"):
            assert stats["staged_kept"] + stats["slot_rewrites"] > 0
            assert stats["staged_fallbacks"] == 0
        if name.startswith("whole-layer"):
            assert stats["whole_layer_loads"] == len(_blocks(model))
        if name == "whole-layer+hot":  # the decode computes from the prompt's kept copies
            assert stats["prompt_copied"] > 0 and stats["hot_hits"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_short_prompt_chunks_read_the_next_layers_guess_and_stay_exact(converted, family):
    """Prompt chunks too short to read whole layers go through the hot path,
    which with ``lookahead`` queues reads of the next layer's guessed
    experts (on the store's real queue thread, dropped or landed as the
    timing falls): the same logits as without, real reads that the layers
    they were read for route; the decode steps after them read nothing ahead."""
    c = converted(family)
    prompt = mx.array(np.random.default_rng(2).integers(0, 500, 12))
    logits = {}
    for lookahead in (False, True):
        model = mlx_edge0.load_model(
            c.edge0, cache_gib=40 * TINY_BUNDLE_GIB, prefill="auto", prerouter=False, lookahead=lookahead
        )
        cache = make_prompt_cache(model)
        outs = [model(prompt[None, i : i + 3], cache=cache) for i in range(0, 12, 3)]  # 3 x K=4 < 16 experts
        prompt_stats = model.stats()
        for _ in range(4):
            outs.append(model(outs[-1][:, -1:].argmax(-1), cache=cache))
        logits[lookahead] = mx.concatenate(outs, axis=1)
        stats = model.stats()
        assert stats["lookahead"] is lookahead and stats["whole_layer_loads"] == 0
        if lookahead:
            assert 0 < prompt_stats["lookahead_hits"] <= prompt_stats["lookahead_read"], prompt_stats
            assert stats["lookahead_read"] == prompt_stats["lookahead_read"]  # decode guesses nothing
    assert mx.array_equal(logits[False], logits[True]).item()


@pytest.mark.parametrize("name", ["hot", "staged+hot", "whole-layer"])
def test_batches_and_multi_chunk_prompts_stay_exact(converted, name):
    c = converted("qwen3_next")
    stock = load_stock(c.source)
    model = mlx_edge0.load_model(c.edge0, **PATHS[name])
    x = mx.array([[5, 17, 99, 3, 250, 7], [400, 2, 2, 81, 9, 64], [1, 2, 3, 4, 5, 6]])
    assert mx.allclose(stock(x), model(x), atol=1e-5, rtol=1e-5).item()
    # B=3 decode after a batched prefill (as mlx_lm.server batches)
    caches = make_prompt_cache(stock), make_prompt_cache(model)
    ys = [m(x, cache=cch)[:, -1].argmax(-1) for m, cch in zip((stock, model), caches)]
    for _ in range(8):
        ys = [m(y[:, None], cache=cch)[:, -1].argmax(-1) for m, y, cch in zip((stock, model), ys, caches)]
        assert mx.array_equal(ys[0], ys[1]).item()
    # a 50-token prompt in 16-token chunks, then decode
    prompt = mx.array(np.random.default_rng(1).integers(0, 500, 50))

    def run(m):
        return [
            int(t)
            for t, _ in generate_step(prompt, m, max_tokens=12, prefill_step_size=16, prompt_cache=make_prompt_cache(m))
        ]

    assert run(model) == run(stock)


@pytest.mark.parametrize("name", ["exact", "hot", "staged", "staged+hot", "prerouter"])
def test_steps_built_before_earlier_ones_are_evaluated(converted, tmp_path, name):
    """Teacher-forced scoring that builds many decode steps before evaluating
    any: no row an unevaluated step reads is rewritten under it."""
    import shutil

    from click.testing import CliRunner

    from mlx_edge0.cli import main

    path = converted("qwen3_moe").edge0
    options = dict(PATHS["hot"], cache_gib=6 * TINY_BUNDLE_GIB) if name == "hot" else PATHS.get(name, {})
    if name == "prerouter":
        path = tmp_path / "ckpt"
        shutil.copytree(converted("qwen3_moe").edge0, path)
        assert CliRunner().invoke(main, ["heads", "init", str(path)]).exit_code == 0
    tokens = np.random.default_rng(3).integers(0, 500, 24).tolist()

    def score(model, eval_each_step):
        cache = make_prompt_cache(model)
        logits = [model(mx.array([tokens[:4]]), cache=cache)[:, -1]]
        for t in tokens[4:]:
            logits.append(model(mx.array([[t]]), cache=cache)[:, -1])
            if eval_each_step:
                mx.eval(logits[-1])
        return mx.concatenate(logits)

    want = score(mlx_edge0.load_model(path, **options), eval_each_step=True)
    model = mlx_edge0.load_model(path, **options)
    got = score(model, eval_each_step=False)
    assert mx.array_equal(got, want).item()
    assert model.stats()["expert_loads"] > 0


# ------------------------------------------------------------- staged slots


def test_fill_never_changes_a_step_that_read_the_rows(converted):
    model = mlx_edge0.load_model(converted("qwen3_moe").edge0, cache_gib=0, staged=True)
    rt = model.edge0_runtime
    block = _blocks(model)[0]
    buffer = rt.staging[block.layer]
    x = mx.random.normal((1, 1, model.edge0_section.experts.hidden_size))
    inds = mx.array([[[1, 4, 6, 9]]], mx.uint32)
    want = rt.exact.experts(block.layer, x, inds)

    current = buffer.stage([1, 4, 6, 9])
    current.reads.wait()
    y = buffer.rows.compute(x, mx.take(current.slot_table, inds), None)  # not evaluated
    following = buffer.stage([0, 2, 3, 5])  # rewrites every row
    following.reads.wait()
    assert sorted(buffer.contents.tolist()) == [0, 2, 3, 5]
    assert mx.array_equal(y, want).item()
    new_inds = mx.array([[[0, 2, 3, 5]]], mx.uint32)
    got = expert_glu(x, mx.take(following.slot_table, new_inds), buffer.weights())
    assert mx.array_equal(got, rt.exact.experts(block.layer, x, new_inds)).item()


def test_exact_path_reuses_one_set_of_rows(converted):
    c = converted("qwen3_moe")
    model, tokenizer = mlx_edge0.load(c.edge0, **PATHS["exact"])
    greedy(model, tokenizer.encode("def f(x):"), 6)
    scratch = model.edge0_runtime.exact.scratch
    row = SlotBuffers.row_nbytes(model.edge0_section.experts, mx.float32)  # widened: the page cache is kept
    assert scratch.capacity == 4 and model.stats()["resident_bytes"]["exact"] == 4 * row
    # a union larger than K (a prompt chunk) reads into fresh buffers
    mx.eval(model(mx.array([tokenizer.encode("import os, sys, re")])))
    assert model.edge0_runtime.exact.scratch is scratch and scratch.capacity == 4


def test_fill_keeps_wanted_experts_in_place(converted):
    model = mlx_edge0.load_model(converted("qwen3_moe").edge0, cache_gib=0, staged=True)
    rt = model.edge0_runtime
    buffer = rt.staging[_blocks(model)[0].layer]
    buffer.stage([1, 4, 6, 9]).reads.wait()
    before = dict(zip(buffer.contents.tolist(), range(buffer.capacity)))
    model.reset_stats()
    staged = buffer.stage([9, 4, 0, 2])
    staged.reads.wait()
    s = model.stats()
    assert (s["staged_kept"], s["staged_read"], s["staged_copied"]) == (2, 2, 0)
    table = np.array(staged.slot_table)
    assert table[4] == before[4] and table[9] == before[9]
    assert sorted(buffer.contents.tolist()) == [0, 2, 4, 9]


def test_rows_in_the_checkpoints_dtype_hold_more_experts_and_compute_the_same(converted, monkeypatch):
    """Rows that keep the checkpoint's bf16 scales (by default where the page
    cache is bypassed) hold more experts in a budget than rows widened to the
    CPU's float32, and each call casts only the rows it uses: the same tokens
    as stock, the same products as widened rows."""
    c = converted("qwen3_moe")
    _, tokenizer = mlx_edge0.load(c.edge0)
    ids = tokenizer.encode("import collections\nclass Counter(dict):")
    want = greedy(load_stock(c.source), ids)
    budget = 30 * TINY_BUNDLE_GIB
    disk = mlx_edge0.load_model(c.edge0, cache_gib=budget, staged=False, prefill="exact", page_cache="bypass")
    wide = mlx_edge0.load_model(c.edge0, cache_gib=budget, staged=False, prefill="exact", row_scales="compute")
    kept = mlx_edge0.load_model(c.edge0, cache_gib=budget, staged=False, prefill="exact")  # "auto", page cache kept
    checkpoint_rows = mlx_edge0.load_model(
        c.edge0, cache_gib=budget, staged=False, prefill="exact", row_scales="checkpoint"
    )
    assert kept.edge0_runtime.pool_dtype == mx.float32 and checkpoint_rows.edge0_runtime.pool_dtype == mx.bfloat16
    geometry = disk.edge0_section.experts
    assert disk.edge0_runtime.hot.buffers.scales_dtype == mx.bfloat16
    assert wide.edge0_runtime.hot.buffers.scales_dtype == mx.float32
    assert disk.edge0_runtime.hot.capacity == int(budget * 2**30) // SlotBuffers.row_nbytes(geometry, mx.bfloat16)
    assert wide.edge0_runtime.hot.capacity == int(budget * 2**30) // SlotBuffers.row_nbytes(geometry, mx.float32)
    assert disk.edge0_runtime.hot.capacity > wide.edge0_runtime.hot.capacity
    assert greedy(disk, ids) == greedy(wide, ids) == want
    # a call naming its rows gathers and casts those alone, with the products of a cast of every row
    taken, take = [], ExpertWeights.take

    def spy(weights: ExpertWeights, rows: mx.array) -> ExpertWeights:
        taken.append(rows)
        return take(weights, rows)

    monkeypatch.setattr(ExpertWeights, "take", spy)
    buffers = disk.edge0_runtime.hot.buffers
    rows = np.array([[3, 0, 5], [5, 2, 3]], np.uint32)
    x = mx.random.normal((2, 1, geometry.hidden_size), key=mx.random.key(1))
    gathered = buffers.compute(x, mx.array(rows), mx.float32, used=rows)
    assert [sorted(np.array(r).tolist()) for r in taken] == [[0, 2, 3, 5]]
    whole = expert_glu(x, mx.array(rows), buffers.weights().with_scales_dtype(mx.float32))
    assert mx.array_equal(gathered, whole).item()


# -------------------------------------------------------------- budget, memory


def test_hot_cache_stays_within_budget(converted):
    budget = 30 * TINY_BUNDLE_GIB
    model = mlx_edge0.load_model(converted("bailing_moe").edge0, cache_gib=budget, staged=False)
    hot = model.edge0_runtime.hot
    assert hot.nbytes <= budget * 2**30 < hot.nbytes + hot.buffers.nbytes / hot.capacity
    _, tokenizer = mlx_edge0.load(converted("bailing_moe").edge0)
    greedy(model, tokenizer.encode("def f(x):"), 40)
    assert len(hot.row_of) <= hot.capacity
    assert model.stats()["resident_bytes"]["hot"] == hot.nbytes


@pytest.mark.parametrize("name", ["hot", "staged"])
def test_peak_memory_flat_over_generation_length(converted, name):
    c = converted("qwen3_moe")
    model = mlx_edge0.load_model(c.edge0, **PATHS[name])
    # A rotating KV cache holds KV memory fixed, so what is measured is ours.
    cache = make_prompt_cache(model, max_kv_size=16)
    y = model(mx.array([[3, 1, 4, 1, 5]]), cache=cache)[:, -1].argmax(-1)
    peaks = {}
    mx.reset_peak_memory()
    for step in range(1, 301):
        y = model(y[:, None], cache=cache)[:, -1].argmax(-1)
        mx.eval(y)
        if step in (30, 300):
            peaks[step] = mx.get_peak_memory()
    assert peaks[300] <= 1.05 * peaks[30]


# ------------------------------------------------------------------ I/O errors


@pytest.mark.parametrize("name", ["hot", "staged", "whole-layer"])
def test_io_error_surfaces_in_the_caller(converted, monkeypatch, name):
    model = mlx_edge0.load_model(converted("bailing_moe_v3").edge0, **PATHS[name])

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    t0 = time.monotonic()
    with pytest.raises(ExpertReadError, match=r"layer_\d{3}\.safetensors: read of .* Input/output error"):
        mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]])))
    assert time.monotonic() - t0 < 10
    monkeypatch.undo()
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))).item()  # recovers


def test_stats_telemetry(converted):
    c = converted("qwen3_moe")
    model, tokenizer = mlx_edge0.load(c.edge0, cache_gib=40 * TINY_BUNDLE_GIB, staged=True)
    greedy(model, tokenizer.encode("x = 1"), 10)
    s = model.stats()
    assert s["steps"] >= 10 and s["tokens"] >= 10
    assert s["expert_loads"] > 0 and s["bytes_read"] >= s["expert_loads"] * 13824
    assert s["exposed_wait_ms"] >= 0 and s["decode_path"] == "staged"
    assert s["last_step"]["steps"] == 1 and s["last_step"]["tokens"] == 1
    row = SlotBuffers.row_nbytes(model.edge0_section.experts, mx.float32)  # scales widened to fp32
    assert row == 12288 + 3072
    assert s["resident_bytes"]["staged"] == 3 * 4 * row  # layers x K slots
    assert s["resident_bytes"]["exact"] == 0  # every decode call was staged
    assert s["peak_memory"] > 0
    model.reset_stats()
    assert model.stats()["expert_loads"] == 0


# ------------------------------------------------- the slot-buffer invariant


def test_rows_are_rewritten_only_after_their_readers_are_evaluated():
    """Writes go through the buffers, which evaluate every recorded reader
    first: a computation built before a rewrite sees the old rows."""
    from fakes import FakeStore

    store = FakeStore()
    buffers = SlotBuffers(store.geometry, 2)
    x = mx.random.normal((1, 1, store.geometry.hidden_size), key=mx.random.key(0))
    inds = mx.array([[[0, 1]]], mx.uint32)
    store.submit(0, [3, 5], [0, 1], buffers).wait()
    y = buffers.compute(x, inds, None)  # recorded, not evaluated
    want = expert_glu(x, mx.array([[[3, 5]]], mx.uint32), store.weights(0))
    store.submit(0, [6, 7], [0, 1], buffers).wait()  # rewrites both rows
    assert mx.array_equal(y, want).item()
    z = buffers.compute(x, inds, None)
    buffers.copy_row(buffers, 0, 1)  # a copy settles the readers too
    assert mx.array_equal(z, expert_glu(x, mx.array([[[6, 7]]], mx.uint32), store.weights(0))).item()

"""Options are validated once, with messages that say what is allowed."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_edge0
from mlx_edge0.hot import hot_capacity
from mlx_edge0.options import GIB, Options, parse_staged_window
from mlx_edge0.slots import SlotBuffers


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("compute_dtype", "int8", "compute_dtype must be one of"),
        ("io_threads", 0, "io_threads must be an integer in 1..64"),
        ("cache_gib", -1, "cache_gib must be 'auto' or a number"),
        ("cache_gib", "big", "cache_gib must be 'auto' or a number"),
        ("hot_policy", "fifo", "hot_policy must be one of lfu, lru"),
        ("staged_slots", -2, "staged_slots must be an integer >= 0"),
        (
            "staged_window",
            2,
            r"staged_window must be 0 \(a buffer per prerouted layer\), an integer >= 3 "
            r"\(that many buffers\) or 'auto' \(from 3, grown while reads stall compute\), got 2",
        ),
        ("staged_window", -1, "staged_window must be 0"),
        ("staged_window", "deep", "staged_window must be 0 .* or 'auto' .*, got 'deep'"),
        ("staged_window", 3.5, "staged_window must be 0 .* or 'auto' .*, got 3.5"),
        ("prefill", "chunked", "prefill must be one of auto, whole-layer, exact"),
        ("page_cache", "drop-all", "page_cache must be one of keep, drop-prefill, bypass"),
    ],
)
def test_invalid_options_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        Options(**{field: value})


def test_staged_window_takes_0_an_integer_from_3_or_auto():
    for value in (0, 3, 8, "auto"):
        assert Options(staged_window=value).staged_window == value
    assert parse_staged_window("auto") == "auto" and parse_staged_window("4") == 4
    with pytest.raises(ValueError, match="'deep': use 0, an integer >= 3 or 'auto'"):
        parse_staged_window("deep")


def test_unknown_option_names_are_refused(converted):
    with pytest.raises(TypeError):
        mlx_edge0.load_model(converted("qwen3_moe").edge0, cache_size=3)
    with pytest.raises(ValueError, match="unknown edge0 option"):
        Options.from_dict({"cache_size": 3})


def test_cache_budget_resolution():
    assert Options(cache_gib=0.5).cache_bytes(10 * GIB) == GIB // 2
    assert Options(cache_gib=0).cache_bytes(10 * GIB) == 0
    auto = Options().cache_bytes(4 * GIB)
    assert 0 < auto <= GIB  # at most a quarter of the experts
    # ranks on one machine split its memory; an explicit budget is per process
    alone, shared = Options().cache_bytes(1 << 60), Options().cache_bytes(1 << 60, sharers=2)
    assert shared == pytest.approx(alone / 2, rel=0.05)
    assert Options(cache_gib=0.5).cache_bytes(10 * GIB, sharers=2) == GIB // 2
    assert Options(compute_dtype="auto").dtype() == (mx.float32 if mx.default_device() == mx.cpu else None)
    assert Options(compute_dtype="native").dtype() is None


def test_auto_budget_with_page_cache_bypass(monkeypatch):
    """With no page cache the hot cache is the only copy: "auto" takes 85% of
    what is available (the cgroup's headroom when capped) once the process's
    other memory is counted, up to every expert."""
    monkeypatch.setattr("mlx_edge0.options.available_memory", lambda: 8 * GIB)
    assert Options().cache_bytes(100 * GIB, committed=2 * GIB) == int(0.1 * 8 * GIB)
    assert Options(page_cache="bypass").cache_bytes(100 * GIB, committed=2 * GIB) == int(0.85 * 6 * GIB)
    assert Options(page_cache="bypass").cache_bytes(3 * GIB, committed=2 * GIB) == 3 * GIB  # every expert
    assert Options().cache_bytes(3 * GIB) == int(0.25 * 3 * GIB)
    assert Options(page_cache="bypass").cache_bytes(100 * GIB, sharers=2, committed=GIB) == int(0.85 * 3 * GIB)
    assert Options(page_cache="bypass").cache_bytes(100 * GIB, committed=9 * GIB) == 0  # nothing left


def test_a_budget_never_holds_more_than_all_the_experts(converted):
    assert hot_capacity(GIB, 1000, 96) == 96
    assert hot_capacity(5999, 1000, 96) == 5
    model = mlx_edge0.load_model(converted("qwen3_moe").edge0, cache_gib=1.0, staged=True, staged_slots=1000)
    section = model.edge0_section
    g = section.experts
    row = SlotBuffers.row_nbytes(g, model.edge0_runtime.pool_dtype)
    resident = model.stats()["resident_bytes"]
    assert resident["hot"] == g.num_experts * len(section.moe_layers) * row < GIB // 100
    assert resident["staged"] == g.num_experts * len(section.moe_layers) * row  # slots capped at the experts


def test_page_cache_policies_give_the_same_numbers(converted):
    path = converted("qwen3_moe").edge0
    x = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    keep = mlx_edge0.load_model(path, prefill="whole-layer", page_cache="keep")(x)
    for policy in ("drop-prefill", "bypass"):
        for prefill in ("whole-layer", "exact"):
            other = mlx_edge0.load_model(path, prefill=prefill, page_cache=policy)(x)
            assert mx.array_equal(keep, other).item(), (policy, prefill)


def test_rows_keep_the_checkpoints_scales_where_they_are_the_only_copy():
    assert Options().rows_widened()  # the page cache backs a miss: no cast per call
    assert not Options(page_cache="bypass").rows_widened()  # the rows are the only copy: most rows
    assert Options(page_cache="bypass", row_scales="compute").rows_widened()
    assert not Options(row_scales="checkpoint").rows_widened()
    with pytest.raises(ValueError, match="row_scales must be one of auto, checkpoint, compute, got 'fp32'"):
        Options(row_scales="fp32")

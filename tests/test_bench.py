"""Synthetic checkpoints load in stock mlx-lm; the runner measures and reports."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from mlx_edge0.bench.commands import bench
from mlx_edge0.bench.run_spec import RunSpec, forced_tokens
from mlx_edge0.bench.runner import BenchOptions, round_order, run_bench, run_child
from mlx_edge0.bench.synth import SynthOptions, plan_shards, synth_checkpoint
from mlx_edge0.bench.tables import markdown_table

# Widths shrunk so every family loads and runs in about a second; layer counts
# cover both attention kinds of the hybrids.
SMALL = {
    "ling-3.0-tiny": (4, {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
        "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "num_attention_heads": 2, "head_dim": 64, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
    }),
    "qwen3.5-35b-a3b": (4, {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_experts": 16, "num_experts_per_tok": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2]},
    }),
    "qwen3-30b-a3b": (2, {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "moe_intermediate_size": 64, "num_experts": 16, "num_experts_per_tok": 4,
    }),
}  # fmt: skip


def small_options(geometry: str, seed: int = 0, **kwargs) -> SynthOptions:
    layers, overrides = SMALL[geometry]
    return SynthOptions(geometry, layers=layers, seed=seed, overrides=overrides, **kwargs)


@pytest.fixture(scope="module")
def small_ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("small")
    return {g: synth_checkpoint(root / g, small_options(g), progress=lambda _: None).path for g in SMALL}


def _moe_blocks(model):
    return [layer.mlp for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]


def _run(model, tokens: list[int]) -> mx.array:
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)
    step = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    return mx.concatenate([logits, step], axis=1)


def _check_stock_load(path: Path, tokens: list[int]) -> tuple:
    model, config = load_model(path, strict=True)
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["group_size"] == 64
    assert config["edge0_synthetic"]["seed"] == 0
    for block in _moe_blocks(model):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(block.switch_mlp, proj)
            assert (layer.bits, layer.group_size, layer.mode) == (4, 64, "affine")
            assert layer.scales.dtype == mx.bfloat16
    model.set_dtype(mx.float32)
    logits = _run(model, tokens)
    assert mx.all(mx.isfinite(logits)).item()
    assert len(set(mx.argmax(logits[0], axis=-1).tolist())) > 1
    return model, config


def test_ling_full_width_loads_in_stock_mlx_lm(tmp_path):
    opts = SynthOptions("ling-3.0-tiny", layers=2)
    report = synth_checkpoint(tmp_path / "ling", opts, progress=lambda _: None)
    index = json.loads((report.path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    model, config = _check_stock_load(report.path, [1, 500, 9000])
    assert config["model_type"] == "bailing_hybrid"
    assert model.model.word_embeddings.weight.shape == (157184, 1536)
    assert _moe_blocks(model)[0].switch_mlp.gate_proj.weight.shape == (128, 512, 1536 // 8)


@pytest.mark.parametrize("geometry", list(SMALL))
def test_small_variants_load_and_route(small_ckpts, geometry):
    model, config = _check_stock_load(small_ckpts[geometry], list(range(1, 40, 3)))
    quant = config["quantization"]
    if geometry.startswith("qwen"):
        gates = [k for k, v in quant.items() if k.endswith("mlp.gate")]
        assert gates and all(quant[k]["bits"] == 8 for k in gates)
    # Routers spread tokens over experts: 16 tokens must not share one top-k.
    block = _moe_blocks(model)[0]
    x = mx.random.normal((16, model.model.norm.weight.shape[0]), key=mx.random.key(1))
    if hasattr(block.gate, "expert_bias"):
        indices, _ = block.gate(x)
    else:
        indices = mx.argpartition(-block.gate(x), kth=3, axis=-1)[:, :4]
    assert len(set(indices.flatten().tolist())) >= 12


def test_same_seed_same_bytes_and_layers_independent(tmp_path, small_ckpts):
    g = "ling-3.0-tiny"
    again = synth_checkpoint(tmp_path / "again", small_options(g), progress=lambda _: None)
    other = synth_checkpoint(tmp_path / "other", small_options(g, seed=1), progress=lambda _: None)
    shard = "model-00003-of-00006.safetensors"  # layer 1: the first MoE layer
    same = (small_ckpts[g] / shard).read_bytes()
    assert (again.path / shard).read_bytes() == same
    assert (other.path / shard).read_bytes() != same
    # A layer's bytes do not depend on depth (8 layers repeat the 4-layer pattern).
    deeper = SynthOptions(g, layers=8, overrides=SMALL[g][1])
    eight = synth_checkpoint(tmp_path / "eight", deeper, progress=lambda _: None)
    assert (eight.path / "model-00003-of-00010.safetensors").read_bytes() == same


def test_existing_out_refused_without_force(tmp_path, small_ckpts):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        synth_checkpoint(out, small_options("qwen3-30b-a3b"))
    assert (out / "keep.txt").read_text() == "mine"
    result = CliRunner().invoke(bench, ["synth", "--geometry", "ling-3.0-tiny", str(out)])
    assert result.exit_code != 0 and "--force" in result.output

    synth_checkpoint(out, small_options("qwen3-30b-a3b", force=True), progress=lambda _: None)
    assert not (out / "keep.txt").exists()
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left


def test_bad_layer_count_is_explained():
    with pytest.raises(ValueError, match="full_attention_interval"):
        SynthOptions("qwen3.5-35b-a3b", layers=2)
    with pytest.raises(ValueError, match="unknown geometry"):
        SynthOptions("llama")


def test_plan_shards_groups_by_layer():
    names = ["m.embed.weight", "m.layers.0.a", "m.layers.0.b", "m.layers.1.a", "m.norm", "lm_head"]
    shards = plan_shards(names)
    assert [s.label for s in shards] == ["embeddings", "layer 0", "layer 1", "head"]
    assert shards[-1].file == "model-00004-of-00004.safetensors"
    assert sum(len(s.names) for s in shards) == len(names)


def test_runner_child_measures_stock_arm(small_ckpts):
    spec = RunSpec("stock", small_ckpts["qwen3-30b-a3b"], 8, 4, "float32", 0)
    r = run_child(spec, timeout_s=120)
    assert r["ok"], r.get("stderr_tail")
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    assert r["peak_memory"] > 0 and r["active_memory_after_load"] > 0
    assert r["peak_rss"] > r["active_memory_after_load"]
    assert r["logits_finite"] and len(r["tokens"]) == 1 + 2 + 4
    # teacher-forced: it was fed the peer arm's fixed sequence, not its own picks
    vocab = json.loads((spec.path / "config.json").read_text())["vocab_size"]
    # (one more than it read back: the step queued after the last timed token, as generate_step's)
    assert r["teacher_forced"] and r["fed_tokens"] == forced_tokens(vocab, 2 + 4 + 1, spec.seed)
    assert r["fed_tokens"][:-1] == forced_tokens(vocab, 2 + 4, spec.seed)  # the peer arm's, token for token
    assert r["fed_tokens"] != r["tokens"][:-1]


def test_bypass_arm_decodes_the_same_tokens_as_the_cached_arm(converted):
    """``ARM+bypass`` loads with page_cache="bypass": same routing, same bytes, same tokens."""
    path = converted("qwen3_moe").edge0
    runs = {arm: run_child(RunSpec(arm, path, 8, 4, "float32", 0), timeout_s=120)
            for arm in ("edge0-exact", "edge0-exact+bypass")}  # fmt: skip
    assert all(r["ok"] for r in runs.values()), [r.get("stderr_tail") for r in runs.values()]
    assert runs["edge0-exact"]["tokens"] == runs["edge0-exact+bypass"]["tokens"]
    assert runs["edge0-exact+bypass"]["counters_per_token"]["bytes_read"] > 0
    # every expert read goes to the device (O_DIRECT), so the kernel's count covers the store's
    bypass = runs["edge0-exact+bypass"]
    assert bypass["device_bytes_per_token"] >= bypass["counters_per_token"]["bytes_read"]


def test_window_arms_decode_the_prerouter_arms_tokens_in_fewer_staged_rows():
    """``edge0-prerouter-window`` is the prerouter with a staged window: same
    tokens, fewer staged bytes (the default model has 5 prerouted layers);
    ``-auto`` records the depth its window grew to."""
    from mlx_edge0.bench.summary import run_metrics
    from mlx_edge0.default_model import default_checkpoint

    path = default_checkpoint()
    arms = ("edge0-prerouter@0", "edge0-prerouter-window@0", "edge0-prerouter-window-auto@0")
    runs = [run_child(RunSpec(arm, path, 8, 6, "float32", 0), timeout_s=120) for arm in arms]
    assert all(r["ok"] for r in runs), [r.get("stderr_tail") for r in runs]
    pre, window, auto = runs
    assert pre["tokens"] == window["tokens"] == auto["tokens"]
    # the same routing, recorded per decoded token (prerouted layers included)
    assert pre["locality"] == window["locality"] and pre["locality"]["tokens"] == 6
    assert 4 <= pre["locality"]["mean_distinct"] <= 16 and 0 <= pre["locality"]["mean_reuse"] <= 1
    assert window["counters_per_token"]["prerouted"] == pre["counters_per_token"]["prerouted"] > 0
    assert window["resident_bytes"]["staged"] * 5 == pre["resident_bytes"]["staged"] * 4
    assert (pre["staged_window"], window["staged_window"]) == (0, 4) and 3 <= auto["staged_window"] <= 5
    assert auto["resident_bytes"]["staged"] * 5 == pre["resident_bytes"]["staged"] * auto["staged_window"]
    assert run_metrics(auto)["staged_window"] == auto["staged_window"]
    assert all("prerouted_wait_ms" in step for step in auto["decode_step_counters"])
    # decode pipelined as generate_step: the per-step counters still add up to exactly the decoded steps
    for run in runs:
        steps = run["decode_step_counters"]
        assert len(steps) == len(run["decode_step_s"]) == 6
        for key in ("prerouted", "expert_loads", "staged_read"):
            assert sum(step[key] for step in steps) == run["decode_counters"][key]
        assert run["decode_counters"]["prerouted"] == 6 * 5  # every consumer of every decoded step
        # a runtime step closes when the next opens, so the last is still open, and the first
        # opened while the last warm-up step computed, before the decode's clock started: its
        # step_ms spans other times than the decode's wall time and is not divided out per token
        assert run["decode_counters"]["step_ms"] > 0
        assert "step_ms" not in run["counters_per_token"]


def test_hot_arm_replays_its_decode_trace_against_beladys_min():
    """A hot arm records its decode trace replayed at its own rows under LFU,
    LRU and MIN: with every expert's row (the default model: 6 x 16), MIN
    hits every routing but each expert's first, i.e. the trace's ceiling."""
    from mlx_edge0.bench.eviction import simulate
    from mlx_edge0.bench.locality import LocalitySummary, RoutingTrace
    from mlx_edge0.bench.summary import run_metrics
    from mlx_edge0.default_model import default_checkpoint
    from mlx_edge0.telemetry import hot_hit_rate

    r = run_child(RunSpec("edge0-hot@1", default_checkpoint(), 8, 6, "float32", 0), timeout_s=120)
    assert r["ok"], r.get("stderr_tail")
    replay = r["eviction_replay"]
    assert replay["capacity"] == 96 and replay["routings_per_token"] == 6 * 4 and replay["permanent"] == 0
    assert replay["hit_rate"]["min"] == replay["hit_rate"]["lfu"] == replay["ceiling"]
    distinct = r["locality"]["mean_distinct"] * 6  # experts first used in the trace
    assert replay["ceiling"] == pytest.approx(1 - distinct / (6 * 24))
    # From the cache the decode began with (the prompt's and warm-up steps' experts), an unbounded
    # cache hits what the runtime's did: every routing but the decode's first use of an expert.
    start = replay["from_start"]
    assert start["resident"] > 0 and start["ceiling"] > replay["ceiling"]
    assert start["hit_rate"]["min"] == start["hit_rate"]["lfu"] == start["hit_rate"]["lfu+next"] == start["ceiling"]
    # (a bundle read ahead for the call that routes it was read, not a hit)
    assert start["ceiling"] == pytest.approx(hot_hit_rate(r["counters_per_token"]))
    # the record keeps the routing and the start, so any policy replays offline from them
    trace = RoutingTrace(**r["routing"])
    assert LocalitySummary.of(trace).as_dict() == r["locality"]
    resident = [tuple(k) for k in replay["resident_keys"]]
    assert len(resident) == start["resident"] and replay["permanent_keys"] == replay["waited_keys"] == []
    assert simulate(trace, 96, "lru", resident=resident).hit_rate == start["hit_rate"]["lru"]
    m = run_metrics(r)
    assert m["min_hit_rate"] == replay["hit_rate"]["min"]
    assert m["min_hit_rate_from_start"] == start["hit_rate"]["min"]
    assert m["hit_rate"] == pytest.approx(1 - r["counters_per_token"]["expert_loads"] / 24)
    # With the prerouter, layer 0 (no owner) is permanent in that cache: replayed resident from
    # the start, so only the other layers' first routings of an expert miss.
    p = run_child(RunSpec("edge0-prerouter@1", default_checkpoint(), 8, 6, "float32", 0), timeout_s=120)
    assert p["ok"], p.get("stderr_tail")
    replay = p["eviction_replay"]
    assert replay["permanent"] == 16 and replay["hit_rate"]["min"] == replay["ceiling"]
    assert {tuple(k) for k in replay["permanent_keys"]} == {(0, e) for e in range(16)}
    assert replay["waited_keys"] == []  # never a victim: nothing to weigh
    # its consumers' bundles are placed when each step opens, and the replay does so too
    assert replay["planned_layers"] == [1, 2, 3, 4, 5] and replay["popularity_prior"] is False
    assert replay["ceiling"] == pytest.approx(1 - sum(p["locality"]["distinct"][1:]) / (6 * 24))


@pytest.mark.parametrize("arm", ["edge0-hot@0.0005", "edge0-prerouter@0.00085"])
def test_the_replay_from_the_runtimes_policy_state_is_what_the_runtime_served(arm):
    """The record keeps what the runtime's LFU had learned when the timed
    decode began (the prompt's and warm-up's uses), so its replay from that
    start serves what the runtime served, to the routing, in a cache that
    evicts: the default model's 96 bundles in 34 rows (hot) and in 59 rows
    whose prerouted layers (1-5) are placed when each step opens."""
    from mlx_edge0.bench.eviction import RecordedDecode, simulate
    from mlx_edge0.default_model import default_checkpoint
    from mlx_edge0.telemetry import hot_hit_rate

    r = run_child(RunSpec(arm, default_checkpoint(), 8, 16, "float32", 0), timeout_s=120)
    assert r["ok"], r.get("stderr_tail")
    decode = RecordedDecode.of(r)
    assert decode.capacity == (34 if "hot" in arm else 59)
    assert decode.planned == (frozenset() if "hot" in arm else frozenset({1, 2, 3, 4, 5}))
    assert decode.policy_state["policy"] == "lfu" and decode.policy_state["clock"] > 0
    served = hot_hit_rate(r["counters_per_token"])
    start = r["eviction_replay"]["from_start"]
    assert served < start["hit_rate"]["min"] <= start["ceiling"]  # it evicted, and not as MIN would
    assert start["hit_rate"]["lfu"] == pytest.approx(served, abs=1e-12)
    assert simulate(decode.trace, decode.capacity, "lfu", **decode.runtime_start()).hit_rate == start["hit_rate"]["lfu"]


def test_failed_arm_is_reported_not_raised(tmp_path, small_ckpts):
    path = small_ckpts["qwen3-30b-a3b"]
    opts = BenchOptions(
        out=tmp_path / "results.json", stock=path, edge0=path, rounds=1,
        prompt_tokens=4, decode_tokens=2, caches=("cold", "warm"),
    )  # fmt: skip
    results = run_bench(opts, command=["test"], progress=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == results["summary"]
    assert [(r["arm"], r["cache"]) for r in saved["runs"]] == [
        ("stock", "cold"),
        ("edge0-exact", "cold"),
        ("stock", "warm"),
        ("edge0-exact", "warm"),
    ]
    stock, edge0 = saved["summary"]["arms"]["stock/cold"], saved["summary"]["arms"]["edge0-exact/cold"]
    assert stock["ok"] == 1 and stock["decode_tok_s"]["median"] > 0
    assert edge0["ok"] == 0 and saved["runs"][1]["stderr_tail"]  # not an edge0 checkpoint
    table = markdown_table(saved["summary"])
    assert "| stock | cold | 1/1 |" in table and "edge0-exact/cold failed" in table
    assert saved["machine"]["cpu_count"] >= 1


def test_each_arm_takes_each_position_in_turn():
    arms = ("stock", "edge0-exact", "llamacpp")
    orders = [round_order(arms, rnd) for rnd in range(4)]
    assert orders[:3] == [
        ["stock", "edge0-exact", "llamacpp"],
        ["edge0-exact", "llamacpp", "stock"],
        ["llamacpp", "stock", "edge0-exact"],
    ]
    assert orders[3] == orders[0]
    assert [order.index("llamacpp") for order in orders[:3]] == [2, 1, 0]


def test_bench_options_validate(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--edge0"):
        BenchOptions(out=tmp_path / "r.json", stock=tmp_path)
    with pytest.raises(ValueError, match="unknown"):
        BenchOptions(out=tmp_path / "r.json", arms=("fast",))


def test_quantize_embeddings_option(tmp_path, small_ckpts):
    import mlx.nn as nn

    from mlx_edge0 import load_model as load_edge0
    from mlx_edge0.conversions import ConvertOptions, convert

    stock, _ = load_model(small_ckpts["ling-3.0-tiny"])
    assert type(stock.model.word_embeddings) is nn.Embedding  # bailing_moe_v3 keeps them bf16
    assert type(stock.lm_head) is nn.Linear

    opts = small_options("ling-3.0-tiny", quantize_embeddings=True)
    report = synth_checkpoint(tmp_path / "qe", opts, progress=lambda _: None)
    model, config = _check_stock_load(report.path, [1, 5, 9])
    assert isinstance(model.model.word_embeddings, nn.QuantizedEmbedding)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    assert config["edge0_synthetic"]["quantized_embeddings"] is True
    # The edge0 conversion keeps them quantized and streams the same model.
    convert(report.path, tmp_path / "qe-edge0", ConvertOptions(show_progress=False))
    edge0 = load_edge0(tmp_path / "qe-edge0", compute_dtype="float32", cache_gib=0, prerouter=False)
    assert isinstance(edge0.model.word_embeddings, nn.QuantizedEmbedding)
    tokens = [1, 5, 9]
    assert mx.array_equal(_run(edge0, tokens), _run(model, tokens)).item()


def test_k_tier_arm_runs_on_its_own_copy(tmp_path):
    """``ARM/kK`` runs on ``EDGE0-kK`` at K, beside the checkpoint's own tier, in one bench."""
    import shutil

    from mlx_edge0.cli import main as edge0_main
    from mlx_edge0.default_model import default_checkpoint

    edge0 = tmp_path / "default"
    shutil.copytree(default_checkpoint(), edge0)
    for name in ("adapters.safetensors", "adapter_config.json"):  # trained for K=4: not this test's part
        (edge0 / name).unlink()
    opts = dict(out=tmp_path / "r.json", edge0=edge0, arms=("edge0-prerouter", "edge0-prerouter/k2"), rounds=1,
                prompt_tokens=4, decode_tokens=3, caches=("cold",))  # fmt: skip
    with pytest.raises(ValueError, match=r"default-k2.*cp -al .*edge0 heads init .*default-k2 --k 2"):
        BenchOptions(**opts)
    shutil.copytree(edge0, tmp_path / "default-k2")
    result = CliRunner().invoke(edge0_main, ["heads", "init", str(tmp_path / "default-k2"), "--k", "2"])
    assert result.exit_code == 0, result.output
    o = BenchOptions(**opts)
    spec = o.spec("edge0-prerouter/k2", "cold")
    assert (spec.path, spec.k) == (tmp_path / "default-k2", 2)
    assert (o.spec("edge0-prerouter", "cold").path, o.spec("edge0-prerouter", "cold").k) == (edge0, 0)
    runs = {arm: run_child(o.spec(arm, "cold"), timeout_s=120) for arm in o.arms}
    assert all(r["ok"] for r in runs.values()), [r.get("stderr_tail") for r in runs.values()]
    # Layer 0 routes with its own gate at K=4; the five prerouted layers at the tier's K.
    assert runs["edge0-prerouter"]["eviction_replay"]["routings_per_token"] == 6 * 4
    assert runs["edge0-prerouter/k2"]["eviction_replay"]["routings_per_token"] == 4 + 5 * 2
    with pytest.raises(ValueError, match="K tier 'x'"):
        BenchOptions(**{**opts, "arms": ("edge0-hot/kx",)})
    with pytest.raises(ValueError, match="unknown arm 'stock/k2'"):
        BenchOptions(**{**opts, "arms": ("stock/k2",)})

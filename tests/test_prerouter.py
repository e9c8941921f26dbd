"""Prerouter heads: warm start, files, validation, prediction-as-routing at decode."""

from __future__ import annotations

import json
import gc
import math
import shutil
from typing import Callable

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0.cache_policy import WAITED_MISS_COST
from mlx_edge0.checkpoint import RESIDENT_FILE, CheckpointError
from mlx_edge0.cli import main
from mlx_edge0.options import AUTO_BYPASS_MEMORY_SHARE
from mlx_edge0.prerouter_heads import PREROUTER_FILE, PrerouterHead, PrerouterSpec, init_heads, save_heads, topk_onehot
from mlx_edge0.streaming import StreamingMoE
from mlx_edge0.tensorfile import read_header

from mlx_edge0.slots import SlotBuffers
from mlx_edge0.telemetry import Stats

from conftest import FAMILIES, load_stock
from test_equivalence import greedy


@pytest.fixture
def with_heads(converted, tmp_path):
    def make(family: str):
        path = tmp_path / family
        shutil.copytree(converted(family).edge0, path)
        result = CliRunner().invoke(main, ["heads", "init", str(path)])
        assert result.exit_code == 0, result.output
        return path

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_warm_started_head_is_the_next_router_on_the_current_hidden(converted, family):
    model = mlx_edge0.load_model(converted(family).edge0)
    heads = init_heads(model)
    blocks = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, StreamingMoE)}
    layers = sorted(blocks)
    assert sorted(heads) == layers[:-1]
    g = model.edge0_section.experts
    mx.random.seed(0)
    h = mx.random.normal((2, 3, g.hidden_size))
    inds = mx.random.randint(0, g.num_experts, (2, 3, 4))
    onehot = topk_onehot(inds, g.num_experts)
    assert onehot.shape == (2, 3, g.num_experts) and onehot.sum(-1).max().item() <= 4
    for owner, head in heads.items():
        consumer = blocks[layers[layers.index(owner) + 1]]
        assert mx.array_equal(head.residual.weight, consumer.router_weight()).item()  # bit-exact
        got = head(h, onehot, topk_onehot(inds[..., ::-1] % 3, g.num_experts))
        assert mx.array_equal(got, h @ consumer.router_weight().T).item()
        # and that is the next router's own logits (exactly, up to its 8-bit matmul kernel)
        assert mx.allclose(got, consumer.router_logits(h).astype(mx.float32), atol=1e-4, rtol=1e-4).item()


def test_heads_held_transposed_keep_their_values_and_files(with_heads):
    path = with_heads("qwen3_moe")
    model = mlx_edge0.load_model(path)
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    g = section.experts
    mx.random.seed(1)
    x = mx.random.normal((1, g.hidden_size))
    on = topk_onehot(mx.array([[0, 1]]), g.num_experts)
    for head in model.edge0_runtime.heads.values():  # loaded on the CPU: held transposed
        plain = PrerouterHead(g.hidden_size, g.num_experts, g.num_experts)
        plain.load_weights([(k, mx.contiguous(v)) for k, v in tree_flatten(head.parameters())])
        assert head.fc1.weight.shape == plain.fc1.weight.shape
        assert memoryview(head.fc1.weight).strides == (4, 4 * head.fc1.weight.shape[0])  # [in, out] buffer
        assert mx.array_equal(head.fc1.weight, plain.fc1.weight).item()
        assert mx.allclose(head(x, on, on), plain(x, on, on), atol=1e-5, rtol=1e-5).item()
    before = (path / PREROUTER_FILE).read_bytes()
    save_heads(path, model.edge0_runtime.heads, spec)  # the file keeps the usual [out, in] layout
    assert (path / PREROUTER_FILE).read_bytes() == before
    # With the prerouter off the heads are validated but never read into memory.
    off = mlx_edge0.load_model(path, prerouter=False)
    assert off.stats()["resident_bytes"]["prerouter_heads"] == 0
    assert memoryview(off.edge0_runtime.heads[section.moe_layers[0]].fc1.weight).strides[1] == 4


def test_heads_init_writes_files_that_load_and_show(with_heads):
    path = with_heads("bailing_moe_v3")
    config = json.loads((path / "config.json").read_text())
    assert config["edge0"]["prerouter"] == {
        "file": PREROUTER_FILE,
        "owners": [1, 2],
        "consumers": [2, 3],
        "k": 4,
        "hidden": 512,
    }
    model = mlx_edge0.load_model(path)
    assert sorted(model.edge0_runtime.heads) == [1, 2]
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))).item()
    out = CliRunner().invoke(main, ["info", str(path)]).output
    assert "prerouter heads 2 (owners 1-2, consumers 2-3, K=4" in out


def _edit_config(path, mutate):
    config = json.loads((path / "config.json").read_text())
    mutate(config["edge0"]["prerouter"])
    (path / "config.json").write_text(json.dumps(config))


def test_mismatched_or_corrupt_heads_fail_clearly(with_heads):
    path = with_heads("qwen3_moe")
    _edit_config(path, lambda p: p.update(k=2))
    with pytest.raises(CheckpointError, match=r"prerouter\.safetensors: metadata k=4 does not match"):
        mlx_edge0.load_model(path)
    _edit_config(path, lambda p: p.update(k=4, owners=[1, 3], consumers=[2, 1]))
    with pytest.raises(CheckpointError, match="does not link consecutive MoE layers"):
        mlx_edge0.load_model(path)
    _edit_config(path, lambda p: p.update(owners=[1, 2], consumers=[2, 3]))
    assert mlx_edge0.load_model(path)  # restored

    router = path / "model.safetensors"
    original = router.read_bytes()
    entry = read_header(router).entries["model.layers.2.mlp.gate.weight"]
    changed = bytearray(original)
    changed[entry.start] ^= 0xFF  # another model: its router differs
    router.write_bytes(bytes(changed))
    with pytest.raises(CheckpointError, match="made for another model"):
        mlx_edge0.load_model(path)
    router.write_bytes(original)
    mlx_edge0.load_model(path)

    heads_file = path / PREROUTER_FILE
    heads_file.write_bytes(heads_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"prerouter\.safetensors: .*truncated"):
        mlx_edge0.load_model(path)
    heads_file.unlink()
    with pytest.raises(CheckpointError, match=r"prerouter\.safetensors: file not found"):
        mlx_edge0.load_model(path)


def test_default_spec_links_consecutive_moe_layers():
    spec = PrerouterSpec.default((1, 2, 3, 5), 8)
    assert spec.owners == (1, 2, 3) and spec.consumers == (2, 3, 5) and spec.k == 8


# ------------------------------------------------------- prediction-as-routing


class OracleHead:
    """On its k-th call (the k-th forward), returns at each position the
    consumer's true router logits at the next position (recorded from an exact
    run, one [B, L, E] per forward): a head that is always right."""

    def __init__(self, recorded: list[mx.array]):
        self.recorded = recorded
        self.calls = 0

    def parameters(self) -> dict:
        return {}

    def __call__(self, h, onehot_now, onehot_prev):
        k = self.calls
        self.calls += 1
        nxt = self.recorded[k + 1][:, :1] if k + 1 < len(self.recorded) else self.recorded[-1][:, -1:]
        return mx.concatenate([self.recorded[k][:, 1:], nxt], axis=1).astype(mx.float32)


def _prompt_ids(path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path).encode("def parse(line):\n    return")


@pytest.mark.parametrize("family", FAMILIES)
def test_prerouted_decode_stages_exactly_the_routed_set(with_heads, family):
    path = with_heads(family)
    ids = _prompt_ids(path)
    runs = []
    for _ in range(2):
        model = mlx_edge0.load_model(path)
        model.reset_stats()
        runs.append(greedy(model, ids, 200))
        s = model.stats()
        consumers = len(model.edge0_runtime.prerouting.consumer_of)
        assert s["prerouter"] is True
        # one prompt forward, then one-token forwards: every one of those is
        # prerouted on every consumer (none routed by its gate on demand)
        assert s["steps"] >= 196 and s["prerouted"] == consumers * (s["steps"] - 1)
        assert s["staged_kept"] + s["slot_rewrites"] > 0 and s["expert_loads"] > 0
    assert runs[0] == runs[1]  # deterministic


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_no_owner_predicts_stays_in_the_hot_cache(with_heads, family):
    """With the prerouter on, the first MoE layer routes with its gate and
    would wait for its reads: where the hot cache holds every expert, all its
    experts are read at load and stay; where they would take too much of a
    smaller cache to be permanent, they are held until it first evicts; in
    one too small to hold them at half its rows, nothing is read at load.
    The same numbers every way."""
    path = with_heads(family)
    ids = _prompt_ids(path)
    want = greedy(mlx_edge0.load_model(path, cache_gib=0), ids, 40)
    probe = mlx_edge0.load_model(path, cache_gib=0).edge0_runtime
    assert probe.hot is None and probe.permanent_layers == []
    n, row = probe.experts_per_layer, SlotBuffers.row_nbytes(probe.store.geometry, probe.pool_dtype)
    model = mlx_edge0.load_model(path, cache_gib=1.0)  # every expert of the tiny model
    rt = model.edge0_runtime
    first = min(rt.prerouting.consumer_of)
    assert rt.hot.capacity == n * len(rt.store.layers)  # the cache holds every expert
    assert rt.permanent_layers == [first] and first not in rt.prerouting.consumer_of.values()
    assert sorted(rt.hot.row_of) == [(first, e) for e in range(n)]
    assert greedy(model, ids, 40) == want
    assert {e for layer, e in rt.hot.row_of if layer == first} == set(range(n))
    assert rt.hot.permanent == {(first, e) for e in range(n)}
    assert rt.hot.waited == set()  # never a victim: nothing to weigh
    held = mlx_edge0.load_model(path, cache_gib=2.5 * n * row / 2**30)  # the layer is 40% of it
    hrt = held.edge0_runtime
    assert hrt.permanent_layers == [] and hrt.held_layers == [first] and hrt.hot.permanent == set()
    assert set(hrt.hot.row_of) == hrt.hot.held == {(first, e) for e in range(n)}
    assert greedy(held, ids, 40) == want
    assert hrt.hot.held == set() and hrt.telemetry.summed().held_released == n  # 2.5 layers fill it
    assert hrt.hot.waited == {(first, e) for e in range(n)}  # a use of theirs outranks a prerouted one's
    assert hrt.hot.policy.cost == dict.fromkeys(hrt.hot.waited, WAITED_MISS_COST)
    smaller = mlx_edge0.load_model(path, cache_gib=1.5 * n * row / 2**30).edge0_runtime  # 67%
    assert smaller.held_layers == smaller.permanent_layers == [] and smaller.hot.row_of == {}
    off = mlx_edge0.load_model(path, cache_gib=1.0, prerouter=False).edge0_runtime
    assert off.permanent_layers == [] and off.hot.row_of == {}  # every layer routes with its gate
    assert smaller.hot.waited == {(first, e) for e in range(n)} and off.hot.waited == set()


def test_auto_budget_counts_the_heads_and_staging_once(with_heads, monkeypatch):
    """With the page cache bypassed, "auto" sizes the hot cache against the
    memory available before the runtime held its heads and staging buffers,
    which it counts as committed: a headroom read after they are allocated
    would count them twice. Heads the prerouter does not use are never read,
    so they are not counted; without a window the prerouted layers' fills are
    the cache's, so there is no staging to count."""
    path = with_heads("qwen3_moe")
    probe = mlx_edge0.load_model(path, cache_gib=0, staged_window=3, page_cache="bypass").edge0_runtime
    n, row = probe.experts_per_layer, SlotBuffers.row_nbytes(probe.store.geometry, probe.pool_dtype)
    rows = n * len(probe.store.layers)
    resident, prompt_buffer = (path / RESIDENT_FILE).stat().st_size, n * row
    heads, window = probe.heads_nbytes(), probe.staged_nbytes(largest=True)
    assert heads > 0 and window > 0
    room = math.ceil((rows // 2 + 0.5) * row / AUTO_BYPASS_MEMORY_SHARE)  # buys half of every expert's rows
    cases = (
        ({"staged_window": 3}, resident + heads + window + prompt_buffer, heads + window),
        ({}, resident + heads + prompt_buffer, heads),  # fills of the cache's: no staging
        ({"prerouter": False}, resident + prompt_buffer, 0),
    )
    rt = None
    for options, committed, held in cases:
        rt = None  # the last case's model is freed before this one's start
        gc.collect()
        start = mx.get_active_memory()
        # A headroom that falls by what MLX allocates from here on, as a cgroup's does.
        headroom = lambda: committed + room - (mx.get_active_memory() - start)  # noqa: E731
        monkeypatch.setattr("mlx_edge0.runtime.available_memory", headroom)
        monkeypatch.setattr("mlx_edge0.options.available_memory", headroom)
        rt = mlx_edge0.load_model(path, page_cache="bypass", **options).edge0_runtime
        assert mx.get_active_memory() - start >= held  # held before the budget
        assert rt.hot.capacity == rows // 2, options
        assert rt.staged_nbytes() == held - (heads if rt.consumer_of else 0), options
    # With room for more, every expert: the cap is their size in rows (scales in the pool's dtype).
    monkeypatch.setattr("mlx_edge0.runtime.available_memory", lambda: resident + prompt_buffer + 2 * rows * row)
    assert mlx_edge0.load_model(path, page_cache="bypass", prerouter=False).edge0_runtime.hot.capacity == rows


@pytest.mark.parametrize("family", FAMILIES)
def test_prerouter_off_is_exact_and_oracle_heads_reproduce_exact(with_heads, converted, family):
    path = with_heads(family)
    ids = _prompt_ids(path)
    exact = mlx_edge0.load_model(path, prerouter=False)
    assert exact.edge0_runtime.prerouting is None
    want = greedy(load_stock(converted(family).source), ids, 40)
    recorded: dict[int, list] = {}
    for i, layer in enumerate(exact.layers):
        block = layer.mlp
        if isinstance(block, StreamingMoE):
            calls = recorded.setdefault(i, [])

            def record(x, block=block, calls=calls):
                logits = type(block).router_logits(block, x)
                calls.append(logits)
                return logits

            block.router_logits = record
    assert greedy(exact, ids, 40) == want

    model = mlx_edge0.load_model(path)
    pre = model.edge0_runtime.prerouting
    for owner, consumer in pre.consumer_of.items():
        pre.heads[owner] = OracleHead(recorded[consumer])
    model.reset_stats()
    assert greedy(model, ids, 40) == want
    s = model.stats()
    assert s["prerouted"] == len(pre.consumer_of) * (s["steps"] - 1)


def test_k_override_is_a_file_swap(with_heads):
    path = with_heads("qwen3_next")  # native K=4, heads for K=4
    with pytest.raises(CheckpointError, match="heads were made for K=4, but K=2 was asked for"):
        mlx_edge0.load_model(path, k=2)
    r = CliRunner().invoke(main, ["heads", "init", str(path), "--k", "2"])
    assert r.exit_code == 0, r.output
    with pytest.raises(CheckpointError, match="heads were made for K=2, but K=4"):
        mlx_edge0.load_model(path, k=4)
    model = mlx_edge0.load_model(path)  # the heads file sets K on the layers it predicts
    assert mlx_edge0.load_model(path, k=2, prerouter=False).edge0_runtime.k_of[2] == 2
    consumers = set(model.edge0_runtime.prerouting.consumer_of.values())
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, StreamingMoE):
            assert layer.mlp.top_k == (2 if i in consumers else 4)
    assert model.edge0_runtime.staging == {}  # the prerouted layers' fills are the hot cache's
    staging = mlx_edge0.load_model(path, cache_gib=0).edge0_runtime.staging  # a lower K holds fewer slots
    assert {layer: b.capacity for layer, b in staging.items()} == {c: 2 for c in consumers}
    model.edge0_runtime.telemetry.routing_trace = trace = []
    greedy(model, _prompt_ids(path), 20)
    s = model.stats()
    assert s["prerouted"] == len(consumers) * (s["steps"] - 1)
    assert all(len(ids) <= 4 for _, ids in trace)  # the first MoE layer keeps K=4
    info = CliRunner().invoke(main, ["info", str(path)]).output
    assert "K=2 on layers [2, 3]" in info and "K=4 on layers [1]" in info


def test_k_override_needs_heads(converted):
    with pytest.raises(ValueError, match="no prerouter heads; make them with `edge0 heads init --k 2`"):
        mlx_edge0.load_model(converted("qwen3_moe").edge0, k=2)


PROMPTS = ["def parse(line):\n    return", "import os", "class Stack:\n    def push(self, item):\n        self.items"]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prompts_equal_each_run_alone(with_heads, family):
    """Prediction state is per sequence (in the cache entries): batching
    different prompts (different lengths, so right-padded) changes nothing."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.utils import load_tokenizer

    path = with_heads(family)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    model = mlx_edge0.load_model(path)
    alone = [greedy(model, p, 24) for p in prompts]
    model.reset_stats()
    batched = batch_generate(model, tokenizer, prompts, max_tokens=24, return_token_ids=True)
    s = model.stats()
    assert s["prerouted"] > 0
    eos = set(tokenizer.eos_token_ids)
    for want, got in zip(alone, batched.token_ids):
        stop = next((i for i, t in enumerate(want) if t in eos), len(want))
        assert list(got)[:stop] == want[:stop]


def test_prediction_state_lives_in_the_cache(with_heads, tmp_path):
    from mlx_lm.models.cache import ArraysCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

    path = with_heads("qwen3_moe")
    model = mlx_edge0.load_model(path)
    cache = make_prompt_cache(model)
    assert len(cache) == len(model.layers) + 1 and isinstance(cache[-1], ArraysCache)
    model(mx.array([[5, 6, 7]]), cache=cache)
    assert cache[-1][2].tolist() == [True]  # a valid prediction after the prompt
    save_prompt_cache(str(tmp_path / "prompt.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "prompt.safetensors"))
    assert mx.array_equal(loaded[-1][1], cache[-1][1]).item()  # the stock loader carries it
    model.reset_stats()
    from_file = model(mx.array([[8]]), cache=loaded)
    assert model.stats()["prerouted"] == len(model.edge0_runtime.prerouting.consumer_of)
    model.reset_stats()
    assert mx.array_equal(model(mx.array([[8]]), cache=cache), from_file).item()
    assert model.stats()["prerouted"] == len(model.edge0_runtime.prerouting.consumer_of)
    fresh = make_prompt_cache(model)
    model.reset_stats()
    model(mx.array([[8]]), cache=fresh)  # no prediction yet: the gate routes
    assert model.stats()["prerouted"] == 0
    off = mlx_edge0.load_model(path, prerouter=False)
    assert len(make_prompt_cache(off)) == len(model.layers)
    # with the prerouter off, mlx-lm builds the stock caches and honours max_kv_size
    assert type(make_prompt_cache(off, max_kv_size=16)[0]).__name__ == "RotatingKVCache"


def _greedy_logprobs(
    model, ids: list[int], n: int, between: Callable[[int], None] = lambda step: None
) -> tuple[list[int], mx.array]:
    """Greedy tokens and log-probabilities; ``between(i)`` runs after the
    i-th token is out (between forwards)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    tokens, logprobs = [], []
    steps = generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    for i, (token, lp) in enumerate(steps):
        tokens.append(int(token))
        logprobs.append(lp)
        between(i)
    return tokens, mx.stack(logprobs)


@pytest.mark.parametrize("cache_gib", [0, 0.001], ids=["no-hot", "hot"])
def test_staged_window_computes_the_same_numbers_in_fewer_rows(cache_gib):
    """The default model has 5 prerouted layers: a window of 3 buffers serves
    them in turn, each refilled while the layers before its next user compute.
    The numbers are exactly those of one buffer per layer, alone and batched,
    and with a hot cache those of fills that are the cache's (no staging; a
    batch's plans the cache cannot pin read on demand)."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.utils import load_tokenizer

    from mlx_edge0.default_model import default_checkpoint

    path = default_checkpoint()
    tokenizer = load_tokenizer(path)
    per_layer = mlx_edge0.load_model(path, cache_gib=cache_gib)
    window = mlx_edge0.load_model(path, cache_gib=cache_gib, staged_window=3)
    rt = window.edge0_runtime
    assert len(rt.prerouting.consumer_of) == 5 and rt.staging == {} and len(rt.window) == 3
    staged = per_layer.stats()["resident_bytes"]["staged"]
    if cache_gib:
        assert per_layer.edge0_runtime.cache_fills and staged == 0
    else:
        assert window.stats()["resident_bytes"]["staged"] * 5 == staged * 3
    ids = tokenizer.encode(PROMPTS[2])
    want = _greedy_logprobs(per_layer, ids, 48)
    window.reset_stats()
    got = _greedy_logprobs(window, ids, 48)
    assert got[0] == want[0] and mx.array_equal(got[1], want[1]).item()
    s = window.stats()
    assert s["prerouted"] == 5 * (s["steps"] - 1)  # one prompt forward, then all prerouted
    consumers = sorted(rt.prerouting.consumer_of.values())  # buffers 0, 1 last served the 4th and 5th
    assert [b.layer for b in rt.window] == [consumers[3], consumers[4], consumers[2]]

    prompts = [tokenizer.encode(p) for p in PROMPTS]  # a batch: unions larger than K grow the buffers
    batched = [batch_generate(m, tokenizer, prompts, max_tokens=16, return_token_ids=True).token_ids
               for m in (per_layer, window)]  # fmt: skip
    assert [list(t) for t in batched[0]] == [list(t) for t in batched[1]]


def test_staged_window_with_fewer_prerouted_layers_is_one_buffer_each(with_heads):
    path = with_heads("qwen3_next")  # 2 prerouted layers
    model = mlx_edge0.load_model(path, staged_window=4)
    assert len(model.edge0_runtime.window) == 2
    assert greedy(model, _prompt_ids(path), 20) == greedy(mlx_edge0.load_model(path), _prompt_ids(path), 20)


def test_an_auto_window_computes_the_same_numbers_and_grows_after_steps_that_waited():
    """``staged_window="auto"`` starts at 3 buffers and doubles after a step
    whose prerouted layers waited more than 5% of it, up to one per prerouted
    layer: whatever its depth, the numbers are those of 0 and of 3 buffers.
    The hot cache was sized against the largest window from the start."""
    from mlx_lm.utils import load_tokenizer

    from mlx_edge0.default_model import default_checkpoint

    path = default_checkpoint()
    ids = load_tokenizer(path).encode(PROMPTS[0])
    per_layer = mlx_edge0.load_model(path, cache_gib=0)
    want = _greedy_logprobs(per_layer, ids, 24)
    three = _greedy_logprobs(mlx_edge0.load_model(path, cache_gib=0, staged_window=3), ids, 24)
    assert three[0] == want[0] and mx.array_equal(three[1], want[1]).item()

    auto = mlx_edge0.load_model(path, cache_gib=0, staged_window="auto")
    rt = auto.edge0_runtime
    largest = per_layer.edge0_runtime.staged_nbytes()
    assert len(rt.window) == 3 and rt.window_limit == 5 and rt.staging == {}
    assert auto.stats()["staged_window"] == 3 and auto.stats()["resident_bytes"]["staged"] * 5 == largest * 3
    assert rt.staged_nbytes(largest=True) == largest
    stalled = Stats(steps=1, prerouted=5, prerouted_wait_s=0.2, step_s=1.0)  # waited 20% of the step
    depths = []  # the window's depth after each token is out

    def stall(step: int) -> None:
        if step in (5, 11, 17):
            rt.adapt_window(stalled)
        depths.append(len(rt.window))

    got = _greedy_logprobs(auto, ids, 24, between=stall)
    assert got[0] == want[0] and mx.array_equal(got[1], want[1]).item()
    # A step that really waited over 5% of its time (a loaded machine) grows
    # the window before the forced stall does: it is 3 or 5 until token 5,
    # then 5 (3 doubled, capped at one buffer per prerouted layer), and never shrinks.
    assert depths == sorted(depths) and set(depths[:5]) <= {3, 5} and depths[5:] == [5] * 19
    assert len(rt.window) == 5
    assert rt.prerouting.window is rt.window  # one list of the window's buffers, grown in one place
    assert auto.stats()["staged_window"] == 5 and auto.stats()["resident_bytes"]["staged"] == largest
    assert rt.staged_nbytes(largest=True) == largest
    s = auto.stats()
    assert s["prerouted"] == 5 * (s["steps"] - 1) and s["step_ms"] > 0 and s["prerouted_wait_ms"] >= 0
    assert rt.adapt_window(stalled) == 5  # no further: that is every prerouted layer's buffer
    fixed = mlx_edge0.load_model(path, cache_gib=0, staged_window=3).edge0_runtime
    assert fixed.adapt_window(stalled) == 3  # a set window never changes

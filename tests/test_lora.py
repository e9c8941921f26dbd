"""Unmerged LoRA: targets, zero-B identity, file round trip, auto-load, errors."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.tuner.utils import load_adapters as mlx_lm_load_adapters

from mlx_edge0 import load, load_model, lora
from mlx_edge0.checkpoint import CheckpointError
from mlx_edge0.info import describe, format_description
from mlx_edge0.lora import ADAPTER_CONFIG_FILE, ADAPTERS_FILE

from conftest import FAMILIES
from test_student import copy_with_heads

TOKENS = mx.array([[5, 60, 70, 300, 20, 11, 400, 9, 33, 17]])
KINDS = {
    "qwen3_moe": {"attention", "dense_mlp"},
    "qwen3_next": {"attention", "linear_attention", "shared_expert", "dense_mlp"},
    "qwen3_5_moe": {"attention", "linear_attention", "shared_expert"},
    "bailing_moe": {"attention", "shared_expert", "dense_mlp"},
    "bailing_moe_v3": {"attention", "linear_attention", "shared_expert", "dense_mlp"},
}


def _greedy(model, n: int = 12) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for (t, _), _ in zip(generate_step(TOKENS[0], model, max_tokens=n), range(n))]


def _trained_like(model, seed: int = 3) -> None:
    """Attach adapters whose B is non-zero (as after training)."""
    mx.random.seed(seed)
    lora.attach(model, tuple(lora.lora_targets(model)))
    for m in lora.lora_modules(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    mx.eval(model.parameters())


@pytest.fixture
def with_adapters(converted, tmp_path):
    """A checkpoint copy with heads and saved adapters -> (path, logits with them, logits without)."""

    def make(family: str):
        path = copy_with_heads(converted, tmp_path, family)
        model = load_model(path, cache_gib=0)
        base = model(TOKENS)
        _trained_like(model)
        adapted = model(TOKENS)
        lora.save_adapters(path, model, path, lora.consumer_k(model))
        return path, adapted, base

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_targets_are_resident_projections_never_routers_or_experts(converted, family):
    model = load_model(converted(family).edge0, cache_gib=0)
    targets = lora.lora_targets(model)
    assert set(targets.values()) == KINDS[family]
    modules = dict(model.named_modules())
    routers = {
        id(m) for layer in model.edge0_section.moe_layers for _, m in model.layers[layer].mlp.gate.named_modules()
    }
    for path in targets:
        assert id(modules[path]) not in routers
        assert "switch_mlp" not in path and ".mlp.experts." not in path and not path.endswith("_gate")


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_b_changes_nothing(converted, family):
    model = load_model(converted(family).edge0, cache_gib=0)
    logits, tokens = model(TOKENS), _greedy(model)
    lora.attach(model, tuple(lora.lora_targets(model)))
    assert lora.lora_modules(model)
    assert mx.array_equal(model(TOKENS), logits)
    assert _greedy(model) == tokens


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "bailing_moe_v3"])
def test_adapters_round_trip_and_load_automatically(with_adapters, family):
    path, adapted, base = with_adapters(family)
    assert mx.abs(adapted - base).max().item() > 0.1
    model = load_model(path, cache_gib=0)
    assert model.edge0_adapters is not None
    assert mx.array_equal(model(TOKENS), adapted)
    off = load_model(path, cache_gib=0, lora=False)
    assert not lora.lora_modules(off)
    assert mx.array_equal(off(TOKENS), base)
    lora.apply_adapters(off, path)
    assert mx.array_equal(off(TOKENS), adapted)
    # mlx-lm's own adapter loader reads the same files the same way
    stock_way = load_model(path, cache_gib=0, lora=False)
    mlx_lm_load_adapters(stock_way, str(path))
    assert mx.array_equal(stock_way(TOKENS), adapted)


def test_load_with_tokenizer_and_serving_never_merges(with_adapters):
    path, adapted, _ = with_adapters("qwen3_next")
    model, tokenizer = load(path, cache_gib=0)
    assert mx.array_equal(model(TOKENS), adapted)
    modules = lora.lora_modules(model)
    assert modules and all(isinstance(m.linear, type(next(iter(modules.values())).linear)) for m in modules.values())
    assert all(m.linear.weight.dtype == mx.uint32 for m in modules.values())  # int4 base, delta beside it
    with_lora, without = _greedy(model, 16), _greedy(load_model(path, cache_gib=0, lora=False), 16)
    assert with_lora != without


def test_info_describes_adapters(with_adapters):
    path, _, _ = with_adapters("bailing_moe")
    d = describe(path)
    a = d["adapters"]
    assert a["rank"] == lora.RANK and a["alpha"] == lora.ALPHA and a["scale"] == lora.ALPHA / lora.RANK
    assert a["targets"] == sum(a["kinds"].values()) == len(lora.lora_targets(load_model(path, lora=False)))
    assert a["bytes"] == (path / ADAPTERS_FILE).stat().st_size - _header_bytes(path / ADAPTERS_FILE)
    assert f"r=16 alpha=32 on {a['targets']} projections" in format_description(d)


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _edit(path, mutate):
    config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    mutate(config)
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))


def _set(section_key, value):
    return lambda c: c["edge0"].__setitem__(section_key, value)


BAD = [
    ("config missing", lambda p: (p / ADAPTER_CONFIG_FILE).unlink(), ADAPTER_CONFIG_FILE, "missing"),
    ("tensors missing", lambda p: (p / ADAPTERS_FILE).unlink(), ADAPTERS_FILE, "missing"),
    ("not json", lambda p: (p / ADAPTER_CONFIG_FILE).write_text("{"), ADAPTER_CONFIG_FILE, "not a valid"),
    ("format", lambda p: _edit(p, _set("format", "peft")), ADAPTER_CONFIG_FILE, "not an edge0 adapter"),
    (
        "router target",
        lambda p: _edit(p, lambda c: c["edge0"]["targets"].append("model.layers.1.mlp.gate")),
        ADAPTER_CONFIG_FILE,
        "not a LoRA target",
    ),
    ("other model", lambda p: _edit(p, _set("source_hash", "0" * 64)), ADAPTER_CONFIG_FILE, "another model"),
    ("K", lambda p: _edit(p, _set("k", 2)), ADAPTER_CONFIG_FILE, "K=2"),
    (
        "rank",
        lambda p: _edit(p, lambda c: c["lora_parameters"].__setitem__("rank", 8)),
        ADAPTERS_FILE,
        "expected a float tensor of shape",
    ),
    (
        "tensor set",
        lambda p: mx.save_safetensors(
            str(p / ADAPTERS_FILE), {k: v for k, v in list(mx.load(str(p / ADAPTERS_FILE)).items())[1:]}
        ),
        ADAPTERS_FILE,
        "do not match",
    ),
    (
        "truncated",
        lambda p: (p / ADAPTERS_FILE).write_bytes((p / ADAPTERS_FILE).read_bytes()[:200]),
        ADAPTERS_FILE,
        "truncated",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_adapter_files_fail_clearly(with_adapters, case):
    _, mutate, file, message = case
    path, _, _ = with_adapters("qwen3_moe")
    mutate(path)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(path, cache_gib=0)
    assert str(path / file) in str(e.value)
    with pytest.raises(CheckpointError, match=message):
        describe(path)
    if case[0] != "truncated":  # --no-lora never reads them
        assert not lora.lora_modules(load_model(path, cache_gib=0, lora=False))


def test_generate_no_lora_flag(with_adapters):
    from click.testing import CliRunner

    from mlx_edge0.cli import main

    path, _, _ = with_adapters("qwen3_moe")

    def text(*flags):
        result = CliRunner().invoke(
            main, ["generate", "--model", str(path), "-m", "12", "--cache-gib", "0", *flags], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        return result.stdout

    with_lora, without = text(), text("--no-lora")
    assert with_lora != without
    for name in (ADAPTERS_FILE, ADAPTER_CONFIG_FILE):
        (path / name).unlink()
    assert text() == without

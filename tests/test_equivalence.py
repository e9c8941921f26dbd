"""Exact path == stock mlx-lm, for every supported family.

Same int4 weights, same compute dtype (float32) on both sides: greedy tokens
must be identical for 64 tokens and logits equal within float tolerance,
whether loaded with ``mlx_edge0.load`` or run by stock ``mlx_lm generate``
with ``--trust-remote-code`` in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.streaming import StreamingMoE

from conftest import FAMILIES, load_stock

PROMPT = "def fibonacci(n):\n    if n < 2:"
N_TOKENS = 64


def greedy(model, prompt_ids, n=N_TOKENS):
    tokens = []
    for tok, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n, prompt_cache=make_prompt_cache(model)):
        tokens.append(int(tok))
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_logits_equal_stock(converted, family):
    c = converted(family)
    model, tokenizer = mlx_edge0.load(c.edge0)
    stock = load_stock(c.source)
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, StreamingMoE)]
    assert len(moe) == len(model.edge0_section.moe_layers) > 0
    ids = tokenizer.encode(PROMPT)

    x = mx.array([ids])
    a, b = stock(x), model(x)
    assert a.dtype == b.dtype == mx.float32
    assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()

    want = greedy(stock, ids)
    model.reset_stats()
    got = greedy(model, ids)
    assert got == want
    assert len(set(want)) > 1  # not a degenerate repeat of one token
    stats = model.stats()
    assert stats["expert_loads"] >= N_TOKENS * len(moe)


@pytest.mark.parametrize("family", ["qwen3_moe", "bailing_moe_v3"])
def test_batch_decode_equals_single(converted, family):
    """B>1 (as mlx_lm.server batches): the union of the batch's experts is read,
    each row gets exactly its own routing."""
    c = converted(family)
    model = mlx_edge0.load_model(c.edge0)
    stock = load_stock(c.source)
    x = mx.array([[5, 17, 99, 3, 250, 7], [400, 2, 2, 81, 9, 64]])
    a, b = stock(x), model(x)
    assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()
    single = mx.concatenate([model(x[:1]), model(x[1:])], axis=0)
    assert mx.allclose(single, b, atol=1e-5, rtol=1e-5).item()


def test_native_dtype_matches_stock_bf16(converted):
    c = converted("qwen3_next")
    model = mlx_edge0.load_model(c.edge0, compute_dtype="native")
    stock = load_stock(c.source, dtype=mx.bfloat16)
    x = mx.array([[5, 17, 99, 3, 250, 7]])
    a, b = stock(x), model(x)
    assert a.dtype == b.dtype == mx.bfloat16
    assert mx.array_equal(a, b).item()


def _edge0_text_via_mlx_lm(path, prompt, n):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(path),
            "--trust-remote-code",
            "--prompt",
            prompt,
            "--max-tokens",
            str(n),
            "--ignore-chat-template",
            "--temp",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("==========")[1].strip("\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_mlx_lm_generate_cli(converted, family):
    c = converted(family)
    stock = load_stock(c.source)
    _, tokenizer = mlx_edge0.load(c.edge0)
    ids = tokenizer.encode(PROMPT)
    tokens = greedy(stock, ids)
    stop = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
    want = tokenizer.decode(tokens[: stop[0]] if stop else tokens)
    got = _edge0_text_via_mlx_lm(c.edge0, PROMPT, N_TOKENS)
    assert got.strip() == want.strip()


def test_trust_remote_code_is_required(converted):
    c = converted("qwen3_moe")
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(c.edge0), "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "trust_remote_code" in out.stderr or "trust-remote-code" in out.stderr
    assert "edge0_model.py" in out.stderr

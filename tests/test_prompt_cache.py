"""Prompt caches with prerouter heads: a prompt continued from a saved cache
gives what the whole prompt gives, however the tokens were split into
forwards (``mlx_lm cache_prompt`` + ``generate --prompt-cache-file``, and
``save_prompt_cache``/``load_prompt_cache`` with ``generate_step``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_tokenizer

import mlx_edge0
from mlx_edge0.prerouter_heads import PrerouterSpec, init_heads, save_heads

# The split point keeps the tokens of PREFIX + REST those of PREFIX then REST
# (with the tiny tokenizer and its chat template, as mlx_lm's commands build them).
PREFIX = 'def parse(line):\n    return line.split(",")'
REST = "\n\nclass Stack:\n    def push(self, item):\n        self.items.append(item)\n"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def trained_heads(converted, tmp_path_factory) -> Path:
    """qwen3_next with heads whose predictions differ from the gates (as after
    training): how a token is routed then shows in the logits."""
    path = tmp_path_factory.mktemp("prompt-cache") / "ckpt"
    shutil.copytree(converted("qwen3_next").edge0, path)
    model = mlx_edge0.load_model(path, prerouter=False)
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    heads = init_heads(model, spec)
    mx.random.seed(1)
    for head in heads.values():
        head.fc2.weight = mx.random.normal(head.fc2.weight.shape)
    save_heads(path, heads, spec)
    return path


def _mlx_lm(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mlx_lm", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_cache_prompt_then_generate_equals_the_whole_prompt(trained_heads, tmp_path):
    model = str(trained_heads)
    cache_file = str(tmp_path / "prefix.safetensors")
    common = ["--model", model, "--trust-remote-code"]
    generate = ["generate", *common, "--max-tokens", str(MAX_TOKENS), "--temp", "0", "--verbose", "False"]
    _mlx_lm("cache_prompt", *common, "--prompt", PREFIX, "--prompt-cache-file", cache_file)
    cached = _mlx_lm(*generate, "--prompt-cache-file", cache_file, "--prompt", REST)
    whole = _mlx_lm(*generate, "--prompt", PREFIX + REST)
    assert cached == whole and len(whole) > MAX_TOKENS


def _steps(model, ids: list[int], cache: list, n: int = MAX_TOKENS, **kwargs) -> tuple[list[int], mx.array]:
    steps = list(generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache, **kwargs))
    return [int(t) for t, _ in steps], mx.stack([lp for _, lp in steps])


@pytest.mark.parametrize("split", [1, 2, 9, -2, -1])
def test_saved_prompt_cache_gives_the_same_logprobs(trained_heads, tmp_path, split):
    """Bit for bit, for any split point (one-token prefixes and rests included)."""
    model = mlx_edge0.load_model(trained_heads)
    ids = load_tokenizer(trained_heads).encode(PREFIX + REST)
    want_tokens, want = _steps(model, ids, make_prompt_cache(model))
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(ids[:split]), model, max_tokens=0, prompt_cache=cache):
        pass
    save_prompt_cache(str(tmp_path / "prefix.safetensors"), cache)
    tokens, got = _steps(model, ids[split:], load_prompt_cache(str(tmp_path / "prefix.safetensors")))
    assert tokens == want_tokens
    assert mx.array_equal(got, want).item()


def test_prefill_chunking_does_not_change_the_logprobs(trained_heads):
    model = mlx_edge0.load_model(trained_heads)
    ids = load_tokenizer(trained_heads).encode(PREFIX + REST)
    _, want = _steps(model, ids, make_prompt_cache(model), n=8)
    for step in (1, 3):
        _, got = _steps(model, ids, make_prompt_cache(model), n=8, prefill_step_size=step)
        assert mx.array_equal(got, want).item(), step

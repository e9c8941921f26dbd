"""The student-path (whole-sequence) training forward computes what serving
computes when the same tokens are decoded one by one with the prerouter on."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_edge0 import load_model, lora
from mlx_edge0.prerouter_heads import PrerouterSpec, init_heads, save_heads
from mlx_edge0.train.student import StudentPath

from conftest import FAMILIES

TEXT = "def parse(line):\n    return line.strip().split(',')\n\nclass Stack:\n    def push(self, item):"
TOLERANCE = 1e-4


def copy_with_heads(converted, tmp_path, family: str):
    """A copy of the family's tiny checkpoint with warm-started heads."""
    path = tmp_path / family
    shutil.copytree(converted(family).edge0, path)
    add_heads(path)
    return path


@pytest.fixture
def with_heads(converted, tmp_path):
    return lambda family: copy_with_heads(converted, tmp_path, family)


def add_heads(path) -> None:
    """What ``edge0 heads init`` writes: warm-started heads."""
    model = load_model(path, cache_gib=0, prerouter=False)
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    save_heads(path, init_heads(model, spec), spec)


def _tokens(path, n: int = 32) -> mx.array:
    return mx.array(load_tokenizer(path).encode(TEXT)[:n])[None]


def _random_lora(model, seed: int = 1) -> None:
    """Adapters with non-zero B, so both paths must carry the LoRA delta."""
    mx.random.seed(seed)
    lora.attach(model, tuple(lora.lora_targets(model)))
    for m in lora.lora_modules(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05


def _served(model, tokens: mx.array, prefill: int = 0) -> mx.array:
    """Logits of step-by-step decoding (after an optional prefill chunk), one
    forward per token through the model's own cache, evaluated every step as
    a generation loop does."""
    cache = model.make_cache()
    outs = []
    if prefill:
        outs.append(model(tokens[:, :prefill], cache=cache))
        mx.eval(outs[-1])
    for t in range(prefill, tokens.shape[1]):
        outs.append(model(tokens[:, t : t + 1], cache=cache))
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_student_forward_equals_step_by_step_prerouted_decoding(with_heads, family):
    path = with_heads(family)
    model = load_model(path, cache_gib=0)
    _random_lora(model)
    tokens = _tokens(path)
    student = StudentPath(model)
    for prefill in (0, 7):  # a prompt chunk routes with the predictions too
        model.reset_stats()
        served = _served(model, tokens, prefill)
        assert model.stats()["prerouted"] > 0  # the consumers did route with predictions
        parallel = student(tokens, gate_positions=1)
        assert mx.abs(parallel - served).max().item() < TOLERANCE
    # the predictions change the routing, so a forward that ignored them could not pass
    exact = StudentPath(model, heads={})(tokens)
    assert mx.abs(exact - served).max().item() > 100 * TOLERANCE


def test_student_forward_matches_generate_step_convention(with_heads):
    """generate_step prefills P-1 prompt tokens and decodes the rest; prompt
    chunks route with the predictions too, so with gate_positions=1 the
    parallel forward's argmax is each generated token."""
    path = with_heads("qwen3_next")
    model = load_model(path, cache_gib=0)
    prompt = _tokens(path, 9)[0]
    generated = [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=12), range(12))]
    tokens = mx.concatenate([prompt, mx.array(generated)])[None]
    logits = StudentPath(model)(tokens[:, :-1], gate_positions=1)
    assert logits[0, prompt.size - 1 :].argmax(axis=-1).tolist() == generated


def test_batched_decode_equals_student_rows(with_heads):
    path = with_heads("qwen3_moe")
    model = load_model(path, cache_gib=0)
    tokens = mx.concatenate([_tokens(path, 20), _tokens(path, 21)[:, 1:]], axis=0)
    served = _served(model, tokens)
    parallel = StudentPath(model)(tokens)
    assert mx.abs(parallel - served).max().item() < TOLERANCE


def test_recorded_trace_and_bad_gate_positions(with_heads):
    path = with_heads("bailing_moe")
    model = load_model(path, cache_gib=0)
    tokens = _tokens(path, 16)
    student = StudentPath(model)
    student(tokens, record=True)
    section = model.edge0_section
    assert sorted(student.trace) == list(section.moe_layers)
    for layer, trace in student.trace.items():
        assert trace.x.shape == (1, 16, section.experts.hidden_size)
        assert trace.gate_logits.shape == (1, 16, section.experts.num_experts)
        assert trace.inds.shape == (1, 16, section.num_experts_per_tok)
    first, consumer = section.moe_layers[0], section.moe_layers[1]
    gate_inds = model.layers[first].mlp.route(student.trace[first].gate_logits)[0]
    assert mx.array_equal(mx.sort(gate_inds, -1), mx.sort(student.trace[first].inds, -1))
    routed = mx.sort(student.trace[consumer].inds, -1)
    by_gate = mx.sort(model.layers[consumer].mlp.route(student.trace[consumer].gate_logits)[0], -1)
    assert mx.array_equal(routed[:, 0], by_gate[:, 0])  # position 0 routes with the gate
    with pytest.raises(ValueError, match="gate_positions"):
        student(tokens, gate_positions=0)

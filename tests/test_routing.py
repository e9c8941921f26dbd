"""Routing math vs the stock mlx-lm block classes: identical indices and weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import bailing_moe, bailing_moe_v3, qwen3_moe, qwen3_next

from mlx_edge0 import tiny
from mlx_edge0.routing import group_select, sigmoid_group, softmax_topk


class _Spy(nn.Module):
    """Stands in for SwitchGLU: records indices, returns one-hot rows so the
    block's weighted sum over K puts weight k into output column k."""

    def __call__(self, x, inds):
        self.inds = inds
        k = inds.shape[-1]
        eye = mx.eye(k, x.shape[-1], dtype=x.dtype)
        return mx.broadcast_to(eye, (*inds.shape, x.shape[-1]))


class _Zero(nn.Module):
    def __call__(self, x):
        return mx.zeros_like(x)


def _args(module, model_type):
    config = tiny.tiny_config(model_type)
    return module.ModelArgs.from_dict(config)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_softmax_topk_matches_stock(family, dtype):
    mx.random.seed(1)
    if family == "qwen3_moe":
        block = qwen3_moe.Qwen3MoeSparseMoeBlock(_args(qwen3_moe, "qwen3_moe"))
    else:
        block = qwen3_next.Qwen3NextSparseMoeBlock(_args(qwen3_next, "qwen3_next"))
        block.shared_expert = _Zero()
    block.gate.weight = mx.random.normal(block.gate.weight.shape) * 2
    block.switch_mlp = _Spy()
    block.set_dtype(dtype)
    x = mx.random.normal((3, 7, block.gate.weight.shape[1])).astype(dtype)
    y = block(x)
    k = block.top_k
    inds, scores = softmax_topk(block.gate(x), k, block.norm_topk_prob)
    assert mx.array_equal(inds, block.switch_mlp.inds).item()
    assert mx.array_equal(scores.astype(y.dtype), y[..., :k]).item()
    assert mx.all(y[..., k:] == 0).item()
    # the weights really are a top-k softmax
    full = mx.softmax(block.gate(x).astype(mx.float32), axis=-1)
    assert mx.all(mx.take_along_axis(full, inds, -1).min(-1) >= mx.sort(full, -1)[..., -k]).item()


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_group_select_matches_bailing_moe_gate(score_function):
    mx.random.seed(2)
    config = tiny.tiny_config("bailing_moe")
    config["score_function"] = score_function
    gate = bailing_moe.BailingMoeGate(bailing_moe.ModelArgs.from_dict(config))
    gate.gate_proj.weight = mx.random.normal(gate.gate_proj.weight.shape)
    gate.expert_bias = mx.random.normal(gate.expert_bias.shape) * 0.1
    x = mx.random.normal((2, 9, config["hidden_size"]))
    want_inds, want_scores = gate(x)
    inds, scores = group_select(
        gate.gate_proj(x),
        gate.expert_bias,
        gate.top_k,
        gate.n_group,
        gate.topk_group,
        gate.routed_scaling_factor,
        gate.norm_topk_prob,
        gate.score_function,
    )
    assert mx.array_equal(inds, want_inds).item()
    assert mx.array_equal(scores, want_scores).item()
    assert inds.shape == (2, 9, gate.top_k)


def test_sigmoid_group_matches_bailing_v3_gate():
    mx.random.seed(3)
    args = _args(bailing_moe_v3, "bailing_moe_v3")
    gate = bailing_moe_v3.BailingGate(args)
    gate.weight = mx.random.normal(gate.weight.shape)
    gate.expert_bias = mx.random.normal(gate.expert_bias.shape) * 0.1
    x = mx.random.normal((4, 5, args.hidden_size))
    want_inds, want_scores = gate(x)
    logits = x.astype(mx.float32) @ gate.weight.astype(mx.float32).T
    inds, scores = sigmoid_group(
        logits,
        gate.expert_bias,
        gate.top_k,
        gate.n_group,
        gate.topk_group,
        gate.routed_scaling_factor,
    )
    assert mx.array_equal(inds, want_inds).item()
    assert mx.array_equal(scores, want_scores).item()
    # selected experts come from topk_group groups only
    group = inds // (args.num_experts // args.n_group)
    for row in group.reshape(-1, gate.top_k).tolist():
        assert len(set(row)) <= gate.topk_group

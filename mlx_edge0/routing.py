"""Routing math: router logits -> (expert indices, combine weights).

These are the stock mlx-lm blocks' routing functions, op for op, so that the
same logits give the same indices and weights bit for bit (tests compare them
with the stock block classes). The prerouter feeds *predicted* logits through
the very same functions, which is why routing lives apart from any gate.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx


def softmax_topk(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE: top-k of a precise softmax."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


@partial(mx.compile)
def group_select(
    logits: mx.array,
    expert_bias: Optional[mx.array],
    k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
    normalize: bool,
    score_function: str,
) -> tuple[mx.array, mx.array]:
    """Ling / bailing_moe: grouped selection on (bias-corrected) scores.

    Groups outside the best ``topk_group`` (by the sum of their top-2) are
    zeroed before the top-k; weights come from the uncorrected scores. Compiled
    like the stock function so fused kernels round identically.
    """
    in_type = logits.dtype
    if score_function == "sigmoid":
        scores = mx.sigmoid(logits.astype(mx.float32))
    else:
        scores = mx.softmax(logits.astype(mx.float32), axis=-1)
    orig_scores = scores
    if expert_bias is not None:
        scores = scores + expert_bias
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0, scores.dtype), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(scores, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if k > 1 and normalize:
        scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    scores = scores * scaling
    return inds, scores.astype(in_type)


def sigmoid_group(
    logits: mx.array,
    expert_bias: mx.array,
    k: int,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> tuple[mx.array, mx.array]:
    """Ling 3.0 / bailing_moe_v3: sigmoid scores, bias for selection only.

    Groups outside the best ``topk_group`` are masked to -inf; weights are the
    selected sigmoid scores renormalised and scaled (float32).
    """
    scores = mx.sigmoid(logits.astype(mx.float32))
    routing = mx.unflatten(scores + expert_bias, axis=-1, shape=(n_group, -1))
    group_scores = mx.topk(routing, 2, axis=-1).sum(axis=-1, keepdims=True)
    drop = n_group - topk_group
    group_idx = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
    routing = mx.put_along_axis(routing, mx.stop_gradient(group_idx), mx.array(float("-inf")), axis=-2)
    routing = mx.flatten(routing, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-routing, kth=k - 1, axis=-1)[..., :k])
    selected = mx.take_along_axis(scores, inds, axis=-1)
    selected = selected / (selected.sum(axis=-1, keepdims=True) + 1e-20)
    return inds, selected * scaling

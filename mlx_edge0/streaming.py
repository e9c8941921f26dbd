"""The streaming MoE block: a stock mlx-lm MoE block whose routed experts live on disk.

Invariant: for the same input, a streaming block returns what the stock block
returns (bit for bit on the exact path): routing is the stock routing math
(:mod:`mlx_edge0.routing`), the experts are the same int4 tensors run through
the same ``gather_qmm`` calls (:func:`mlx_edge0.expert_math.expert_glu`), and
the shared expert is the stock module itself.

Each family in ``model_patches`` subclasses :class:`StreamingMoE` and says
three things: how the router logits are computed, which routing math applies,
and what the shared expert adds. The block's input is the decoder layer's
post-attention-norm output (every supported family calls
``mlp(post_attention_layernorm(h))``), which the prerouter reads.

A block routes itself, as the stock block does (router logits -> routing
math -> indices and scores), then asks its :class:`ExpertSource` for the
experts and mixes them. The source may hand it a routing decided ahead (a
prerouted decode step's :class:`~mlx_edge0.prerouting.Plan`) instead; it
never calls back into the block.
"""

from __future__ import annotations

from typing import Optional, Protocol

import mlx.core as mx
import mlx.nn as nn

from .prerouting import Plan


class ExpertSource(Protocol):
    """What a streaming block asks, in this order, once per call (x: [B, L, D])."""

    def begin(self, layer: int, x: mx.array) -> Optional[Plan]:
        """This call's routing when it is decided ahead, else None."""

    def mix(
        self, layer: int, x: mx.array, logits: mx.array, inds: mx.array, scores: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The routing of a call without a plan, given its gate's logits
        ``[B, L, E]`` and routing ``[B, L, K]`` (e.g. predicted positions of
        a prompt chunk take the prediction)."""

    def experts(self, layer: int, x: mx.array, inds: mx.array, plan: Optional[Plan]) -> mx.array:
        """The routed experts' outputs ``[B, L, K, D]``, before the scores."""


def dense_weight(linear: nn.Module) -> mx.array:
    """float32 weight of a Linear or QuantizedLinear (a router, or a LoRA base)."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.biases,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        ).astype(mx.float32)
    return linear.weight.astype(mx.float32)


class StreamingMoE(nn.Module):
    """Routed experts served by an :class:`ExpertSource` (the model's
    :class:`~mlx_edge0.runtime.StreamingRuntime`).

    Subclasses keep the stock block's router and shared-expert modules under
    their stock attribute names, so the resident weights load unchanged.
    """

    def __init__(self, layer: int, source: ExpertSource, num_experts_per_tok: int):
        super().__init__()
        self.layer = layer
        self.source = source
        self.top_k = num_experts_per_tok

    def router_logits(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def router_weight(self) -> mx.array:
        """The router as a dense float32 ``[num_experts, D]`` matrix (the
        prerouter's warm start)."""
        raise NotImplementedError

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def shared(self, x: mx.array) -> Optional[mx.array]:
        return None

    def __call__(self, x: mx.array) -> mx.array:
        # x: [B, L, D]; logits: [B, L, E]; inds, scores: [B, L, K]; y: [B, L, K, D]
        source, layer = self.source, self.layer
        plan = source.begin(layer, x)
        if plan is None:
            logits = self.router_logits(x)
            inds, scores = source.mix(layer, x, logits, *self.route(logits))
        else:
            inds, scores = plan.inds, plan.scores
        y = source.experts(layer, x, inds, plan)
        y = (y * scores[..., None]).sum(axis=-2).astype(x.dtype)
        shared = self.shared(x)
        return y if shared is None else y + shared

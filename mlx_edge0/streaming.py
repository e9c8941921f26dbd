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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from .runtime import StreamingRuntime


def dense_weight(linear: nn.Module) -> mx.array:
    """float32 weight of a Linear or (8-bit) QuantizedLinear router."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.biases,
            group_size=linear.group_size,
            bits=linear.bits,
        ).astype(mx.float32)
    return linear.weight.astype(mx.float32)


class StreamingMoE(nn.Module):
    """Routed experts served by the model's :class:`StreamingRuntime`.

    Subclasses keep the stock block's router and shared-expert modules under
    their stock attribute names, so the resident weights load unchanged.
    """

    def __init__(self, layer: int, runtime: "StreamingRuntime", num_experts_per_tok: int):
        super().__init__()
        self.layer = layer
        self.runtime = runtime
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
        # x: [B, L, D]; inds, scores: [B, L, K]
        inds, scores, y = self.runtime.routed_experts(self, x)  # y: [B, L, K, D]
        y = (y * scores[..., None]).sum(axis=-2).astype(x.dtype)
        shared = self.shared(x)
        return y if shared is None else y + shared

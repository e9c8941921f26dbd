"""Ling (mlx-lm ``bailing_moe`` and ``bailing_moe_v3``).

bailing_moe: ``BailingMoeGate`` (``gate.gate_proj`` + optional
``gate.expert_bias``) with grouped selection, optional shared experts.
bailing_moe_v3: ``BailingGate`` (raw ``gate.weight``, float32 logits,
sigmoid + expert_bias for selection only, -inf group masking), one shared MLP.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import bailing_moe, bailing_moe_v3

from ..model import Edge0Model
from ..routing import group_select, sigmoid_group
from ..streaming import StreamingMoE, dense_weight

SHARED_EXPERTS = {f"mlp.shared_experts.{p}": "shared_expert" for p in ("gate_proj", "up_proj", "down_proj")}
DENSE_MLP = {f"mlp.{p}": "dense_mlp" for p in ("gate_proj", "up_proj", "down_proj")}
VOCAB = ("model.word_embeddings", "lm_head")


class BailingMoeStreamingBlock(StreamingMoE):
    """Replaces ``BailingMoeSparseMoeBlock``; keeps gate and shared experts."""

    @classmethod
    def from_stock(cls, block: bailing_moe.BailingMoeSparseMoeBlock, **kwargs) -> "BailingMoeStreamingBlock":
        self = cls(**kwargs)
        self.gate = block.gate
        self.shared_experts = block.shared_experts
        return self

    def router_logits(self, x: mx.array) -> mx.array:
        return self.gate.gate_proj(x)

    def router_weight(self) -> mx.array:
        return dense_weight(self.gate.gate_proj)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        g = self.gate
        return group_select(
            logits,
            g.expert_bias,
            self.top_k,
            g.n_group,
            g.topk_group,
            g.routed_scaling_factor,
            g.norm_topk_prob,
            g.score_function,
        )

    def shared(self, x: mx.array):
        return None if self.shared_experts is None else self.shared_experts(x)


class BailingMoeV3StreamingBlock(StreamingMoE):
    """Replaces ``BailingSparseMoE``; keeps gate and shared experts."""

    @classmethod
    def from_stock(cls, block: bailing_moe_v3.BailingSparseMoE, **kwargs) -> "BailingMoeV3StreamingBlock":
        self = cls(**kwargs)
        self.gate = block.gate
        self.shared_experts = block.shared_experts
        return self

    def router_logits(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T

    def router_weight(self) -> mx.array:
        return self.gate.weight.astype(mx.float32)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        g = self.gate
        return sigmoid_group(logits, g.expert_bias, self.top_k, g.n_group, g.topk_group, g.routed_scaling_factor)

    def shared(self, x: mx.array) -> mx.array:
        return self.shared_experts(x)


class BailingMoeModel(Edge0Model, bailing_moe.Model):
    stock_block = bailing_moe.BailingMoeSparseMoeBlock
    streaming_block = BailingMoeStreamingBlock
    vocab_paths = VOCAB
    lora_targets = {
        "attention.query_key_value": "attention", "attention.dense": "attention",
        **SHARED_EXPERTS, **DENSE_MLP,
    }  # fmt: skip


class BailingMoeV3Model(Edge0Model, bailing_moe_v3.Model):
    stock_block = bailing_moe_v3.BailingSparseMoE
    streaming_block = BailingMoeV3StreamingBlock
    vocab_paths = VOCAB
    # MLA layers (q_a/q_b/kv_a, dense) and KDA linear-attention layers (q/k/v,
    # f/b gates, o) share the ``attention`` name; g_proj exists in both.
    lora_targets = {
        **{f"attention.{p}": "attention"
           for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "g_proj", "dense")},
        **{f"attention.{p}": "linear_attention"
           for p in ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "o_proj")},
        **SHARED_EXPERTS, **DENSE_MLP,
    }  # fmt: skip

"""Qwen3-Next and Qwen3.5/3.6-MoE (mlx-lm ``qwen3_next``, ``qwen3_5_moe``).

Both use ``Qwen3NextSparseMoeBlock``: softmax top-k router plus one shared
expert scaled by ``sigmoid(shared_expert_gate(x))``. Qwen3.5 nests the text
model under ``language_model``; the stock ``layers`` property hides that.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import qwen3_5_moe, qwen3_next

from ..model import Edge0Model
from ..routing import softmax_topk
from ..streaming import StreamingMoE, dense_weight
from .qwen3_moe import ATTENTION, DENSE_MLP, VOCAB

SHARED_EXPERT = {f"mlp.shared_expert.{p}": "shared_expert" for p in ("gate_proj", "up_proj", "down_proj")}


class Qwen3NextStreamingBlock(StreamingMoE):
    """Replaces ``Qwen3NextSparseMoeBlock``; keeps gate and shared expert."""

    @classmethod
    def from_stock(cls, block: qwen3_next.Qwen3NextSparseMoeBlock, **kwargs) -> "Qwen3NextStreamingBlock":
        self = cls(**kwargs)
        self.gate = block.gate
        self.shared_expert = block.shared_expert
        self.shared_expert_gate = block.shared_expert_gate
        self.norm_topk_prob = block.norm_topk_prob
        return self

    def router_logits(self, x: mx.array) -> mx.array:
        return self.gate(x)

    def router_weight(self) -> mx.array:
        return dense_weight(self.gate)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)

    def shared(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextModel(Edge0Model, qwen3_next.Model):
    stock_block = qwen3_next.Qwen3NextSparseMoeBlock
    streaming_block = Qwen3NextStreamingBlock
    vocab_paths = VOCAB
    lora_targets = {
        **ATTENTION, **SHARED_EXPERT, **DENSE_MLP,
        **{f"linear_attn.{p}": "linear_attention" for p in ("in_proj_qkvz", "in_proj_ba", "out_proj")},
    }  # fmt: skip


class Qwen3_5MoeModel(Edge0Model, qwen3_5_moe.Model):
    stock_block = qwen3_next.Qwen3NextSparseMoeBlock
    streaming_block = Qwen3NextStreamingBlock
    vocab_paths = ("language_model.model.embed_tokens", "language_model.lm_head")
    lora_targets = {
        **ATTENTION, **SHARED_EXPERT,
        **{f"linear_attn.{p}": "linear_attention"
           for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")},
    }  # fmt: skip

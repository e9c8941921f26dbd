"""Qwen3-MoE (mlx-lm ``qwen3_moe``): softmax top-k router, no shared expert."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import qwen3_moe

from ..model import Edge0Model
from ..routing import softmax_topk
from ..streaming import StreamingMoE, dense_weight


class Qwen3MoeStreamingBlock(StreamingMoE):
    """Replaces ``Qwen3MoeSparseMoeBlock``; keeps its ``gate``."""

    @classmethod
    def from_stock(cls, block: qwen3_moe.Qwen3MoeSparseMoeBlock, **kwargs) -> "Qwen3MoeStreamingBlock":
        self = cls(**kwargs)
        self.gate = block.gate
        self.norm_topk_prob = block.norm_topk_prob
        return self

    def router_logits(self, x: mx.array) -> mx.array:
        return self.gate(x)

    def router_weight(self) -> mx.array:
        return dense_weight(self.gate)

    def route(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)


ATTENTION = {f"self_attn.{p}": "attention" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
DENSE_MLP = {f"mlp.{p}": "dense_mlp" for p in ("gate_proj", "up_proj", "down_proj")}
VOCAB = ("model.embed_tokens", "lm_head")


class Model(Edge0Model, qwen3_moe.Model):
    stock_block = qwen3_moe.Qwen3MoeSparseMoeBlock
    streaming_block = Qwen3MoeStreamingBlock
    lora_targets = {**ATTENTION, **DENSE_MLP}
    vocab_paths = VOCAB

"""mlx-lm ``qwen3_moe`` as llama.cpp's ``qwen3moe``: every layer softmax attention
with q/k norms, then routed experts (softmax top-k, weights renormalized).

Every parameter keeps mlx-lm's layout: the GGUF tensors are the dequantized
mlx-lm weights. llama.cpp's graph has every layer MoE, always renormalizes the
top-k weights and applies plain RoPE, so checkpoints that differ there are
refused.
"""

from __future__ import annotations

from ..checkpoint import text_config
from .gguf_arch import ROUTED_EXPERTS, SOFTMAX_ATTENTION, Architecture, Mapped, add_common_hparams


def _problems(text: dict) -> list[str]:
    problems = []
    if text.get("mlp_only_layers"):
        problems.append(f"dense layers mlp_only_layers={text['mlp_only_layers']}")
    if text.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={text['decoder_sparse_step']}")
    if not text.get("norm_topk_prob", False):
        problems.append("norm_topk_prob=false")
    if text.get("rope_scaling"):
        problems.append(f"rope_scaling={text['rope_scaling']}")
    return problems


_LAYER = {
    "input_layernorm": Mapped("ATTN_NORM"),
    **SOFTMAX_ATTENTION,
    "post_attention_layernorm": Mapped("FFN_NORM"),
    **ROUTED_EXPERTS,
}


def _hparams(writer, text: dict) -> None:
    add_common_hparams(writer, text)
    writer.add_feed_forward_length(text.get("intermediate_size", text["moe_intermediate_size"]))


QWEN3MOE = Architecture(
    "qwen3moe", "qwen3_moe", "", text=text_config, problems=_problems, layer=lambda text, i: _LAYER, hparams=_hparams
)

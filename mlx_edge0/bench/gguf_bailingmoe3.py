"""mlx-lm ``bailing_moe_v3`` (Ling 3.0) as llama.cpp's ``bailingmoe3``.

The checkpoint's config says ``model_type: bailing_hybrid`` with architecture
``BailingMoeV3ForCausalLM``, which mlx-lm loads with its ``bailing_moe_v3``
module (a plain ``bailing_hybrid`` is another model). Every
``layer_group_size``-th layer, and every layer past the last whole group, is
multi-head latent attention (MLA) with a per-head sigmoid output gate; the
others are Kimi delta attention (KDA: short convolutions on q, k and v, a
per-channel decay ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, L2-
normalized q and k). The first ``first_k_dense_replace`` layers end in a dense
MLP, the others in routed experts (sigmoid scores; the expert bias steers the
choice of the top ``topk_group`` groups, by each group's two best scores, and
of the top-k within them; the unbiased scores, renormalized and scaled by
``routed_scaling_factor``, weight them) plus one shared expert. Where llama.cpp
stores a parameter otherwise than mlx-lm holds it (what convert_hf_to_gguf.py
writes from the Hugging Face checkpoint, with mlx-lm's ``sanitize`` undone
where it changed anything):

- ``kv_b_proj``, which ``sanitize`` splits per head into ``embed_q`` (the key
  half, transposed) and ``unembed_out`` (the value half), goes as those two:
  they are llama.cpp's ``attn_k_b`` and ``attn_v_b`` in the same layout, since
  llama.cpp, like mlx-lm, attends in the latent space (absorbed MLA). They
  stay F32 whatever the resident type (``gguf_arch.F32_TENSORS`` says why).
- The KDA convolutions: mlx-lm's ``[C, K, 1]`` (``sanitize`` moved Hugging
  Face's ``[C, 1, K]``) becomes ``[C, 1, K]``, the depthwise kernel shape
  llama.cpp's loader checks.
- ``A_log`` becomes ``ssm_a = exp(A_log)`` as a ``[H, 1]`` column: llama.cpp
  multiplies the gate pre-activation by it directly. ``dt_bias`` is
  ``ssm_dt.bias``, ``f_proj`` ``ssm_f_a``, ``b_proj`` ``ssm_beta``; the KDA
  ``g_proj`` is ``ssm_g_a`` and the MLA ``g_proj`` (one gate per head) is
  ``attn_gate``.
- ``expert_bias`` is ``exp_probs_b.bias``, the selection bias llama.cpp adds to
  the sigmoid scores before grouping, as mlx-lm does.
- The RMSNorm weights are not shifted by either side: llama.cpp and mlx-lm both
  multiply by the stored weight.
- ``head_count_kv`` is per layer: 1 for MLA (the latent KV is one shared head)
  and 0 for KDA, which is how llama.cpp tells the recurrent layers apart.
- RoPE: mlx-lm rotates the ``qk_rope_head_dim`` dims with traditional RoPE
  (adjacent pairs, ``rope_interleave``), as llama.cpp's normal RoPE does; no
  permutation is needed.

The multi-token-prediction layers are not written (mlx-lm drops them too).
mlx-lm's KDA kernel has no LoRA gates and needs ``kda_safe_gate``; llama.cpp
needs a negative lower bound, a shared expert and plain RoPE, so configs that
differ there are refused.

What still differs is numerics: llama.cpp runs the F16 matrices with F32
activations, the Q4_0 experts with Q8_0 activations, and its own chunked KDA
scan. tests/test_gguf_peer.py bounds the logit difference against mlx-lm and
the share of routed sets that agree; the measured values are in BENCHMARKS.md
("The peer arm: llama.cpp").
"""

from __future__ import annotations

import copy

import numpy as np

from .gguf_arch import ROUTED_EXPERTS, Architecture, Mapped, add_expert_hparams, gguf_module

LLAMA_ARCH = "bailingmoe3"


def _text(config: dict) -> dict:
    """The model's fields as mlx-lm's ``ModelArgs`` reads them (its defaults
    filled in: the synthetic geometry is those defaults)."""
    from mlx_lm.models.bailing_moe_v3 import ModelArgs

    return vars(ModelArgs.from_dict(copy.deepcopy(config)))


def _is_mla(text: dict, layer: int) -> bool:
    """As mlx-lm's ``_is_kda_layer`` decides, negated."""
    group, n = text["layer_group_size"], text["num_hidden_layers"]
    return (layer + 1) % group == 0 or layer >= n // group * group


def _problems(text: dict) -> list[str]:
    problems = []
    if not text["no_kda_lora"]:
        problems.append("no_kda_lora=false (the KDA LoRA gates are not written)")
    if not text["kda_safe_gate"]:
        problems.append("kda_safe_gate=false (llama.cpp's bailingmoe3 runs the safe gate only)")
    if text["kda_lower_bound"] >= 0:
        problems.append(f"kda_lower_bound={text['kda_lower_bound']} (llama.cpp needs a negative bound)")
    if text["rope_scaling"]:
        problems.append(f"rope_scaling={text['rope_scaling']} (only plain RoPE is written)")
    if not text["rope_interleave"]:
        problems.append("rope_interleave=false (llama.cpp's bailingmoe3 rotates adjacent pairs)")
    if text["num_shared_experts"] < 1:
        problems.append(
            f"num_shared_experts={text['num_shared_experts']} (llama.cpp's MoE layers have a shared expert)"
        )
    if text["num_experts"] % text["n_group"]:
        problems.append(f"num_experts={text['num_experts']} is not a multiple of n_group={text['n_group']}")
    return problems


def _kda(text: dict) -> dict[str, Mapped]:
    inner, kernel = text["num_attention_heads"] * text["head_dim"], text["short_conv_kernel_size"]
    conv = {
        f"attention.{x}_conv1d": Mapped(
            f"SSM_CONV1D_{x.upper()}", transform=lambda w: w.swapaxes(1, 2), shape=(inner, 1, kernel)
        )
        for x in "qkv"
    }
    return {
        "attention.q_proj": Mapped("ATTN_Q"),
        "attention.k_proj": Mapped("ATTN_K"),
        "attention.v_proj": Mapped("ATTN_V"),
        **conv,
        "attention.f_proj": Mapped("SSM_F_A"),
        "attention.dt_bias": Mapped("SSM_DT", suffix=".bias"),
        "attention.A_log": Mapped(
            "SSM_A", suffix="", transform=lambda w: np.exp(w).reshape(-1, 1), shape=(text["num_attention_heads"], 1)
        ),
        "attention.b_proj": Mapped("SSM_BETA"),
        "attention.g_proj": Mapped("SSM_G_A"),
        "attention.o_norm": Mapped("SSM_NORM"),
        "attention.o_proj": Mapped("ATTN_OUT"),
    }


def _mla(text: dict) -> dict[str, Mapped]:
    if text["q_lora_rank"] is None:
        query = {"attention.q_proj": Mapped("ATTN_Q")}
    else:
        query = {
            "attention.q_a_proj": Mapped("ATTN_Q_A"),
            "attention.q_a_layernorm": Mapped("ATTN_Q_A_NORM"),
            "attention.q_b_proj": Mapped("ATTN_Q_B"),
        }
    return {
        **query,
        "attention.kv_a_proj_with_mqa": Mapped("ATTN_KV_A_MQA"),
        "attention.kv_a_layernorm": Mapped("ATTN_KV_A_NORM"),
        "attention.embed_q": Mapped("ATTN_K_B"),
        "attention.unembed_out": Mapped("ATTN_V_B"),
        "attention.g_proj": Mapped("ATTN_GATE"),
        "attention.dense": Mapped("ATTN_OUT"),
    }


_DENSE = {
    "mlp.gate_proj": Mapped("FFN_GATE"),
    "mlp.up_proj": Mapped("FFN_UP"),
    "mlp.down_proj": Mapped("FFN_DOWN"),
}
_MOE = {
    **ROUTED_EXPERTS,
    "mlp.gate.expert_bias": Mapped("FFN_EXP_PROBS_B", suffix=".bias"),
    "mlp.shared_experts.gate_proj": Mapped("FFN_GATE_SHEXP"),
    "mlp.shared_experts.up_proj": Mapped("FFN_UP_SHEXP"),
    "mlp.shared_experts.down_proj": Mapped("FFN_DOWN_SHEXP"),
}


def _layer(text: dict, layer: int) -> dict[str, Mapped]:
    return {
        "input_layernorm": Mapped("ATTN_NORM"),
        **(_mla(text) if _is_mla(text, layer) else _kda(text)),
        "post_attention_layernorm": Mapped("FFN_NORM"),
        **(_DENSE if layer < text["first_k_dense_replace"] else _MOE),
    }


def _hparams(writer, text: dict) -> None:
    gguf = gguf_module()
    n = text["num_hidden_layers"]
    rope, kv_lora = text["qk_rope_head_dim"], text["kv_lora_rank"]
    writer.add_block_count(n)
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv([int(_is_mla(text, i)) for i in range(n)])
    # The MLA cache holds the normalized latent and the rotated key: one head of kv_lora + rope.
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(text["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(text["v_head_dim"])
    if text["q_lora_rank"] is not None:
        writer.add_q_lora_rank(text["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora)
    writer.add_rope_dimension_count(rope)
    writer.add_rope_freq_base(float(text["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(text["rms_norm_eps"]))
    writer.add_ssm_conv_kernel(text["short_conv_kernel_size"])
    writer.add_kda_head_dim(text["head_dim"])
    writer.add_bool(f"{LLAMA_ARCH}.kda.safe_gate", text["kda_safe_gate"])
    writer.add_float32(f"{LLAMA_ARCH}.kda.gate_lower_bound", float(text["kda_lower_bound"]))
    add_expert_hparams(writer, text)
    writer.add_expert_shared_count(text["num_shared_experts"])
    writer.add_expert_shared_feed_forward_length(
        text["moe_shared_expert_intermediate_size"] * text["num_shared_experts"]
    )
    writer.add_leading_dense_block_count(text["first_k_dense_replace"])
    writer.add_expert_group_count(text["n_group"])
    writer.add_expert_group_used_count(text["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_norm(True)  # mlx-lm always renormalizes the top-k scores
    writer.add_expert_weights_scale(float(text["routed_scaling_factor"]))


BAILINGMOE3 = Architecture(
    LLAMA_ARCH,
    "bailing_moe_v3",
    "",
    text=_text,
    problems=_problems,
    layer=_layer,
    hparams=_hparams,
    top={"model.word_embeddings": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"},
)

"""mlx-lm ``qwen3_5_moe`` (Qwen3.5 MoE) as llama.cpp's ``qwen35moe``.

Every ``full_attention_interval``-th layer is gated softmax attention, the
others gated-delta-net linear attention; every layer ends in routed experts
(softmax top-k, renormalized) plus a shared expert scaled by
``sigmoid(shared_expert_gate)``. Where llama.cpp stores a parameter otherwise
than mlx-lm holds it (what convert_hf_to_gguf.py writes from the Hugging Face
checkpoint, with mlx-lm's ``sanitize`` undone where it changed anything):

- The RMSNorm weights that ``sanitize`` shifts by +1 (input, post-attention,
  final, q/k norms) go as mlx-lm holds them: llama.cpp multiplies by the weight,
  and convert_hf_to_gguf adds the same 1 to the zero-centred Hugging Face values.
  The gated norm of the linear attention is not shifted by either.
- ``conv1d``: mlx-lm's ``[C, K, 1]`` (``sanitize`` moved Hugging Face's
  ``[C, 1, K]``) becomes ``[C, K]``.
- ``A_log`` becomes ``ssm_a = -exp(A_log)``; ``dt_bias`` is ``ssm_dt.bias``.
- Value heads: mlx-lm (like Hugging Face) repeats each key head over a group of
  consecutive value heads; llama.cpp broadcasts key heads tiled (value head
  ``h`` reads key head ``h mod n_k``), so every value-head axis (the V rows of
  ``in_proj_qkv`` and channels of ``conv1d``, ``in_proj_z``, ``in_proj_a/b``,
  ``A_log``, ``dt_bias``, the input columns of ``out_proj``) is permuted from
  grouped to tiled order. With as many value as key heads it is the identity.
- The full-attention ``q_proj`` already interleaves query and output gate per
  head (``[q_h, gate_h]`` for each head), as llama.cpp splits it: unchanged.
- ``shared_expert_gate`` (``[1, D]``) becomes the vector ``ffn_gate_inp_shexp``.
- RoPE: mlx-lm rotates the first ``head_dim * partial_rotary_factor`` dims with
  plain (non-traditional) RoPE; llama.cpp applies interleaved M-RoPE with the
  config's ``mrope_section``. A text token has the same position on the three
  axes llama.cpp reads, so the two agree wherever the sections cover every
  rotary pair; llama.cpp's fourth axis is position 0 for text, so a config whose
  sections leave pairs to it is refused.

The multi-token-prediction layers are not written (mlx-lm drops them too).

What still differs is numerics, not the model: llama.cpp runs the F16 matrices
with F32 activations and the Q4_0 experts with Q8_0 activations, and enters the
q/k L2 norm's epsilon otherwise than mlx-lm. tests/test_gguf_peer.py bounds the
logit difference against mlx-lm on the same Q4_0 experts and the share of
routed sets that agree (the few that differ are near-ties of the top-k); the
measured values are in BENCHMARKS.md ("The peer arm: llama.cpp"). Written
without the value-head reorder, the same GGUF fails those bounds.
"""

from __future__ import annotations

import copy

import numpy as np

from ..checkpoint import text_config
from .gguf_arch import ROUTED_EXPERTS, SOFTMAX_ATTENTION, Architecture, Mapped, add_common_hparams


def _text(config: dict) -> dict:
    """The text model's fields as mlx-lm's ``TextModelArgs`` reads them: its
    defaults filled in, ``rope_theta`` and ``partial_rotary_factor`` taken from
    ``rope_parameters``."""
    from mlx_lm.models.qwen3_5 import TextModelArgs

    return vars(TextModelArgs.from_dict(copy.deepcopy(text_config(config))))


def _rotary_dims(text: dict) -> int:
    return int(text["head_dim"] * text["partial_rotary_factor"])


def _sections(text: dict) -> list[int]:
    """``rope.dimension_sections``: the config's ``mrope_section`` padded to four
    axes. Without one (mlx-lm needs none), as many pairs per axis as the
    interleaved rule gives it, so that every rotary pair has a text position
    (``[11, 11, 10]`` for 32 pairs, what convert_hf_to_gguf writes by default)."""
    pairs = _rotary_dims(text) // 2
    sections = (text["rope_parameters"] or {}).get("mrope_section") or [-(-(pairs - r) // 3) for r in range(3)]
    return (list(sections) + [0, 0, 0, 0])[:4]


def _zero_axis_pairs(sections: list[int], rotary_pairs: int) -> list[int]:
    """The rotary pairs llama.cpp's interleaved M-RoPE rotates by its fourth axis
    (ggml's ``is_imrope`` sector rule), which is position 0 for text."""
    span = sum(sections)
    sectors = [p % span for p in range(rotary_pairs)] if span else list(range(rotary_pairs))
    return [p for p, s in enumerate(sectors) if not (span and s < 3 * sections[s % 3])]


def _problems(text: dict) -> list[str]:
    problems = []
    if not text["num_experts"]:
        problems.append("num_experts=0 (a dense Qwen3.5; only the MoE is written)")
    if not text["norm_topk_prob"]:
        problems.append("norm_topk_prob=false (llama.cpp renormalizes the top-k weights)")
    if text["attention_bias"]:
        problems.append("attention_bias=true (llama.cpp's qwen35moe has no attention biases)")
    n_k, n_v = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if text["linear_key_head_dim"] != text["linear_value_head_dim"]:
        problems.append(
            f"linear_key_head_dim={text['linear_key_head_dim']} != linear_value_head_dim="
            f"{text['linear_value_head_dim']} (llama.cpp sizes both with ssm.state_size)"
        )
    if n_v % n_k:
        problems.append(f"linear_num_value_heads={n_v} is not a multiple of linear_num_key_heads={n_k}")
    rope = text["rope_parameters"] or {}
    kind = rope.get("type", rope.get("rope_type", "default"))
    if kind != "default":
        problems.append(f"rope_parameters.rope_type={kind!r} (only default RoPE is written)")
    zero = _zero_axis_pairs(_sections(text), _rotary_dims(text) // 2)
    if zero:
        problems.append(
            f"rope_parameters.mrope_section={rope.get('mrope_section')} leaves rotary pairs {zero} "
            "to llama.cpp's fourth M-RoPE axis (position 0 for text)"
        )
    return problems


def _tiled(w: np.ndarray, n_k: int, per_k: int, head_dim: int, *, axis: int = 0, start: int = 0) -> np.ndarray:
    """``w`` with the value heads along ``axis`` (from index ``start``) moved from
    grouped order (per key head, its ``per_k`` value heads) to tiled order."""
    w = np.moveaxis(w, axis, 0)
    heads = w[start:]
    heads = heads.reshape(n_k, per_k, head_dim, *heads.shape[1:]).swapaxes(0, 1).reshape(heads.shape)
    return np.moveaxis(np.concatenate([w[:start], heads]), 0, axis)


def _linear_attention(text: dict) -> dict[str, Mapped]:
    n_k, n_v = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dv, qk = text["linear_value_head_dim"], 2 * n_k * text["linear_key_head_dim"]  # q and k channels lead

    def tiled(head_dim: int, **where):
        return lambda w: _tiled(w, n_k, n_v // n_k, head_dim, **where)

    per_head, conv_v = tiled(1), tiled(dv, start=qk)
    conv_shape = (qk + n_v * dv, text["linear_conv_kernel_dim"])
    return {
        "linear_attn.in_proj_qkv": Mapped("ATTN_QKV", transform=tiled(dv, start=qk)),
        "linear_attn.in_proj_z": Mapped("ATTN_GATE", transform=tiled(dv)),
        "linear_attn.in_proj_b": Mapped("SSM_BETA", transform=per_head),
        "linear_attn.in_proj_a": Mapped("SSM_ALPHA", transform=per_head),
        "linear_attn.A_log": Mapped("SSM_A", suffix="", transform=lambda w: -np.exp(per_head(w))),
        "linear_attn.dt_bias": Mapped("SSM_DT", suffix=".bias", transform=per_head),
        "linear_attn.conv1d": Mapped("SSM_CONV1D", transform=lambda w: conv_v(w[..., 0]), shape=conv_shape),
        "linear_attn.norm": Mapped("SSM_NORM"),
        "linear_attn.out_proj": Mapped("SSM_OUT", transform=tiled(dv, axis=1)),
    }


def _layer(text: dict, layer: int) -> dict[str, Mapped]:
    linear = (layer + 1) % text["full_attention_interval"] != 0  # as mlx-lm's DecoderLayer decides
    return {
        "input_layernorm": Mapped("ATTN_NORM"),
        **(_linear_attention(text) if linear else SOFTMAX_ATTENTION),
        "post_attention_layernorm": Mapped("ATTN_POST_NORM"),
        **ROUTED_EXPERTS,
        "mlp.shared_expert.gate_proj": Mapped("FFN_GATE_SHEXP"),
        "mlp.shared_expert.up_proj": Mapped("FFN_UP_SHEXP"),
        "mlp.shared_expert.down_proj": Mapped("FFN_DOWN_SHEXP"),
        "mlp.shared_expert_gate": Mapped(
            "FFN_GATE_INP_SHEXP", transform=lambda w: w.reshape(-1), shape=(text["hidden_size"],)
        ),
    }


def _hparams(writer, text: dict) -> None:
    add_common_hparams(writer, text)
    writer.add_expert_shared_feed_forward_length(text["shared_expert_intermediate_size"])
    writer.add_rope_dimension_count(_rotary_dims(text))
    writer.add_rope_dimension_sections(_sections(text))
    writer.add_full_attention_interval(text["full_attention_interval"])
    writer.add_ssm_conv_kernel(text["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(text["linear_key_head_dim"])
    writer.add_ssm_group_count(text["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(text["linear_num_value_heads"])
    writer.add_ssm_inner_size(text["linear_value_head_dim"] * text["linear_num_value_heads"])


QWEN35MOE = Architecture(
    "qwen35moe", "qwen3_5_moe", "language_model.", text=_text, problems=_problems, layer=_layer, hparams=_hparams
)

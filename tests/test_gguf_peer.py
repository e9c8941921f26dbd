"""The peer arm's GGUF: tiny stock checkpoints written by bench/gguf_peer.py, run by llama.cpp.

Three families, each a tiny model (4 layers x 16 experts, K=4, hidden 128,
seed 0) and 32 teacher-forced tokens: qwen3_moe as llama.cpp's qwen3moe, and
qwen3_5_moe (three gated-delta-net layers, then one gated softmax-attention
layer; 2 key / 4 value heads, so the value-head reorder is exercised) as
qwen35moe, every layer MoE; bailing_moe_v3 as bailingmoe3. A bound is two to five times the measurement so
another CPU's SIMD path or llama.cpp release passes, while a wrong tensor
layout, a missing norm or a transposed projection, which move logits by the
size of their spread, fails: written without the value-head reorder, the
qwen3_5_moe GGUF is off by max 2.1, mean 0.33 logit std (f32 resident).

qwen3_moe (logits std 0.57):

- mlx-lm on the int4 checkpoint vs mlx-lm with the GGUF's Q4_0 experts:
  max |d logit| 0.036 (the requantization: no bias, blocks of 32), identical
  routed sets on every layer and token, identical greedy tokens.
- mlx-lm with the Q4_0 experts vs llama.cpp: max 0.009 (llama.cpp's numerics:
  F16 resident matrices, activations quantized to Q8_0 for Q4_0 matmuls).
- mlx-lm int4 vs llama.cpp, end to end: max 0.043, mean 0.0062; greedy next
  tokens agree on 32 of 32 positions; routed sets (llama.cpp's ffn_moe_topk
  against mlx-lm's router top-k) identical on 128 of 128 (token, layer) pairs.
- Resident matrices requantized too (every matmul rounds again): max 0.24,
  mean 0.040 (0.42 and 0.070 logit std), greedy 28/32.

qwen3_5_moe (logits std 0.58):

- The requantization alone: max 0.057; routed sets identical on 124 of 128
  pairs (the four others are near-ties: top-k margin 0.005-0.03 where the
  median is 0.15-0.29), greedy 31/32.
- mlx-lm with the Q4_0 experts vs llama.cpp: max 0.0098, mean 0.0015.
- End to end: max 0.063, mean 0.0075; greedy 31/32; routed sets identical on
  123 of 128 pairs (all of layer 0; the requantization's four near-ties and
  one more, margin 0.013).
- Resident matrices requantized too: max 0.36, mean 0.052 (0.62 and 0.091
  logit std), greedy 26/32.

bailing_moe_v3 (Ling 3.0 as bailingmoe3: KDA layers 0-2, gated MLA layer 3,
layer 0 a dense MLP; sigmoid routing over 4 groups of 4 experts, top 2 groups,
routed_scaling_factor 2.5; logits std 0.58):

- The requantization alone: max 0.115 (0.20 logit std: the experts' output is
  scaled by 2.5), mean 0.0091; routed sets identical on 95 of 96 pairs,
  greedy 32/32.
- mlx-lm with the Q4_0 experts vs llama.cpp: max 0.010 (0.018 logit std).
- End to end: max 0.114, mean 0.0093; greedy 32/32; routed sets identical on
  95 of 96 pairs (the requantization's one).
- Resident matrices requantized too: max 0.66, mean 0.10 (1.15 and 0.18 logit
  std), greedy 26/32: here requantizing rounds the MLA projections, the
  absorbed k/v matrices, the beta projection, embedding and LM head to 4 bits
  for the first time (mlx-lm keeps them bf16), about half the difference.
  The absorbed k/v matrices stay F32: llama_cpp.Llama's default load (CPU
  repack) aborts on them in F16 or Q4_0.
- Written with ssm_a = A_log instead of exp(A_log), llama.cpp is off by max
  2.0 logit std; with the query's RoPE pairs in half-split order, llama.cpp vs
  the Q4_0 experts is off by 0.13.

The bounds below are over the logits' std.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map_with_path

from mlx_edge0 import tiny
from mlx_edge0.checkpoint import text_config

gguf = pytest.importorskip("gguf", reason='the GGUF writer needs the peers extra: pip install -e ".[peers]"')

from mlx_edge0.bench.gguf_peer import (  # noqa: E402
    GGUFConversionError,
    GGUFReport,
    check_config,
    with_gguf_experts,
    write_gguf,
)
from conftest import load_stock  # noqa: E402

TOKENS = np.random.default_rng(0).integers(3, 512, 32).tolist()  # teacher-forced, fixed


@dataclass(frozen=True)
class Bounds:
    """What one family's GGUF must match (measured values in the module docstring)."""

    arch: str
    tensors: int  # in the GGUF
    max_over_std: float  # mlx-lm int4 vs llama.cpp (and vs mlx-lm with the Q4_0 experts)
    mean_over_std: float
    llama_vs_q4_0_max_over_std: float  # mlx-lm with the GGUF's experts vs llama.cpp
    greedy: float  # agreement of greedy next tokens, llama.cpp vs mlx-lm int4
    routing: float  # (token, layer) pairs with the same routed set, llama.cpp vs mlx-lm int4
    requant_greedy: float  # the same two for mlx-lm with the GGUF's experts
    requant_routing: float
    q4_0_resident: tuple[float, float, float]  # max, mean over std; greedy agreement
    q4_0_names: tuple[str, ...]  # resident matrices requantized with resident_type="q4_0"
    f32_names: tuple[str, ...]  # kept F32 whatever the resident type
    dense_layers: int = 0  # leading layers with a dense MLP instead of experts


BOUNDS = {
    "qwen3_moe": Bounds(
        arch="qwen3moe",
        tensors=3 + tiny.LAYERS * 12,
        max_over_std=0.15,  # measured 0.075
        mean_over_std=0.03,  # measured 0.011
        llama_vs_q4_0_max_over_std=0.05,  # measured 0.016
        greedy=0.9,  # measured 32/32
        routing=0.9,  # measured 128/128
        requant_greedy=1.0,
        requant_routing=1.0,
        q4_0_resident=(1.0, 0.15, 0.75),  # measured 0.42, 0.070, 28/32
        q4_0_names=("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.3.attn_output.weight"),
        f32_names=("blk.0.ffn_gate_inp.weight", "blk.0.attn_norm.weight"),
    ),
    "qwen3_5_moe": Bounds(
        arch="qwen35moe",
        tensors=3 + 3 * 19 + 16,  # 3 linear-attention layers, 1 full-attention layer
        max_over_std=0.25,  # measured 0.109 (requantization alone 0.099)
        mean_over_std=0.04,  # measured 0.013
        llama_vs_q4_0_max_over_std=0.05,  # measured 0.017
        greedy=0.9,  # measured 31/32
        routing=0.9,  # measured 123/128
        requant_greedy=0.9,  # measured 31/32
        requant_routing=0.9,  # measured 124/128
        q4_0_resident=(1.5, 0.25, 0.65),  # measured 0.62, 0.091, 26/32
        q4_0_names=(
            "token_embd.weight",
            "output.weight",
            "blk.0.attn_qkv.weight",
            "blk.0.ssm_out.weight",
            "blk.3.attn_q.weight",
            "blk.1.ffn_up_shexp.weight",
        ),
        f32_names=(
            "blk.0.ffn_gate_inp.weight",
            "blk.0.ffn_gate_inp_shexp.weight",
            "blk.0.ssm_conv1d.weight",
            "blk.0.attn_norm.weight",
        ),
    ),
    "bailing_moe_v3": Bounds(
        arch="bailingmoe3",
        tensors=3 + 18 + 2 * 23 + 19,  # KDA + dense MLP, 2 x (KDA + MoE), MLA + MoE
        max_over_std=0.4,  # measured 0.197 (requantization alone 0.199)
        mean_over_std=0.04,  # measured 0.016
        llama_vs_q4_0_max_over_std=0.05,  # measured 0.018
        greedy=0.9,  # measured 32/32
        routing=0.9,  # measured 95/96
        requant_greedy=0.9,  # measured 32/32
        requant_routing=0.9,  # measured 95/96
        q4_0_resident=(2.5, 0.4, 0.6),  # measured 1.15, 0.18, 26/32
        q4_0_names=(
            "token_embd.weight",
            "output.weight",
            "blk.0.attn_q.weight",
            "blk.0.ssm_f_a.weight",
            "blk.0.ffn_gate.weight",
            "blk.1.ffn_up_shexp.weight",
            "blk.3.attn_q_b.weight",
            "blk.3.attn_gate.weight",
        ),
        f32_names=(
            "blk.1.ffn_gate_inp.weight",
            "blk.1.exp_probs_b.bias",
            "blk.0.ssm_conv1d_q.weight",
            "blk.0.ssm_a",
            "blk.0.attn_norm.weight",
            "blk.3.attn_k_b.weight",
            "blk.3.attn_v_b.weight",
        ),
        dense_layers=1,
    ),
}
ALL_MOE = {"qwen3_moe": {"mlp_only_layers": []}}  # llama.cpp's qwen3moe has no dense layers


@dataclass(frozen=True)
class Peer:
    model_type: str
    src: Path  # the stock int4 checkpoint
    path: Path  # its GGUF
    report: GGUFReport
    bounds: Bounds
    progress: list[tuple[int, int]]  # the writer's (layers written, layers) calls


def _needs_llama_cpp():
    return pytest.importorskip("llama_cpp", reason='llama.cpp needs the peers extra: pip install -e ".[peers]"')


@pytest.fixture(scope="module", params=list(BOUNDS))
def peer(request, tmp_path_factory, tokenizer_dir) -> Peer:
    """A tiny stock checkpoint of the family, its GGUF and the writer's report."""
    model_type = request.param
    root = tmp_path_factory.mktemp(f"peer-{model_type}")
    config = tiny.tiny_config(model_type) | ALL_MOE.get(model_type, {})
    arch = tiny.model_module(config)
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))
    model.update(tree_map_with_path(tiny._randomize, model.parameters()))
    model.update(tree_map_with_path(_spread_kda_decay, model.parameters()))
    mx.eval(model.parameters())
    src = tiny.save_mlx(model, config, root / "stock", tokenizer_dir, bits=4)
    progress = []
    report = write_gguf(src, root / "stock.gguf", progress=lambda *p: progress.append(p))
    return Peer(model_type, src, root / "stock.gguf", report, BOUNDS[model_type], progress)


def _spread_kda_decay(path: str, v: mx.array) -> mx.array:
    """bailing_moe_v3's stock init leaves the KDA decay's ``A_log`` and ``dt_bias``
    at zero, where exp(A_log) and the bias would go untested."""
    if path.endswith(("attention.A_log", "attention.dt_bias")):
        return mx.random.normal(v.shape) * 0.5
    return v


def _mlx_logits(model) -> np.ndarray:
    return np.array(model(mx.array(TOKENS)[None])[0].astype(mx.float32))


def _llama_logits(path: Path, **kwargs) -> np.ndarray:
    _needs_llama_cpp()
    from mlx_edge0.bench.llamacpp import LlamaCppModel

    with LlamaCppModel(path, **kwargs) as m:
        return m.forward(TOKENS, all_logits=True)


def test_gguf_layout(peer):
    reader = gguf.GGUFReader(peer.path)
    tensors = {t.name: t for t in reader.tensors}
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    moe_layers = range(peer.bounds.dense_layers, tiny.LAYERS)
    for layer in range(tiny.LAYERS):
        assert (f"blk.{layer}.ffn_gate_exps.weight" in tensors) == (layer in moe_layers)
    for layer in moe_layers:
        assert tensors[f"blk.{layer}.ffn_gate_exps.weight"].tensor_type == q4_0
    assert list(tensors["blk.3.ffn_gate_exps.weight"].shape) == [tiny.HIDDEN, tiny.MOE_INTERMEDIATE, tiny.EXPERTS]
    assert list(tensors["blk.3.ffn_down_exps.weight"].shape) == [tiny.MOE_INTERMEDIATE, tiny.HIDDEN, tiny.EXPERTS]
    assert tensors["blk.3.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensors) == peer.bounds.tensors
    assert _field(reader, "general.architecture") == peer.bounds.arch == peer.report.arch
    assert peer.report.tokenizer == "gpt2" and peer.report.tensors == len(tensors)
    # Q4_0 keeps 4.5 bits per expert weight, like int4 g64 with bf16 scales and biases.
    weights = len(moe_layers) * tiny.EXPERTS * 3 * tiny.HIDDEN * tiny.MOE_INTERMEDIATE
    assert peer.report.expert_bytes * 8 / weights == 4.5
    assert 0 < peer.report.expert_rel_error < 0.05  # measured 0.030 (all three)
    # Progress counts each MoE layer once, as its experts are written, out of all layers.
    assert peer.progress == [(layer + 1, tiny.LAYERS) for layer in moe_layers]


def test_gguf_command_writes_the_file_and_says_what_it_wrote(peer, tmp_path):
    from click.testing import CliRunner

    from mlx_edge0.bench.commands import bench

    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(bench, ["gguf", str(peer.src), str(out)])
    assert result.exit_code == 0, result.output
    assert f"Wrote {out} ({peer.bounds.arch})" in result.output
    assert out.stat().st_size == peer.path.stat().st_size


def _field(reader, key: str):
    """A GGUF metadata value: a string, a number or a list of numbers."""
    f = reader.fields[key]
    parts = [f.parts[i] for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(parts[0]).decode()
    values = [p.tolist()[0] for p in parts]
    return values if f.types[0] == gguf.GGUFValueType.ARRAY else values[0]


def _source(src: Path, name: str) -> np.ndarray:
    """A tensor of the stock checkpoint as float32, dequantized if quantized."""
    arrays = mx.load(str(src / "model.safetensors"))
    if f"{name}.scales" not in arrays:
        return np.array(arrays[name if name in arrays else f"{name}.weight"].astype(mx.float32))
    parts = (arrays[f"{name}.{p}"] for p in ("weight", "scales", "biases"))
    w, scales, biases = parts
    bits = 8 if name.endswith(("mlp.gate", "shared_expert_gate")) else 4
    dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64, bits=bits)
    return np.array(dense)


@pytest.mark.parametrize("peer", ["qwen3_5_moe"], indirect=True)
def test_qwen35moe_layout_and_values(peer):
    """What llama.cpp's qwen35moe reads, tensor by tensor, against the stock
    checkpoint: linear-attention layers 0-2, gated attention in layer 3, the
    value heads (2 key heads x 2 each) in tiled order [0, 2, 1, 3]."""
    reader = gguf.GGUFReader(peer.path)
    tensors = {t.name: t for t in reader.tensors}
    f32 = gguf.GGMLQuantizationType.F32
    text = text_config(tiny.tiny_config("qwen3_5_moe"))
    n_v, dv, dk, n_k = 4, 32, 32, 2
    key, conv = n_k * dk, 2 * n_k * dk + n_v * dv
    shapes = {  # ggml order (innermost first), as llama.cpp's loader checks them
        "blk.0.attn_qkv.weight": [tiny.HIDDEN, conv],
        "blk.0.attn_gate.weight": [tiny.HIDDEN, n_v * dv],
        "blk.0.ssm_beta.weight": [tiny.HIDDEN, n_v],
        "blk.0.ssm_alpha.weight": [tiny.HIDDEN, n_v],
        "blk.0.ssm_a": [n_v],
        "blk.0.ssm_dt.bias": [n_v],
        "blk.0.ssm_conv1d.weight": [text["linear_conv_kernel_dim"], conv],
        "blk.0.ssm_norm.weight": [dv],
        "blk.0.ssm_out.weight": [n_v * dv, tiny.HIDDEN],
        "blk.0.post_attention_norm.weight": [tiny.HIDDEN],
        "blk.0.ffn_gate_inp_shexp.weight": [tiny.HIDDEN],
        "blk.0.ffn_up_shexp.weight": [tiny.HIDDEN, text["shared_expert_intermediate_size"]],
        "blk.3.attn_q.weight": [tiny.HIDDEN, 2 * text["num_attention_heads"] * text["head_dim"]],
        "blk.3.attn_k.weight": [tiny.HIDDEN, text["num_key_value_heads"] * text["head_dim"]],
        "blk.3.attn_q_norm.weight": [text["head_dim"]],
    }
    for name, shape in shapes.items():
        assert list(tensors[name].shape) == shape, name
    assert "blk.3.attn_qkv.weight" not in tensors and "blk.0.attn_q.weight" not in tensors
    for name in ("blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ssm_norm.weight"):
        assert tensors[name].tensor_type == f32, name
    expected = {
        "qwen35moe.full_attention_interval": 4,
        "qwen35moe.ssm.conv_kernel": 4,
        "qwen35moe.ssm.state_size": dk,
        "qwen35moe.ssm.group_count": n_k,
        "qwen35moe.ssm.time_step_rank": n_v,
        "qwen35moe.ssm.inner_size": n_v * dv,
        "qwen35moe.rope.dimension_count": 16,  # head_dim 64 x partial_rotary_factor 0.25
        "qwen35moe.rope.dimension_sections": [3, 3, 2, 0],
        "qwen35moe.expert_shared_feed_forward_length": text["shared_expert_intermediate_size"],
        "qwen35moe.rope.freq_base": 1e7,
    }
    assert {k: _field(reader, k) for k in expected} == expected

    heads = [0, 2, 1, 3]  # grouped (k0: v0 v1, k1: v2 v3) -> tiled (v0 v2 v1 v3)
    v_rows = np.concatenate([h * dv + np.arange(dv) for h in heads])
    layer = "language_model.model.layers.0"
    data = {name: np.asarray(t.data, np.float32) for name, t in tensors.items() if name.startswith("blk.0.")}
    a_log = _source(peer.src, f"{layer}.linear_attn.A_log")
    np.testing.assert_allclose(data["blk.0.ssm_a"], -np.exp(a_log[heads]), rtol=1e-6)
    np.testing.assert_array_equal(data["blk.0.ssm_dt.bias"], _source(peer.src, f"{layer}.linear_attn.dt_bias")[heads])
    conv1d = _source(peer.src, f"{layer}.linear_attn.conv1d")[..., 0]  # [C, K]
    np.testing.assert_array_equal(data["blk.0.ssm_conv1d.weight"], conv1d[np.r_[np.arange(2 * key), 2 * key + v_rows]])
    qkv = _source(peer.src, f"{layer}.linear_attn.in_proj_qkv")
    np.testing.assert_allclose(data["blk.0.attn_qkv.weight"][2 * key :], qkv[2 * key + v_rows], rtol=1e-3, atol=1e-4)
    out = _source(peer.src, f"{layer}.linear_attn.out_proj")
    np.testing.assert_allclose(data["blk.0.ssm_out.weight"], out[:, v_rows], rtol=1e-3, atol=1e-4)
    shared_gate = _source(peer.src, f"{layer}.mlp.shared_expert_gate")
    np.testing.assert_array_equal(data["blk.0.ffn_gate_inp_shexp.weight"], shared_gate[0])
    norm = _source(peer.src, f"{layer}.input_layernorm")  # mlx-lm's (+1-shifted) weight, as llama.cpp multiplies
    np.testing.assert_array_equal(data["blk.0.attn_norm.weight"], norm)
    assert 0.85 < norm.min() and norm.max() < 1.15


@pytest.mark.parametrize("peer", ["bailing_moe_v3"], indirect=True)
def test_bailingmoe3_layout_and_values(peer):
    """What llama.cpp's bailingmoe3 reads, tensor by tensor, against the stock
    checkpoint: KDA layers 0-2 (layer 0 with a dense MLP), gated MLA in layer 3
    with mlx-lm's absorbed k/v matrices as attn_k_b / attn_v_b."""
    reader = gguf.GGUFReader(peer.path)
    tensors = {t.name: t for t in reader.tensors}
    text = tiny.tiny_config("bailing_moe_v3")
    heads, head_dim, hidden = text["num_attention_heads"], text["head_dim"], tiny.HIDDEN
    inner, kernel = heads * head_dim, text["short_conv_kernel_size"]
    q_lora, kv_lora, rope = text["q_lora_rank"], text["kv_lora_rank"], text["qk_rope_head_dim"]
    nope, v_dim = text["qk_nope_head_dim"], text["v_head_dim"]
    shapes = {  # ggml order (innermost first), as llama.cpp's loader checks them
        "blk.0.attn_q.weight": [hidden, inner],
        "blk.0.ssm_conv1d_q.weight": [kernel, 1, inner],
        "blk.0.ssm_conv1d_v.weight": [kernel, 1, inner],
        "blk.0.ssm_f_a.weight": [hidden, inner],
        "blk.0.ssm_beta.weight": [hidden, heads],
        "blk.0.ssm_a": [1, heads],
        "blk.0.ssm_dt.bias": [inner],
        "blk.0.ssm_g_a.weight": [hidden, inner],
        "blk.0.ssm_norm.weight": [head_dim],
        "blk.0.attn_output.weight": [inner, hidden],
        "blk.0.ffn_gate.weight": [hidden, text["intermediate_size"]],
        "blk.1.exp_probs_b.bias": [tiny.EXPERTS],
        "blk.1.ffn_gate_shexp.weight": [hidden, text["moe_shared_expert_intermediate_size"]],
        "blk.3.attn_q_a.weight": [hidden, q_lora],
        "blk.3.attn_q_b.weight": [q_lora, heads * (nope + rope)],
        "blk.3.attn_kv_a_mqa.weight": [hidden, kv_lora + rope],
        "blk.3.attn_kv_a_norm.weight": [kv_lora],
        "blk.3.attn_k_b.weight": [nope, kv_lora, heads],
        "blk.3.attn_v_b.weight": [kv_lora, v_dim, heads],
        "blk.3.attn_gate.weight": [hidden, heads],
        "blk.3.attn_output.weight": [heads * v_dim, hidden],
    }
    assert {name: list(tensors[name].shape) for name in shapes} == shapes
    for absent in ("blk.3.ssm_a", "blk.0.attn_q_a.weight", "blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate.weight"):
        assert absent not in tensors, absent
    expected = {
        "bailingmoe3.attention.head_count_kv": [0, 0, 0, 1],  # 0 marks a KDA layer
        "bailingmoe3.attention.key_length_mla": nope + rope,
        "bailingmoe3.attention.value_length_mla": v_dim,
        "bailingmoe3.attention.kv_lora_rank": kv_lora,
        "bailingmoe3.attention.q_lora_rank": q_lora,
        "bailingmoe3.rope.dimension_count": rope,
        "bailingmoe3.kda.head_dim": head_dim,
        "bailingmoe3.kda.safe_gate": True,
        "bailingmoe3.kda.gate_lower_bound": -5.0,
        "bailingmoe3.ssm.conv_kernel": kernel,
        "bailingmoe3.leading_dense_block_count": 1,
        "bailingmoe3.expert_group_count": 4,
        "bailingmoe3.expert_group_used_count": 2,
        "bailingmoe3.expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "bailingmoe3.expert_weights_norm": True,
        "bailingmoe3.expert_weights_scale": 2.5,
        "bailingmoe3.expert_shared_count": 1,
    }
    assert {k: _field(reader, k) for k in expected} == expected

    data = {name: np.asarray(t.data, np.float32) for name, t in tensors.items()}
    attention = "model.layers.0.attention"
    a_log = _source(peer.src, f"{attention}.A_log")
    assert a_log.std() > 0.1  # spread by the fixture, so exp() is tested
    np.testing.assert_allclose(data["blk.0.ssm_a"], np.exp(a_log)[:, None], rtol=1e-6)
    np.testing.assert_array_equal(data["blk.0.ssm_dt.bias"], _source(peer.src, f"{attention}.dt_bias"))
    conv = _source(peer.src, f"{attention}.k_conv1d")  # [C, K, 1]
    np.testing.assert_array_equal(data["blk.0.ssm_conv1d_k.weight"], conv[..., 0][:, None, :])
    bias = _source(peer.src, "model.layers.1.mlp.gate.expert_bias")
    np.testing.assert_array_equal(data["blk.1.exp_probs_b.bias"], bias)
    embed_q = _source(peer.src, "model.layers.3.attention.embed_q")  # [heads, kv_lora, nope]
    np.testing.assert_allclose(data["blk.3.attn_k_b.weight"], embed_q, rtol=1e-3, atol=1e-4)
    unembed = _source(peer.src, "model.layers.3.attention.unembed_out")  # [heads, v_dim, kv_lora]
    np.testing.assert_allclose(data["blk.3.attn_v_b.weight"], unembed, rtol=1e-3, atol=1e-4)
    norm = _source(peer.src, "model.layers.0.input_layernorm")
    np.testing.assert_array_equal(data["blk.0.attn_norm.weight"], norm)


def test_refuses_what_llama_cpp_cannot_run():
    """Each refusal names config.json and the field."""
    where = Path("ckpt/config.json")
    with pytest.raises(GGUFConversionError, match="config.json.*mlp_only_layers"):
        check_config({"model_type": "qwen3_moe", "mlp_only_layers": [0], "norm_topk_prob": True}, where)
    with pytest.raises(GGUFConversionError, match="config.json.*norm_topk_prob"):
        check_config({"model_type": "qwen3_moe", "norm_topk_prob": False}, where)
    with pytest.raises(GGUFConversionError, match="config.json.*model_type 'bailing_moe'.*qwen3_5_moe"):
        check_config({"model_type": "bailing_moe"}, where)
    qwen35 = tiny.tiny_config("qwen3_5_moe")
    check_config(qwen35, where)
    refused = {
        "linear_value_head_dim": ({"linear_value_head_dim": 64}, "qwen35moe.*linear_key_head_dim=32 != linear_value"),
        "norm_topk_prob": ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        "attention_bias": ({"attention_bias": True}, "attention_bias=true"),
        "rope_type": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        "mrope_section": ({"rope_parameters": {"mrope_section": [8, 0, 0]}}, r"mrope_section=\[8, 0, 0\]"),
        "num_experts": ({"num_experts": 0}, "num_experts=0"),
    }
    for field, (change, message) in refused.items():
        config = copy.deepcopy(qwen35)
        config["text_config"] |= change
        with pytest.raises(GGUFConversionError, match=f"config.json.*{message}"):
            check_config(config, where)
    ling = tiny.tiny_config("bailing_moe_v3")
    check_config(ling, where)
    # Ling 3.0 says bailing_hybrid and loads by its architecture; without it, mlx-lm loads another model.
    with pytest.raises(GGUFConversionError, match="config.json.*model_type 'bailing_hybrid'.*bailing_moe_v3"):
        check_config(ling | {"architectures": []}, where)
    refused = {
        "kda_lower_bound": ({"kda_lower_bound": 0.0}, "bailingmoe3.*kda_lower_bound=0.0"),
        "kda_safe_gate": ({"kda_safe_gate": False}, "kda_safe_gate=false"),
        "no_kda_lora": ({"no_kda_lora": False}, "no_kda_lora=false"),
        "rope_scaling": ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling=.*yarn"),
        "num_shared_experts": ({"num_shared_experts": 0}, "num_shared_experts=0"),
        "n_group": ({"n_group": 3}, "num_experts=16 is not a multiple of n_group=3"),
    }
    for field, (change, message) in refused.items():
        with pytest.raises(GGUFConversionError, match=f"config.json.*{message}"):
            check_config(ling | change, where)


def _expert_picks(model) -> list[np.ndarray]:
    """Per MoE layer, each token's routed set (sorted ids), recorded at the router:
    the top-k of its logits (qwen), or the ids it returns (bailing's grouped,
    biased selection)."""
    outputs = []

    class Recorder(nn.Module):
        def __init__(self, gate):
            super().__init__()
            self.inner = gate

        def __call__(self, x):
            out = self.inner(x)
            outputs.append(out)
            return out

    moe = [layer.mlp for layer in model.layers if "gate" in layer.mlp]  # not a dense MLP
    for mlp in moe:
        mlp.gate = Recorder(mlp.gate)
    model(mx.array(TOKENS)[None])
    if isinstance(outputs[0], tuple):
        return [np.sort(np.array(ids[0]), axis=-1) for ids, _ in outputs]
    k = moe[0].top_k
    return [np.sort(np.argsort(-np.array(g[0]), axis=-1)[:, :k], axis=-1) for g in outputs]


def _same_routing(a: list[np.ndarray], b: list[np.ndarray]) -> list[float]:
    """Per layer, the share of tokens routed to the same set."""
    assert [x.shape for x in a] == [y.shape for y in b]
    return [float(np.all(x == y, axis=-1).mean()) for x, y in zip(a, b)]


def test_requantized_experts_route_like_int4(peer):
    """The Q4_0 requantization alone, inside mlx-lm: the same routing and greedy
    tokens (qwen3_moe: all; qwen3_5_moe: but near-ties)."""
    bounds = peer.bounds
    int4 = _expert_picks(load_stock(peer.src))
    q4_0 = _expert_picks(with_gguf_experts(load_stock(peer.src), peer.path))
    assert np.mean(_same_routing(int4, q4_0)) >= bounds.requant_routing
    ref, req = _mlx_logits(load_stock(peer.src)), _mlx_logits(with_gguf_experts(load_stock(peer.src), peer.path))
    assert np.abs(ref - req).max() / ref.std() < bounds.max_over_std
    assert (ref.argmax(-1) == req.argmax(-1)).mean() >= bounds.requant_greedy


def test_llama_cpp_logits_match_mlx_lm(peer):
    bounds = peer.bounds
    got = _llama_logits(peer.path)
    ref = _mlx_logits(load_stock(peer.src))
    assert got.shape == ref.shape
    diff = np.abs(got - ref)
    assert diff.max() / ref.std() < bounds.max_over_std
    assert diff.mean() / ref.std() < bounds.mean_over_std
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= bounds.greedy
    q4_0 = _mlx_logits(with_gguf_experts(load_stock(peer.src), peer.path))
    assert np.abs(got - q4_0).max() / ref.std() < bounds.llama_vs_q4_0_max_over_std


def test_llama_cpp_load_modes_and_step_decode_agree(peer):
    """Direct I/O loads the same weights; one token at a time (the bench's
    decode) computes what one batched forward computes."""
    _needs_llama_cpp()
    from mlx_edge0.bench.llamacpp import LlamaCppModel

    batched = _llama_logits(peer.path)
    assert np.array_equal(_llama_logits(peer.path, load_mode="direct-io"), batched)
    with LlamaCppModel(peer.path) as m:
        steps = np.concatenate([m.forward([t]) for t in TOKENS])
        m.reset()
        again = m.forward(TOKENS[:4], all_logits=True)
    # measured 0.0041 / 0.0043 / 0.0068 (different matmul batching; qwen3_5_moe, bailing_moe_v3: recurrent vs
    # chunked delta rule)
    assert np.abs(steps - batched).max() < 0.01
    assert np.array_equal(again, batched[:4])


def test_no_tokenizer_writes_vocab_size_only(peer, tmp_path):
    """A synth checkpoint has no tokenizer.json: llama.cpp runs it on ids alone."""
    bare = tmp_path / "bare"
    shutil.copytree(peer.src, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    report = write_gguf(bare, tmp_path / "bare.gguf")
    assert report.tokenizer == "none"
    if _has_llama_cpp():
        assert np.array_equal(_llama_logits(tmp_path / "bare.gguf"), _llama_logits(peer.path))


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_arms_run_on_the_gguf(peer, tmp_path):
    """The llamacpp arms in a fresh child, as `edge0 bench run` runs them, with
    the GGUF found beside the stock checkpoint (STOCK.gguf)."""
    _needs_llama_cpp()
    from mlx_edge0.bench.arms import peer_gguf_path
    from mlx_edge0.bench.run_spec import forced_tokens
    from mlx_edge0.bench.runner import BenchOptions, run_child

    assert peer_gguf_path(peer.src) == peer.path
    vocab = text_config(tiny.tiny_config(peer.model_type))["vocab_size"]
    options = BenchOptions(
        out=tmp_path / "r.json", stock=peer.src, arms=("llamacpp", "llamacpp-direct"), caches=("cold",)
    )
    for arm in options.arms:
        spec = options.spec(arm, "cold")
        assert spec.path == peer.path and spec.k == 0
        record = run_child(spec, timeout_s=300)
        assert record["ok"], record.get("stderr_tail")
        assert record["load_mode"] == {"llamacpp": "mmap", "llamacpp-direct": "direct-io"}[arm]
        assert record["teacher_forced"] and record["logits_finite"]
        assert record["fed_tokens"] == forced_tokens(vocab, 2 + spec.decode_tokens, spec.seed)
        assert len(record["tokens"]) == 1 + 2 + spec.decode_tokens
        assert len(record["decode_step_s"]) == spec.decode_tokens
        for key in ("load_s", "prefill_tok_s", "decode_tok_s", "ttft_s", "peak_rss"):
            assert record[key] > 0


def test_bench_options_need_the_gguf(tmp_path):
    from mlx_edge0.bench.arms import parse_arm
    from mlx_edge0.bench.runner import BenchOptions

    with pytest.raises(ValueError, match="edge0 bench gguf STOCK"):
        BenchOptions(out=tmp_path / "r.json", stock=tmp_path, arms=("llamacpp",))
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arm("llamacpp+bypass")


def test_llama_cpp_routes_like_mlx_lm(peer):
    """The two arms' routing traces on the same teacher-forced tokens: llama.cpp's
    routed sets (its ffn_moe_topk tensors) against mlx-lm's, layer by layer."""
    _needs_llama_cpp()
    from mlx_edge0.bench.llamacpp import LlamaCppModel

    with LlamaCppModel(peer.path, trace_routing=True) as m:
        m.forward(TOKENS, all_logits=True)
        llama = m.routing()
    same = _same_routing(llama, _expert_picks(load_stock(peer.src)))
    assert same[0] == 1.0  # the first router sees only embedding + attention
    assert np.mean(same) >= peer.bounds.routing, same


@pytest.mark.parametrize("bits", [4, 8, 3])
def test_dequantize_affine_equals_mlx(bits):
    from mlx_edge0.bench.gguf_peer import dequantize_affine

    x = mx.random.normal((6, 256), key=mx.random.key(bits))
    w, scales, biases = mx.quantize(x, group_size=64, bits=bits)
    ref = mx.dequantize(w, scales, biases, group_size=64, bits=bits)
    assert mx.array_equal(dequantize_affine(w, scales, biases, bits=bits, group_size=64), ref)


def test_stock_llama_class_loads_and_tokenizes_like_tokenizers(peer, tokenizer_dir):
    """What a user would run: llama_cpp.Llama on the GGUF (its default load,
    which repacks Q4_0) computes the same logits within the Q8_0-activation
    noise, and its tokenizer (the gpt2 vocabulary and merges written from
    tokenizer.json) splits text as the checkpoint's tokenizer does."""
    llama_cpp = _needs_llama_cpp()
    from tokenizers import Tokenizer

    llm = llama_cpp.Llama(
        model_path=str(peer.path), use_mmap=True, n_threads=2, logits_all=True, n_ctx=64, verbose=False
    )
    llm.eval(TOKENS)
    scores = np.array(llm.scores[: len(TOKENS)])
    ours = _llama_logits(peer.path)
    # measured 0.012 (qwen3_moe), 0.018 (qwen3_5_moe), 0.020 (bailing_moe_v3)
    assert np.abs(scores - ours).max() / ours.std() < peer.bounds.llama_vs_q4_0_max_over_std
    reference = Tokenizer.from_file(str(peer.src / "tokenizer.json"))
    for text in ("def f(x):\n    return x  # done", "import os, sys\n\nclass A(object):\n\tpass"):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == reference.encode(text).ids


def test_q4_0_resident_matrices(peer, tmp_path):
    """``resident_type="q4_0"`` requantizes attention, linear attention, shared
    experts, embedding and LM head as the experts are (the int4 checkpoint's
    bytes, for memory-capped runs); routers, gates, convolution and norms stay
    F32; the experts and their reported error are unchanged, and llama.cpp still
    computes the model."""
    bounds = peer.bounds
    small = write_gguf(peer.src, tmp_path / "q4.gguf", resident_type="q4_0")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "q4.gguf").tensors}
    q4_0, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    assert {name: tensors[name].tensor_type for name in bounds.q4_0_names} == dict.fromkeys(bounds.q4_0_names, q4_0)
    assert {name: tensors[name].tensor_type for name in bounds.f32_names} == dict.fromkeys(bounds.f32_names, f32)
    assert small.expert_bytes == peer.report.expert_bytes and small.expert_rel_error == peer.report.expert_rel_error
    assert small.file_bytes < peer.report.file_bytes
    if _has_llama_cpp():
        got, ref = _llama_logits(tmp_path / "q4.gguf"), _mlx_logits(load_stock(peer.src))
        diff = np.abs(got - ref) / ref.std()
        max_over_std, mean_over_std, greedy = bounds.q4_0_resident
        assert diff.max() < max_over_std and diff.mean() < mean_over_std
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= greedy

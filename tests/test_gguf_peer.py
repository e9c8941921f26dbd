"""The peer arm's GGUF: the tiny qwen3_moe written by bench/gguf_peer.py, run by llama.cpp.

Tolerances (measured on this fixture, seed 0, 32 teacher-forced tokens, logits
std 0.57; a bound is two to five times the measurement so another CPU's SIMD
path or llama.cpp release passes, while a wrong tensor layout, a missing norm or
a transposed projection, which move logits by the size of their spread, fails):

- mlx-lm on the int4 checkpoint vs mlx-lm with the GGUF's Q4_0 experts:
  max |d logit| 0.036 (the requantization: no bias, blocks of 32), identical
  routed sets on every layer and token, identical greedy tokens.
- mlx-lm with the Q4_0 experts vs llama.cpp: max 0.009 (llama.cpp's numerics:
  F16 resident matrices, activations quantized to Q8_0 for Q4_0 matmuls).
- mlx-lm int4 vs llama.cpp, end to end: max 0.043, mean 0.0062; greedy next
  tokens agree on 32 of 32 positions; routed sets (llama.cpp's ffn_moe_topk
  against mlx-lm's router top-k) identical on 128 of 128 (token, layer) pairs.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map_with_path

from mlx_edge0 import tiny

gguf = pytest.importorskip("gguf", reason='the GGUF writer needs the peers extra: pip install -e ".[peers]"')

from mlx_edge0.bench.gguf_peer import (  # noqa: E402
    GGUFConversionError,
    check_config,
    with_gguf_experts,
    write_gguf,
)
from conftest import load_stock  # noqa: E402

TOKENS = np.random.default_rng(0).integers(3, 512, 32).tolist()  # teacher-forced, fixed
MAX_ABS_OVER_STD = 0.15  # measured 0.075 end to end
MEAN_ABS_OVER_STD = 0.03  # measured 0.011
LLAMA_VS_Q4_0_MAX_OVER_STD = 0.05  # measured 0.016
GREEDY_AGREEMENT = 0.9  # measured 32/32
ROUTING_AGREEMENT = 0.9  # routed sets identical, (token, layer) pairs: measured 128/128
# Resident matrices requantized too (every matmul rounds again): measured max 0.42, mean
# 0.070, greedy 28/32; a wrong layout moves the mean by about the logits' spread.
Q4_0_RESIDENT_MAX_OVER_STD, Q4_0_RESIDENT_MEAN_OVER_STD, Q4_0_RESIDENT_GREEDY = 1.0, 0.15, 0.75


def _needs_llama_cpp():
    return pytest.importorskip("llama_cpp", reason='llama.cpp needs the peers extra: pip install -e ".[peers]"')


@pytest.fixture(scope="module")
def peer(tmp_path_factory, tokenizer_dir):
    """(stock int4 checkpoint, its GGUF, the writer's report) of a tiny qwen3_moe
    whose every layer is MoE, as llama.cpp's qwen3moe requires."""
    root = tmp_path_factory.mktemp("peer")
    config = tiny.tiny_config("qwen3_moe")
    config["mlp_only_layers"] = []
    arch = tiny.model_module(config)
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))
    model.update(tree_map_with_path(tiny._randomize, model.parameters()))
    mx.eval(model.parameters())
    src = tiny.save_mlx(model, config, root / "stock", tokenizer_dir, bits=4)
    report = write_gguf(src, root / "stock.gguf")
    return src, root / "stock.gguf", report


def _mlx_logits(model) -> np.ndarray:
    return np.array(model(mx.array(TOKENS)[None])[0].astype(mx.float32))


def _llama_logits(path: Path, **kwargs) -> np.ndarray:
    _needs_llama_cpp()
    from mlx_edge0.bench.llamacpp import LlamaCppModel

    with LlamaCppModel(path, **kwargs) as m:
        return m.forward(TOKENS, all_logits=True)


def test_gguf_layout(peer):
    src, path, report = peer
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    assert tensors["blk.3.ffn_gate_exps.weight"].tensor_type == q4_0
    assert list(tensors["blk.3.ffn_gate_exps.weight"].shape) == [tiny.HIDDEN, tiny.MOE_INTERMEDIATE, tiny.EXPERTS]
    assert list(tensors["blk.3.ffn_down_exps.weight"].shape) == [tiny.MOE_INTERMEDIATE, tiny.HIDDEN, tiny.EXPERTS]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensors) == 3 + tiny.LAYERS * 12
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3moe"
    assert report.tokenizer == "gpt2" and report.tensors == len(tensors)
    # Q4_0 keeps 4.5 bits per expert weight, like int4 g64 with bf16 scales and biases.
    weights = tiny.LAYERS * tiny.EXPERTS * 3 * tiny.HIDDEN * tiny.MOE_INTERMEDIATE
    assert report.expert_bytes * 8 / weights == 4.5
    assert 0 < report.expert_rel_error < 0.05  # measured 0.030


def test_refuses_what_qwen3moe_cannot_run():
    with pytest.raises(GGUFConversionError, match="mlp_only_layers"):
        check_config({"model_type": "qwen3_moe", "mlp_only_layers": [0], "norm_topk_prob": True}, Path("x"))
    with pytest.raises(GGUFConversionError, match="norm_topk_prob"):
        check_config({"model_type": "qwen3_moe", "norm_topk_prob": False}, Path("x"))


def _expert_picks(model) -> list[np.ndarray]:
    """Per MoE layer, each token's routed set (sorted ids), recorded at the router."""
    logits = []

    class Recorder(nn.Module):
        def __init__(self, gate):
            super().__init__()
            self.inner = gate

        def __call__(self, x):
            out = self.inner(x)
            logits.append(out)
            return out

    for layer in model.model.layers:
        layer.mlp.gate = Recorder(layer.mlp.gate)
    model(mx.array(TOKENS)[None])
    k = model.model.layers[0].mlp.top_k
    return [np.sort(np.argsort(-np.array(g[0]), axis=-1)[:, :k], axis=-1) for g in logits]


def test_requantized_experts_route_like_int4(peer):
    """The Q4_0 requantization alone, inside mlx-lm: same routing, same greedy tokens."""
    src, path, _ = peer
    int4 = _expert_picks(load_stock(src))
    q4_0 = _expert_picks(with_gguf_experts(load_stock(src), path))
    assert all(np.array_equal(a, b) for a, b in zip(int4, q4_0))
    ref, req = _mlx_logits(load_stock(src)), _mlx_logits(with_gguf_experts(load_stock(src), path))
    assert np.abs(ref - req).max() / ref.std() < MAX_ABS_OVER_STD
    assert np.array_equal(ref.argmax(-1), req.argmax(-1))


def test_llama_cpp_logits_match_mlx_lm(peer):
    src, path, _ = peer
    got = _llama_logits(path)
    ref = _mlx_logits(load_stock(src))
    assert got.shape == ref.shape
    diff = np.abs(got - ref)
    assert diff.max() / ref.std() < MAX_ABS_OVER_STD
    assert diff.mean() / ref.std() < MEAN_ABS_OVER_STD
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= GREEDY_AGREEMENT
    q4_0 = _mlx_logits(with_gguf_experts(load_stock(src), path))
    assert np.abs(got - q4_0).max() / ref.std() < LLAMA_VS_Q4_0_MAX_OVER_STD


def test_llama_cpp_load_modes_and_step_decode_agree(peer):
    """Direct I/O loads the same weights; one token at a time (the bench's
    decode) computes what one batched forward computes."""
    _needs_llama_cpp()
    from mlx_edge0.bench.llamacpp import LlamaCppModel

    _, path, _ = peer
    batched = _llama_logits(path)
    assert np.array_equal(_llama_logits(path, load_mode="direct-io"), batched)
    with LlamaCppModel(path) as m:
        steps = np.concatenate([m.forward([t]) for t in TOKENS])
        m.reset()
        again = m.forward(TOKENS[:4], all_logits=True)
    assert np.abs(steps - batched).max() < 0.01  # measured 0.0041 (different matmul batching)
    assert np.array_equal(again, batched[:4])


def test_no_tokenizer_writes_vocab_size_only(peer, tmp_path):
    """A synth checkpoint has no tokenizer.json: llama.cpp runs it on ids alone."""
    src, path, _ = peer
    bare = tmp_path / "bare"
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    report = write_gguf(bare, tmp_path / "bare.gguf")
    assert report.tokenizer == "none"
    if _has_llama_cpp():
        assert np.array_equal(_llama_logits(tmp_path / "bare.gguf"), _llama_logits(path))


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
    from mlx_edge0.bench.measure import forced_tokens, peer_gguf_path
    from mlx_edge0.bench.runner import BenchOptions, run_child

    src, path, _ = peer
    assert peer_gguf_path(src) == path
    options = BenchOptions(out=tmp_path / "r.json", stock=src, arms=("llamacpp", "llamacpp-direct"), caches=("cold",))
    for arm in options.arms:
        spec = options.spec(arm, "cold")
        assert spec.path == path and spec.k == 0
        record = run_child(spec, timeout_s=300)
        assert record["ok"], record.get("stderr_tail")
        assert record["load_mode"] == {"llamacpp": "mmap", "llamacpp-direct": "direct-io"}[arm]
        assert record["teacher_forced"] and record["logits_finite"]
        assert record["fed_tokens"] == forced_tokens(tiny_vocab(), 2 + spec.decode_tokens, spec.seed)
        assert len(record["tokens"]) == 1 + 2 + spec.decode_tokens
        assert len(record["decode_step_s"]) == spec.decode_tokens
        for key in ("load_s", "prefill_tok_s", "decode_tok_s", "ttft_s", "peak_rss"):
            assert record[key] > 0


def test_bench_options_need_the_gguf(peer, tmp_path):
    from mlx_edge0.bench.measure import parse_arm
    from mlx_edge0.bench.runner import BenchOptions

    src, _, _ = peer
    with pytest.raises(ValueError, match="edge0 bench gguf STOCK"):
        BenchOptions(out=tmp_path / "r.json", stock=tmp_path, arms=("llamacpp",))
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arm("llamacpp+bypass")


def tiny_vocab() -> int:
    return tiny.tiny_config("qwen3_moe")["vocab_size"]


def test_llama_cpp_routes_like_mlx_lm(peer):
    """The two arms' routing traces on the same teacher-forced tokens: llama.cpp's
    routed sets (its ffn_moe_topk tensors) against mlx-lm's, layer by layer."""
    _needs_llama_cpp()
    from mlx_edge0.bench.llamacpp import LlamaCppModel

    src, path, _ = peer
    with LlamaCppModel(path, trace_routing=True) as m:
        m.forward(TOKENS, all_logits=True)
        llama = m.routing()
    mlx = _expert_picks(load_stock(src))
    assert [a.shape for a in llama] == [b.shape for b in mlx]
    same = [np.all(a == b, axis=-1).mean() for a, b in zip(llama, mlx)]
    assert same[0] == 1.0  # the first router sees only embedding + attention
    assert np.mean(same) >= ROUTING_AGREEMENT, same


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

    src, path, _ = peer
    llm = llama_cpp.Llama(model_path=str(path), use_mmap=True, n_threads=2, logits_all=True, n_ctx=64, verbose=False)
    llm.eval(TOKENS)
    scores = np.array(llm.scores[: len(TOKENS)])
    ours = _llama_logits(path)
    assert np.abs(scores - ours).max() / ours.std() < LLAMA_VS_Q4_0_MAX_OVER_STD  # measured 0.0066 / 0.57
    reference = Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in ("def f(x):\n    return x  # done", "import os, sys\n\nclass A(object):\n\tpass"):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == reference.encode(text).ids


def test_q4_0_resident_matrices(peer, tmp_path):
    """``resident_type="q4_0"`` requantizes attention, embedding and LM head as
    the experts are (the int4 checkpoint's bytes, for memory-capped runs); the
    experts and their reported error are unchanged, and llama.cpp still
    computes the model."""
    src, path, report = peer
    small = write_gguf(src, tmp_path / "q4.gguf", resident_type="q4_0")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "q4.gguf").tensors}
    q4_0, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    for name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.3.attn_output.weight"):
        assert tensors[name].tensor_type == q4_0, name
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == f32
    assert tensors["blk.0.attn_norm.weight"].tensor_type == f32
    assert small.expert_bytes == report.expert_bytes and small.expert_rel_error == report.expert_rel_error
    assert small.file_bytes < report.file_bytes
    if _has_llama_cpp():
        got, ref = _llama_logits(tmp_path / "q4.gguf"), _mlx_logits(load_stock(src))
        diff = np.abs(got - ref) / ref.std()
        assert diff.max() < Q4_0_RESIDENT_MAX_OVER_STD and diff.mean() < Q4_0_RESIDENT_MEAN_OVER_STD
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= Q4_0_RESIDENT_GREEDY

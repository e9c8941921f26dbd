"""Tiny random source models: configs, weights, tokenizer and checkpoint writers.

The CPU build of mlx runs unquantized gather_mm in float32 only, so logits of
unquantized checkpoints are compared in float32, and bfloat16 checkpoints are
compared tensor by tensor (same tensors, same logits). Quantized bfloat16
checkpoints run on CPU and are compared by logits.
"""

import copy
import json
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import load, load_model

from mlx_edge0 import tiny

FAMILIES = tiny.FAMILIES
TOKENS = mx.array([[0, 17, 300, 45, 511, 256, 2, 99, 128, 7, 401, 1]])
TEXT = "def f(x):\n    return {'a': x ** 2}  # héllo ✓\n"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return tiny.train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@lru_cache(maxsize=None)
def built(family):
    return tiny.build_tiny_model(family)


def logits(model, tokens=TOKENS):
    out = model(tokens)
    mx.eval(out)
    return out


def params(model):
    return dict(tree_flatten(model.parameters()))


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        assert pa[k].shape == pb[k].shape, k
        assert mx.array_equal(pa[k], pb[k]).item(), k


def moe_blocks(model):
    return [(i, layer.mlp) for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "switch_mlp")]


class Recorder(nn.Module):
    """Wraps a SwitchGLU and keeps the expert indices it is asked for."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen = []

    def __call__(self, x, indices):
        self.seen.append(indices)
        return self.inner(x, indices)


def routed_indices(model, tokens):
    model = copy.deepcopy(model)
    recorders = {}
    for i, block in moe_blocks(model):
        block.switch_mlp = recorders[i] = Recorder(block.switch_mlp)
    logits(model, tokens)
    return {i: r.seen[0].reshape(-1, r.seen[0].shape[-1]) for i, r in recorders.items()}


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_is_deterministic(tmp_path):
    a = tiny.train_tokenizer(tmp_path / "a")
    b = tiny.train_tokenizer(tmp_path / "b", vocab_size=512)
    for name in tiny.TOKENIZER_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    vocab = json.loads((a / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 512 and vocab["<|im_end|>"] == 2
    assert max(vocab.values()) == 511


def test_tokenizer_loads_offline(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 2, 0)
    assert tok.unk_token == "<|endoftext|>"
    ids = tok.encode(TEXT)
    assert all(0 <= i < 512 for i in ids)
    assert len(ids) < len(TEXT.encode()) * 0.8  # merges were learned
    assert tok.decode(ids) == TEXT
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    from mlx_lm.utils import load_tokenizer

    wrapped = load_tokenizer(tokenizer_dir)
    detok = wrapped.detokenizer
    assert isinstance(detok, BPEStreamingDetokenizer)
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == TEXT


# ---------------------------------------------------------------- configs and weights


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_and_model(family):
    config = tiny.tiny_config(family)
    assert json.loads(json.dumps(config)) == config
    assert config["tie_word_embeddings"] is False
    text = config.get("text_config", config)
    assert (text["hidden_size"], text["num_hidden_layers"]) == (128, 4)
    assert (text["num_experts"], text["num_experts_per_tok"]) == (16, 4)
    assert text["moe_intermediate_size"] == 64 and text["vocab_size"] == 512
    expected_type = {"bailing_moe_v3": "bailing_hybrid"}.get(family, family)
    assert config["model_type"] == expected_type
    assert tiny.model_module(config).__name__ == f"mlx_lm.models.{family}"

    model, cfg = built(family)
    assert cfg == config  # building did not rewrite the config
    dense = {"qwen3_5_moe": set()}.get(family, {0})
    assert {i for i, _ in moe_blocks(model)} == {0, 1, 2, 3} - dense
    for _, block in moe_blocks(model):
        assert isinstance(block.switch_mlp, SwitchGLU)
        assert block.switch_mlp.gate_proj.weight.shape == (16, 64, 128)
        assert block.switch_mlp.down_proj.weight.shape == (16, 128, 64)
    if family in ("qwen3_next", "qwen3_5_moe", "bailing_moe_v3"):
        assert [layer.is_linear for layer in model.layers] == [True, True, True, False]
    p = params(model)
    assert all(v.dtype == mx.float32 for v in p.values())
    norms = [v for k, v in p.items() if k.endswith("input_layernorm.weight")]
    assert len(norms) == 4 and all(mx.abs(v - 1).max().item() > 0 for v in norms)
    biases = [v for k, v in p.items() if k.endswith("expert_bias")]
    assert len(biases) == (3 if family.startswith("bailing") else 0)
    assert all(mx.all(v != 0).item() for v in biases)

    again, _ = tiny.build_tiny_model(family, seed=0)
    assert_same_params(model, again)
    other, _ = tiny.build_tiny_model(family, seed=1)
    assert not mx.array_equal(logits(model), logits(other)).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_quantizable_linear_is_quantized(family):
    model, config = built(family)
    qmodel, qconfig = tiny.convert_model(model, config, bits=4)
    predicate = qmodel.quant_predicate
    left = [p for p, m in qmodel.named_modules() if hasattr(m, "to_quantized") and predicate(p, m)]
    assert left == []  # quantize_model silently skips input dims not divisible by 64
    kinds = {type(m).__name__ for _, m in qmodel.named_modules()}
    assert {"QuantizedLinear", "QuantizedSwitchLinear"} <= kinds
    eights = [k for k, v in qconfig["quantization"].items() if isinstance(v, dict)]
    if family != "bailing_moe_v3":  # its router is a bare weight, never quantized
        assert len(eights) >= 3 and all(qconfig["quantization"][k]["bits"] == 8 for k in eights)


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_spread_and_bias_matters(family):
    model, _ = built(family)
    tokens = mx.arange(64).reshape(1, -1) * 7 % 512
    routed = routed_indices(model, tokens)
    for i, inds in routed.items():
        assert inds.shape == (64, 4)
        assert len(set(inds.flatten().tolist())) >= 14, i
        assert len({tuple(sorted(r)) for r in inds.tolist()}) >= 40, i
    if family.startswith("bailing"):
        unbiased = copy.deepcopy(model)
        for _, block in moe_blocks(unbiased):
            block.gate.expert_bias = mx.zeros_like(block.gate.expert_bias)
        first = min(routed)
        a = [set(r) for r in routed[first].tolist()]
        b = [set(r) for r in routed_indices(unbiased, tokens)[first].tolist()]
        assert 0 < sum(x != y for x, y in zip(a, b)) < 64


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stays_finite(family):
    model, config = built(family)
    qmodel, _ = tiny.convert_model(model, config, bits=4, dtype=mx.bfloat16)
    for m, dtype in ((model, mx.float32), (qmodel, mx.bfloat16)):
        steps = list(generate_step(TOKENS[0], m, max_tokens=100))
        assert len(steps) == 100
        logprobs = mx.stack([lp for _, lp in steps])
        assert logprobs.dtype == dtype
        assert mx.all(mx.isfinite(logprobs)).item()
        assert len({t for t, _ in steps}) > 1


# ---------------------------------------------------------------- writers


@pytest.mark.parametrize("family", FAMILIES)
def test_save_mlx_round_trip(family, tmp_path, tokenizer_dir):
    model, config = built(family)
    out = tiny.save_mlx(model, config, tmp_path / "f32", tokenizer_dir, dtype=mx.float32)
    assert {"model.safetensors", "model.safetensors.index.json", *tiny.TOKENIZER_FILES} <= {
        p.name for p in out.iterdir()
    }
    saved = mx.load(str(out / "model.safetensors"))
    stacked = [k for k in saved if ".mlp.switch_mlp.gate_proj.weight" in k]
    assert stacked and all(saved[k].shape == (16, 64, 128) for k in stacked)
    assert not any(".experts." in k for k in saved)
    written = json.loads((out / "config.json").read_text())
    assert "quantization" not in written and written["torch_dtype"] == "float32"

    loaded, tokenizer = load(str(out))
    assert tokenizer.eos_token_ids == {2}
    assert_same_params(loaded, model)
    assert mx.array_equal(logits(loaded), logits(model)).item()

    bf16 = tiny.save_mlx(model, config, tmp_path / "bf16", tokenizer_dir)
    loaded, _ = load_model(bf16)
    reference, _ = tiny.convert_model(model, config)
    assert_same_params(loaded, reference)
    if mx.default_device() == mx.gpu:  # unquantized bfloat16 gather_mm needs a GPU
        assert mx.array_equal(logits(loaded), logits(reference)).item()
    p = params(loaded)
    head = [v for k, v in p.items() if k.endswith("lm_head.weight")]
    assert len(head) == 1 and head[0].dtype == mx.bfloat16
    for k, v in p.items():
        if k.endswith(("expert_bias", "A_log")) and family in ("bailing_moe", "qwen3_5_moe"):
            assert v.dtype == mx.float32, k  # the model's cast_predicate keeps these


@pytest.mark.parametrize("family", FAMILIES)
def test_save_mlx_quantized(family, tmp_path, tokenizer_dir):
    model, config = built(family)
    out = tiny.save_mlx(model, config, tmp_path / "q4", tokenizer_dir, bits=4)
    written = json.loads((out / "config.json").read_text())
    assert {k: written["quantization"][k] for k in ("group_size", "bits", "mode")} == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    assert written["quantization_config"] == written["quantization"]

    loaded, _ = load(str(out))
    for _, block in moe_blocks(loaded):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(block.switch_mlp, proj)
            assert isinstance(layer, QuantizedSwitchLinear)
            assert (layer.bits, layer.group_size, layer.mode) == (4, 64, "affine")
            assert layer.scales.dtype == mx.bfloat16
    reference, _ = tiny.convert_model(model, config, bits=4)
    assert_same_params(loaded, reference)
    out_logits = logits(loaded)
    assert out_logits.dtype == mx.bfloat16
    assert mx.array_equal(out_logits, logits(reference)).item()


def hf_round_trip(writer, family, tmp_path, tokenizer_dir):
    """Write with ``writer``; check it loads to the same model as the mlx save."""
    model, config = built(family)
    mlx_dir = tiny.save_mlx(model, config, tmp_path / "mlx", tokenizer_dir, dtype=mx.float32)
    hf_dir = writer(model, config, tmp_path / "hf", tokenizer_dir, dtype=mx.float32)
    from_mlx, _ = load(str(mlx_dir))
    from_hf, _ = load(str(hf_dir))
    assert_same_params(from_hf, from_mlx)
    assert mx.array_equal(logits(from_hf), logits(from_mlx)).item()

    hf16 = writer(model, config, tmp_path / "hf16", tokenizer_dir)
    reference, _ = tiny.convert_model(model, config)
    assert_same_params(load_model(hf16)[0], reference)
    return mx.load(str(hf_dir / "model.safetensors")), model


@pytest.mark.parametrize("family", ["qwen3_moe", "bailing_moe"])
def test_save_hf_per_expert(family, tmp_path, tokenizer_dir):
    saved, model = hf_round_trip(tiny.save_hf_per_expert, family, tmp_path, tokenizer_dir)
    assert not any("switch_mlp" in k for k in saved)
    stacked = params(model)["model.layers.1.mlp.switch_mlp.up_proj.weight"]
    shapes = {"gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    for e in range(16):
        expert = f"model.layers.1.mlp.experts.{e}"
        for proj, shape in shapes.items():
            assert saved[f"{expert}.{proj}.weight"].shape == shape
        assert mx.array_equal(saved[f"{expert}.up_proj.weight"], stacked[e]).item()
    assert not any("model.layers.0.mlp.experts" in k for k in saved)  # dense layer
    if family == "bailing_moe":
        assert saved["model.layers.1.mlp.gate.weight"].shape == (16, 128)
        assert saved["model.layers.1.mlp.gate.expert_bias"].shape == (16,)
        assert not any("gate.gate_proj" in k for k in saved)
    else:
        assert saved["model.layers.1.mlp.gate.weight"].shape == (16, 128)


def test_save_hf_fused(tmp_path, tokenizer_dir):
    saved, model = hf_round_trip(tiny.save_hf_fused, "qwen3_5_moe", tmp_path, tokenizer_dir)
    p = params(model)
    assert "lm_head.weight" in saved and not any(k.startswith("language_model") for k in saved)
    pre = "model.language_model.layers.0"
    gate_up, down = saved[f"{pre}.mlp.experts.gate_up_proj"], saved[f"{pre}.mlp.experts.down_proj"]
    assert gate_up.shape == (16, 128, 128) and down.shape == (16, 128, 64)
    mine = "language_model.model.layers.0.mlp.switch_mlp"
    assert mx.array_equal(gate_up[:, :64], p[f"{mine}.gate_proj.weight"]).item()
    assert mx.array_equal(gate_up[:, 64:], p[f"{mine}.up_proj.weight"]).item()
    assert saved[f"{pre}.linear_attn.conv1d.weight"].shape == (256, 1, 4)
    norm = saved["model.language_model.norm.weight"]
    assert mx.array_equal(norm + 1.0, p["language_model.model.norm.weight"]).item()
    gated = saved[f"{pre}.linear_attn.norm.weight"]  # not shifted by sanitize
    assert mx.array_equal(gated, p["language_model.model.layers.0.linear_attn.norm.weight"]).item()


def test_hf_writers_reject_other_layouts(tmp_path, tokenizer_dir):
    model, config = built("qwen3_next")
    with pytest.raises(ValueError):
        tiny.save_hf_per_expert(model, config, tmp_path / "a", tokenizer_dir)
    with pytest.raises(ValueError):
        tiny.save_hf_fused(model, config, tmp_path / "b", tokenizer_dir)
    qmodel, qconfig = tiny.convert_model(*built("qwen3_moe"), bits=4)
    with pytest.raises(ValueError):
        tiny.save_hf_per_expert(qmodel, qconfig, tmp_path / "c", tokenizer_dir)

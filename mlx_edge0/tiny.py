"""Tiny random-weight source models for tests and for the CLI's default model.

Everything here is built offline from the stock mlx-lm model classes, so a
checkpoint written by these helpers loads with plain ``mlx_lm.utils.load``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import math
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import quantize_model, save_config, save_model

from .families import FAMILIES, check_covers
from .model_patches import resolve_model_type

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2  # <|endoftext|>, <|im_end|>: trained first, so ids are fixed

# Standard library modules present in every CPython 3.10+; sorted for determinism.
CORPUS_FILES = (
    "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "enum.py",
    "fractions.py", "functools.py", "heapq.py", "inspect.py", "os.py",
    "random.py", "shutil.py", "string.py", "textwrap.py", "typing.py",
)  # fmt: skip

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

HIDDEN, LAYERS, EXPERTS, TOP_K = 128, 4, 16, 4
MOE_INTERMEDIATE, DENSE_INTERMEDIATE = 64, 256
ROUTER_STD = 2.0  # router logit std for unit-RMS inputs: tokens disagree on experts
EXPERT_BIAS_STD = 0.1  # comparable to sigmoid score gaps, so the bias changes picks
NORM_SPREAD = 0.1  # norm weights in [0.9, 1.1]: non-trivial, and +-1 stays exact
EMBED_STD = 0.5  # token identity, not the shared attention mix, should drive routing


def train_tokenizer(out_dir: Path, vocab_size: int = 512, texts: Optional[Sequence[str]] = None) -> Path:
    """Train a byte-level BPE tokenizer on stdlib sources, which every machine has.

    ``texts`` defaults to :data:`CORPUS_FILES`; the training corpus passes its
    train split. The same texts in the same order give byte-identical
    ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if texts is None:
        root = Path(os.__file__).parent
        files = [root / n for n in CORPUS_FILES if (root / n).is_file()]
        texts = [f.read_text(encoding="utf-8") for f in files]
        if not texts:
            raise FileNotFoundError(f"No standard library sources under {root}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet")
    tok.save(str(out_dir / "tokenizer.json"))

    special = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {**special, "additional_special_tokens": SPECIAL_TOKENS[1:]}
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return out_dir


_COMMON = {
    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "hidden_act": "silu",
    "hidden_size": HIDDEN, "initializer_range": 0.02, "max_position_embeddings": 4096,
    "moe_intermediate_size": MOE_INTERMEDIATE, "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_hidden_layers": LAYERS, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
_QWEN3 = {
    **_COMMON, "attention_bias": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "intermediate_size": DENSE_INTERMEDIATE,
    "mlp_only_layers": [0], "norm_topk_prob": True, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "use_cache": True,
}  # fmt: skip
# Value heads x value dim = 128 is out_proj's input; key dim 32 suits the Metal kernel.
_LINEAR_ATTENTION = {
    "full_attention_interval": 4, "head_dim": 64, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_value_head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
    "shared_expert_intermediate_size": MOE_INTERMEDIATE,
}  # fmt: skip
_BAILING = {
    **_COMMON, "first_k_dense_replace": 1, "head_dim": 32,
    "intermediate_size": DENSE_INTERMEDIATE, "n_group": 4, "num_attention_heads": 4,
    "moe_shared_expert_intermediate_size": MOE_INTERMEDIATE, "num_shared_experts": 1,
    "routed_scaling_factor": 2.5, "topk_group": 2,
}  # fmt: skip
_CONFIGS = {
    "qwen3_moe": {
        **_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "head_dim": 32, "max_window_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "use_sliding_window": False,
    },
    "qwen3_next": {
        **_QWEN3, **_LINEAR_ATTENTION, "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next", "partial_rotary_factor": 0.25,
        "rope_scaling": None, "rope_theta": 10000000,
    },
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # Every layer is MoE; the dense-MLP fields of _QWEN3 do not exist here.
        "text_config": {
            **_COMMON, **_LINEAR_ATTENTION, "attention_bias": False,
            "attention_dropout": 0.0, "dtype": "bfloat16",
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "model_type": "qwen3_5_moe_text", "mtp_num_hidden_layers": 0,
            "output_router_logits": False, "router_aux_loss_coef": 0.001,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [3, 3, 2],  # sums to rotary dims / 2 = 64 * 0.25 / 2
                "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                "rope_type": "default",
            },
            "use_cache": True,
        },
    },
    "bailing_moe": {
        **_BAILING, "architectures": ["BailingMoeV2ForCausalLM"],
        "model_type": "bailing_moe", "moe_router_enable_expert_bias": True,
        "norm_head": False, "norm_topk_prob": True, "num_key_value_heads": 2,
        "partial_rotary_factor": 0.5, "rope_theta": 600000, "score_function": "sigmoid",
        "use_bias": False, "use_qk_norm": True, "use_qkv_bias": False,
    },
    # Ling 3 ships as model_type bailing_hybrid; load() remaps it by architecture.
    "bailing_moe_v3": {
        **_BAILING, "architectures": ["BailingMoeV3ForCausalLM"],
        "model_type": "bailing_hybrid", "kda_lower_bound": -5.0, "kda_safe_gate": True,
        "kv_lora_rank": 64, "layer_group_size": 4, "no_kda_lora": True,
        "q_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "rope_interleave": True, "rope_scaling": None, "rope_theta": 6000000.0,
        "short_conv_kernel_size": 4, "v_head_dim": 32,
    },
}  # fmt: skip
check_covers(_CONFIGS, __name__)


def tiny_config(model_type: str, vocab_size: int = 512, *, tied: bool = False) -> dict:
    """A config.json for a tiny member of ``model_type``, spelled as its real release is
    (``tied``: the LM head is the input embedding, ``tie_word_embeddings``).

    Every Linear the model's ``quant_predicate`` quantizes has input dims
    divisible by 64, so a group-64 quantize leaves none behind.
    """
    if model_type not in _CONFIGS:
        raise ValueError(f"Unknown tiny model type {model_type!r}; expected one of {FAMILIES}")
    config = copy.deepcopy(_CONFIGS[model_type])
    text = config.get("text_config", config)
    text["vocab_size"] = vocab_size
    text["tie_word_embeddings"] = config["tie_word_embeddings"] = tied
    if text is not config:
        del text["torch_dtype"]
        config["text_config"] = dict(sorted(text.items()))
    return dict(sorted(config.items()))


def model_module(config: dict) -> ModuleType:
    """The stock mlx-lm module for ``config``, resolved the way ``load`` resolves it."""
    return importlib.import_module(f"mlx_lm.models.{resolve_model_type(config)}")


def _randomize(path: str, v: mx.array) -> mx.array:
    """Spread routers, offset norms and expert biases; stock inits route all tokens alike."""
    if path.endswith(("mlp.gate.weight", "mlp.gate.gate_proj.weight")):
        return mx.random.normal(v.shape) * (ROUTER_STD / math.sqrt(v.shape[-1]))
    if path.endswith(("embed_tokens.weight", "word_embeddings.weight")):
        return mx.random.normal(v.shape) * EMBED_STD
    if path.endswith("expert_bias"):
        return mx.random.normal(v.shape) * EXPERT_BIAS_STD
    parts = path.split(".")
    if v.ndim == 1 and parts[-1] == "weight" and "norm" in parts[-2]:
        return 1.0 + mx.random.uniform(-NORM_SPREAD, NORM_SPREAD, v.shape)
    return v


def build_tiny_model(
    model_type: str, seed: int = 0, vocab_size: int = 512, *, tied: bool = False
) -> tuple[nn.Module, dict]:
    """Build the stock mlx-lm model for ``tiny_config(model_type, vocab_size, tied=tied)`` with seeded weights."""
    config = tiny_config(model_type, vocab_size, tied=tied)
    arch = model_module(config)
    mx.random.seed(seed)
    # ModelArgs may rewrite nested dicts (qwen3_5 renames rope_type), so pass a copy.
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))
    model.update(tree_map_with_path(_randomize, model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model, config


def _cast_fn(model: nn.Module, dtype: mx.Dtype) -> Callable[[str, mx.array], mx.array]:
    """Cast floats as ``mlx_lm.convert --dtype`` does, honouring ``cast_predicate``."""
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, v: mx.array) -> mx.array:
        if keep(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    return cast


def convert_model(
    model: nn.Module,
    config: dict,
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: mx.Dtype = mx.bfloat16,
) -> tuple[nn.Module, dict]:
    """A cast (and optionally quantized) copy of ``model``, as ``mlx_lm.convert`` makes it.

    This is the in-memory twin of what :func:`save_mlx` writes; ``model`` is untouched.
    """
    model = copy.deepcopy(model)
    config = copy.deepcopy(config)
    model.update(tree_map_with_path(_cast_fn(model, dtype), model.parameters()))
    if bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # drop its bits-per-weight line
            model, config = quantize_model(model, config, group_size, bits)
    mx.eval(model.parameters())
    return model, config


def save_mlx(
    model: nn.Module,
    config: dict,
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: mx.Dtype = mx.bfloat16,
) -> Path:
    """Write an mlx-lm checkpoint exactly as ``mlx_lm.convert`` would (stacked experts)."""
    model, config = convert_model(model, config, bits=bits, group_size=group_size, dtype=dtype)
    out_dir = Path(out_dir)
    save_model(out_dir, model)
    save_config(_with_dtype(config, dtype), out_dir / "config.json")
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def _hf_weights(model: nn.Module, dtype: mx.Dtype) -> dict[str, mx.array]:
    weights = dict(tree_flatten(model.parameters()))
    if any(k.endswith(".scales") for k in weights):
        raise ValueError("Hugging Face writers take an unquantized model")
    cast = _cast_fn(model, dtype)
    return {k: cast(k, v) for k, v in weights.items()}


def _unstack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Inverse of the per-expert ``mx.stack`` in the stock ``sanitize``."""
    out = {}
    for k, v in weights.items():
        if ".mlp.switch_mlp." not in k:
            out[k] = v
            continue
        prefix, rest = k.split(".mlp.switch_mlp.")
        for e in range(v.shape[0]):
            out[f"{prefix}.mlp.experts.{e}.{rest}"] = v[e]
    return out


def save_hf_per_expert(
    model: nn.Module,
    config: dict,
    out_dir: Path,
    tokenizer_dir: Path,
    dtype: mx.Dtype = mx.bfloat16,
) -> Path:
    """Write a Hugging Face checkpoint with one tensor per expert (qwen3_moe, bailing_moe)."""
    model_type = config["model_type"]
    if model_type not in ("qwen3_moe", "bailing_moe"):
        raise ValueError(f"No per-expert Hugging Face layout for {model_type!r}")
    weights = _unstack_experts(_hf_weights(model, dtype))
    if model_type == "bailing_moe":
        # Stock sanitize renames the HF router mlp.gate.weight to mlp.gate.gate_proj.weight.
        weights = {k.replace(".mlp.gate.gate_proj.", ".mlp.gate."): v for k, v in weights.items()}
    return _write_hf(weights, config, out_dir, tokenizer_dir, dtype)


# The RMSNorms that qwen3_5's sanitize shifts by +1 (zero-centred in HF files).
QWEN3_5_NORMS = (
    ".input_layernorm.weight", ".post_attention_layernorm.weight",
    "model.norm.weight", ".q_norm.weight", ".k_norm.weight",
)  # fmt: skip


def save_hf_fused(
    model: nn.Module,
    config: dict,
    out_dir: Path,
    tokenizer_dir: Path,
    dtype: mx.Dtype = mx.bfloat16,
) -> Path:
    """Write the Hugging Face Qwen3.5-MoE layout: fused experts, zero-centred norms.

    Exact inverse of ``qwen3_5_moe.Model.sanitize``: gate_up_proj is [E, 2I, D]
    with gate first, down_proj is [E, D, I], conv1d is [C, 1, K], and the
    RMSNorms that sanitize shifts by +1 are stored as ``w - 1``.
    """
    if config["model_type"] != "qwen3_5_moe":
        raise ValueError(f"No fused Hugging Face layout for {config['model_type']!r}")
    src = _hf_weights(model, dtype)
    weights = {}
    for k, v in src.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)
        elif v.ndim == 1 and k.endswith(QWEN3_5_NORMS):
            v = v - 1.0
        if ".mlp.switch_mlp." in k:
            prefix, proj = k.split(".mlp.switch_mlp.")
            if proj == "up_proj.weight":
                continue  # rides in gate_up_proj
            if proj == "gate_proj.weight":
                up = src[f"{prefix}.mlp.switch_mlp.up_proj.weight"]
                k, v = f"{prefix}.mlp.experts.gate_up_proj", mx.concatenate([v, up], axis=-2)
            else:
                k = f"{prefix}.mlp.experts.down_proj"
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        else:
            k = k[len("language_model.") :]
        weights[k] = v
    return _write_hf(weights, config, out_dir, tokenizer_dir, dtype)


def _write_hf(weights: dict[str, mx.array], config: dict, out_dir: Path, tokenizer_dir: Path, dtype: mx.Dtype) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    _write_json(out_dir / "config.json", _with_dtype(config, dtype))
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def _with_dtype(config: dict, dtype: mx.Dtype) -> dict:
    """A copy of ``config`` whose dtype fields name what the files hold."""
    config = copy.deepcopy(config)
    name = str(dtype).split(".")[-1]
    config["torch_dtype"] = name
    if "dtype" in config.get("text_config", {}):
        config["text_config"]["dtype"] = name
    return config


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, Path(out_dir) / name)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")

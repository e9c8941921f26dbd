"""A stock mlx-lm qwen3_moe checkpoint written as a llama.cpp GGUF (arch ``qwen3moe``).

The peer arm of the bench runs llama.cpp on the *same* model as the stock and
edge0 arms: this module converts the mlx-lm int4 checkpoint (``edge0 bench
synth`` output, or any mlx-lm qwen3_moe checkpoint) with ``gguf.GGUFWriter``.

What is kept and what changes:

- Router (``ffn_gate_inp``), attention, norms, embedding and LM head are
  dequantized from mlx affine int4 (int8 for the router) and stored unquantized:
  the router and norms as F32, the other matrices as ``resident_type`` (F16 by
  default; F32 on request). They compute what mlx-lm computes up to F16
  rounding of already-int4 values. ``q4_0`` requantizes those matrices as the
  experts are, so the file holds them in the int4 checkpoint's bytes (F16
  takes 3.6x as many): what a memory-capped comparison needs, since every
  extra resident byte is one the page cache cannot hold.
- Routed experts are requantized from mlx affine int4 (a bf16 scale and bias per
  group of 64) to Q4_0 (an f16 scale per block of 32, symmetric: ``d * (q - 8)``),
  stacked per layer as ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``.
  Both are 4.5 bits per weight, but Q4_0 has no bias, so each block is rounded
  again: :class:`GGUFReport` carries the relative error this adds, and routing
  downstream of a requantized layer can differ slightly.

The file is streamed: tensor infos are planned from the shard headers, then one
tensor at a time is read, converted and written, so peak memory stays near one
layer's stacked projection. The output is written to a temporary sibling and
renamed into place when complete.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..atomic import atomic_path
from ..checkpoint import read_config

ARCH = "qwen3moe"
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (f16 scale + 16 nibble bytes)
EXPERT_CHUNK = 8  # experts dequantized and requantized at a time (bounds the float32 copy)
RESIDENT_TYPES = ("f16", "f32", "q4_0")
RESIDENT_CHUNK = 4096  # rows of a resident matrix requantized at a time
# mlx-lm parameter (module path relative to model.layers.N) -> GGUF tensor (MODEL_TENSOR name).
LAYER_TENSORS = {
    "input_layernorm": "ATTN_NORM",
    "self_attn.q_proj": "ATTN_Q",
    "self_attn.k_proj": "ATTN_K",
    "self_attn.v_proj": "ATTN_V",
    "self_attn.o_proj": "ATTN_OUT",
    "self_attn.q_norm": "ATTN_Q_NORM",
    "self_attn.k_norm": "ATTN_K_NORM",
    "post_attention_layernorm": "FFN_NORM",
    "mlp.gate": "FFN_GATE_INP",
    "mlp.switch_mlp.gate_proj": "FFN_GATE_EXP",
    "mlp.switch_mlp.up_proj": "FFN_UP_EXP",
    "mlp.switch_mlp.down_proj": "FFN_DOWN_EXP",
}
TOP_TENSORS = {"model.embed_tokens": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}
EXPERT_TENSORS = ("FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP")
F32_TENSORS = ("FFN_GATE_INP",)  # kept at full precision: routing is what the arms compare


class GGUFConversionError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFReport:
    """What :func:`write_gguf` wrote.

    Attributes:
        expert_rel_error: ||Q4_0(W) - W|| / ||W|| over every routed expert weight,
            W being the mlx affine int4 weight dequantized (Frobenius norms).
        expert_max_abs_error: the largest |Q4_0(W) - W| over the same weights.
    """

    path: str
    tensors: int
    file_bytes: int
    expert_bytes: int
    expert_rel_error: float
    expert_max_abs_error: float
    tokenizer: str  # "gpt2" (from tokenizer.json) or "none" (vocab size only)
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Planned:
    """One GGUF tensor: its name, where its source lives and how to convert it."""

    name: str
    source: str  # mlx-lm module path (``.weight`` / ``.scales`` / ``.biases`` appended)
    kind: str  # "q4_0" | "f32" | "f16"
    shape: tuple[int, ...]  # logical shape, numpy order (the GGUF reverses it)
    expert: bool = False  # a routed expert stack (its requantization error is reported)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        if self.kind == "q4_0":
            return (*self.shape[:-1], self.shape[-1] // Q4_0_BLOCK * Q4_0_BYTES)
        return self.shape

    @property
    def nbytes(self) -> int:
        width = {"q4_0": 1, "f16": 2, "f32": 4}[self.kind]
        return int(np.prod(self.byte_shape)) * width


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFConversionError('the GGUF writer needs the peers extra: pip install -e ".[peers]"') from None
    return gguf


def check_config(config: dict, where: Path) -> None:
    """Refuse what llama.cpp's qwen3moe graph does not compute (it has every layer
    MoE, normalizes the top-k weights and uses plain RoPE)."""
    problems = []
    if config.get("model_type") != "qwen3_moe":
        problems.append(f"model_type {config.get('model_type')!r} (only qwen3_moe is written)")
    if config.get("mlp_only_layers"):
        problems.append(f"dense layers mlp_only_layers={config['mlp_only_layers']}")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={config['decoder_sparse_step']}")
    if not config.get("norm_topk_prob", False):
        problems.append("norm_topk_prob=false")
    if config.get("rope_scaling"):
        problems.append(f"rope_scaling={config['rope_scaling']}")
    if problems:
        raise GGUFConversionError(f"{where}: llama.cpp's qwen3moe cannot run this checkpoint: {'; '.join(problems)}")


def _quant_params(config: dict, module: str) -> tuple[int, int, str]:
    """(bits, group_size, mode) mlx-lm used for ``module`` (per-path overrides first)."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    own = q.get(module)
    q = own if isinstance(own, dict) else q
    return int(q.get("bits", 4)), int(q.get("group_size", 64)), q.get("mode", "affine")


class _Weights:
    """Every tensor of the checkpoint's shards, loaded lazily (nothing is read
    until a tensor is evaluated)."""

    def __init__(self, root: Path, config: dict):
        files = sorted(root.glob("model*.safetensors"))
        if not files:
            raise GGUFConversionError(f"{root}: no model*.safetensors files")
        self.root, self.config, self.arrays = root, config, {}
        for f in files:
            self.arrays.update(mx.load(str(f)))

    def __contains__(self, module: str) -> bool:
        return f"{module}.weight" in self.arrays

    def shape(self, module: str) -> tuple[int, ...]:
        w = self.arrays[f"{module}.weight"]
        scales = self.arrays.get(f"{module}.scales")
        if scales is None:
            return tuple(w.shape)
        return (*w.shape[:-1], scales.shape[-1] * _quant_params(self.config, module)[1])

    def materialize(self, module: str) -> None:
        """Read ``module``'s tensors once, so that slicing them does not read them again."""
        parts = [k for k in (f"{module}.{p}" for p in ("weight", "scales", "biases")) if k in self.arrays]
        mx.eval([self.arrays[k] for k in parts])

    def dense(self, module: str, rows: Optional[slice] = None, dtype: mx.Dtype = mx.float32) -> np.ndarray:
        """The weight as numpy ``dtype`` (dequantized in float32 if quantized, as
        mlx-lm computes at float32); ``rows`` slices axis 0."""
        pick = (lambda a: a[rows]) if rows is not None else (lambda a: a)
        w = pick(self.arrays[f"{module}.weight"])
        if f"{module}.scales" in self.arrays:
            bits, group, mode = _quant_params(self.config, module)
            if mode != "affine":
                raise GGUFConversionError(f"{self.root}: {module} uses quantization mode {mode!r}; only affine")
            scales = pick(self.arrays[f"{module}.scales"]).astype(mx.float32)
            biases = pick(self.arrays[f"{module}.biases"]).astype(mx.float32)
            w = dequantize_affine(w, scales, biases, bits=bits, group_size=group)
        w = w.astype(dtype)
        mx.eval(w)
        return np.asarray(w)


def dequantize_affine(w: mx.array, scales: mx.array, biases: mx.array, *, bits: int, group_size: int) -> mx.array:
    """mlx affine dequantization ``scale * q + bias`` in the scales' dtype; unpacks
    the uint32 words directly where ``bits`` divides 32 (several times faster than
    ``mx.dequantize`` on the CPU), else defers to it."""
    if 32 % bits:
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = (w[..., None] >> shifts) & ((1 << bits) - 1)  # [..., words, 32 / bits]
    q = q.reshape(*w.shape[:-1], scales.shape[-1], group_size).astype(scales.dtype)
    return (q * scales[..., None] + biases[..., None]).reshape(*w.shape[:-1], -1)


def _plan(weights: _Weights, config: dict, resident_type: str) -> list[_Planned]:
    gguf = _gguf()
    names = gguf.TENSOR_NAMES
    tensors = gguf.MODEL_TENSOR
    plan = []

    def add(module: str, tensor: str, bid: Optional[int] = None) -> None:
        shape = weights.shape(module)
        if tensor in EXPERT_TENSORS:
            kind = "q4_0"
        elif tensor in F32_TENSORS or len(shape) == 1:
            kind = "f32"
        else:
            kind = resident_type
        if kind == "q4_0" and shape[-1] % Q4_0_BLOCK:
            raise GGUFConversionError(f"{module}: input dim {shape[-1]} is not a multiple of {Q4_0_BLOCK}")
        name = names[getattr(tensors, tensor)].format(bid=bid) + ".weight"
        plan.append(_Planned(name, module, kind, shape, expert=tensor in EXPERT_TENSORS))

    for module, tensor in TOP_TENSORS.items():
        if module in weights:
            add(module, tensor)
        elif tensor != "OUTPUT":  # a tied LM head is the embedding, as llama.cpp falls back to
            raise GGUFConversionError(f"{weights.root}: no {module}.weight")
    for layer in range(config["num_hidden_layers"]):
        for rel, tensor in LAYER_TENSORS.items():
            module = f"model.layers.{layer}.{rel}"
            if module not in weights:
                raise GGUFConversionError(f"{weights.root}: no {module}.weight (is every layer MoE?)")
            add(module, tensor, layer)
    return plan


def quantize_q4_0(dense: np.ndarray) -> np.ndarray:
    """Q4_0 blocks of ``dense`` (last axis a multiple of 32), as llama.cpp's
    reference quantizer makes them: uint8, last axis 18 bytes per 32 weights."""
    gguf = _gguf()
    return gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q4_0)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    gguf = _gguf()
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)


class _ErrorMeter:
    def __init__(self):
        self.diff_sq = self.ref_sq = self.max_abs = 0.0

    def add(self, ref: np.ndarray, blocks: np.ndarray) -> None:
        diff = (dequantize_q4_0(blocks) - ref).ravel()
        self.diff_sq += float(np.vdot(diff, diff))
        self.ref_sq += float(np.vdot(ref.ravel(), ref.ravel()))
        self.max_abs = max(self.max_abs, float(np.abs(diff).max()))

    @property
    def relative(self) -> float:
        return (self.diff_sq / self.ref_sq) ** 0.5 if self.ref_sq else 0.0


def _tensor_data(weights: _Weights, t: _Planned, meter: _ErrorMeter) -> np.ndarray:
    if t.kind != "q4_0":
        return weights.dense(t.source, dtype=mx.float16 if t.kind == "f16" else mx.float32)
    out = np.empty(t.byte_shape, np.uint8)
    weights.materialize(t.source)
    chunk = EXPERT_CHUNK if t.expert else RESIDENT_CHUNK
    for e in range(0, t.shape[0], chunk):
        rows = slice(e, min(e + chunk, t.shape[0]))
        dense = weights.dense(t.source, rows)
        out[rows] = quantize_q4_0(dense)
        if t.expert:
            meter.add(dense, out[rows])
    return out


def _tokenizer_json_pre(tok: dict) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json."""
    pre = tok.get("pre_tokenizer") or {}
    text = json.dumps(pre)
    if "\\\\p{N}" in text and "\\\\p{L}" in text and "[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?" in text:
        return "qwen2"  # Qwen2/3's split regex
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return "default"


def _add_tokenizer(writer, root: Path, vocab_size: int) -> str:
    """Vocabulary metadata from ``tokenizer.json`` (byte-level BPE, written the way
    llama.cpp's convert_hf_to_gguf writes a gpt2-style vocabulary); a checkpoint
    without one (``bench synth``) gets ``tokenizer.ggml.model = none`` and its
    vocabulary size: llama.cpp then runs on token ids alone, which is all the
    teacher-forced bench needs."""
    gguf = _gguf()
    path = root / "tokenizer.json"
    if not path.is_file():
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(vocab_size)
        return "none"
    tok = json.loads(path.read_text(encoding="utf-8"))
    if (tok.get("model") or {}).get("type") != "BPE":
        raise GGUFConversionError(f"{path}: only BPE tokenizers are written (found {tok.get('model', {}).get('type')})")
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    by_id = {i: s for s, i in vocab.items()} | {i: a["content"] for i, a in added.items()}
    if max(by_id) >= vocab_size:
        raise GGUFConversionError(f"{path}: token id {max(by_id)} is outside the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_tokenizer_json_pre(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(root, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
    return "gpt2"


def _add_hparams(writer, config: dict) -> None:
    gguf = _gguf()
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config.get("intermediate_size", config["moe_intermediate_size"]))
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(
    src: Path | str,
    out: Path | str,
    *,
    resident_type: str = "f16",
    progress: Optional[Callable[[str], None]] = None,
) -> GGUFReport:
    """Write the mlx-lm qwen3_moe checkpoint ``src`` as a GGUF file ``out``.

    Args:
        src: an mlx-lm checkpoint directory (config.json, model*.safetensors,
            optionally tokenizer.json).
        out: the GGUF file to write (replaced atomically).
        resident_type: ``f16`` or ``f32`` for the dequantized attention,
            embedding and LM-head matrices, or ``q4_0`` to requantize them
            (the int4 checkpoint's size); router and norms are always F32.
        progress: called with a line per layer.

    Returns:
        A :class:`GGUFReport`, including the Q4_0 requantization error.

    Raises:
        GGUFConversionError: a checkpoint llama.cpp's qwen3moe cannot run, a
            quantization mode other than affine, or the peers extra missing.
    """
    if resident_type not in RESIDENT_TYPES:
        raise GGUFConversionError(f"resident_type must be one of {RESIDENT_TYPES}, got {resident_type!r}")
    gguf = _gguf()
    start = time.perf_counter()
    src, out = Path(src), Path(out)
    config = read_config(src)
    check_config(config, src / "config.json")
    weights = _Weights(src, config)
    plan = _plan(weights, config, resident_type)
    meter = _ErrorMeter()
    raw_types = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "f16": None, "f32": None}
    np_types = {"q4_0": np.uint8, "f16": np.float16, "f32": np.float32}
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCH)
        writer.add_name(src.name)
        _add_hparams(writer, config)
        tokenizer = _add_tokenizer(writer, src, config["vocab_size"])
        for t in plan:
            writer.add_tensor_info(t.name, t.byte_shape, np.dtype(np_types[t.kind]), t.nbytes, raw_types[t.kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            writer.write_tensor_data(_tensor_data(weights, t, meter))
            for part in ("weight", "scales", "biases"):  # release what was read
                weights.arrays.pop(f"{t.source}.{part}", None)
            if progress and t.name.endswith("ffn_down_exps.weight"):
                progress(f"[gguf] layer {int(t.name.split('.')[1]) + 1}/{config['num_hidden_layers']}")
        writer.close()
    return GGUFReport(
        path=str(out),
        tensors=len(plan),
        file_bytes=out.stat().st_size,
        expert_bytes=sum(t.nbytes for t in plan if t.expert),
        expert_rel_error=meter.relative,
        expert_max_abs_error=meter.max_abs,
        tokenizer=tokenizer,
        seconds=time.perf_counter() - start,
    )


def with_gguf_experts(model, gguf_path: Path | str):
    """``model`` (a stock mlx-lm qwen3_moe) dequantized, with every routed
    expert replaced by the GGUF's Q4_0 weights: mlx-lm computing what the GGUF
    holds, to tell the requantization's effect apart from llama.cpp's numerics."""
    gguf = _gguf()
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    for layer in range(len(model.model.layers)):
        swapped = []
        for proj, tensor in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_TENSORS):
            name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, tensor)].format(bid=layer) + ".weight"
            dense = dequantize_q4_0(np.asarray(tensors[name].data))
            swapped.append((f"model.layers.{layer}.mlp.switch_mlp.{proj}.weight", mx.array(dense)))
        model.load_weights(swapped, strict=False)
    mx.eval(model.parameters())
    return model

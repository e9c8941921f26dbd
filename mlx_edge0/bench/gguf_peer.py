"""A stock mlx-lm MoE checkpoint written as a llama.cpp GGUF, for the bench's peer arm.

The peer arm runs llama.cpp on the *same* model as the stock and edge0 arms:
this module converts the mlx-lm int4 checkpoint (``edge0 bench synth`` output,
or any mlx-lm checkpoint of a model type below) with ``gguf.GGUFWriter``. What
each model type becomes is its mapping's business (``gguf_arch.py``):
``qwen3_moe`` -> ``qwen3moe`` (``gguf_qwen3moe.py``), ``qwen3_5_moe`` ->
``qwen35moe`` (``gguf_qwen35moe.py``), ``bailing_moe_v3`` (Ling 3.0) ->
``bailingmoe3`` (``gguf_bailingmoe3.py``); this module reads, converts and
streams.

What is kept and what changes:

- Routers and gates (``ffn_gate_inp``, ``ffn_gate_inp_shexp``), attention,
  linear attention, shared experts, norms, embedding and LM head are
  dequantized from mlx affine int4 (int8 for routers and gates) and stored
  unquantized: routers, gates, the convolution and every vector as F32, the
  other matrices as ``resident_type`` (F16 by default; F32 on request). They
  compute what mlx-lm computes up to F16 rounding of already-int4 values.
  ``q4_0`` requantizes those matrices as the experts are, so the file holds
  them in the int4 checkpoint's bytes (F16 takes 3.6x as many): what a
  memory-capped comparison needs, since every extra resident byte is one the
  page cache cannot hold.
- Routed experts are requantized from mlx affine int4 (a bf16 scale and bias per
  group of 64) to Q4_0 (an f16 scale per block of 32, symmetric: ``d * (q - 8)``),
  stacked per layer as ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``.
  Both are 4.5 bits per weight, but Q4_0 has no bias, so each block is rounded
  again: :class:`GGUFReport` carries the relative error this adds, and routing
  downstream of a requantized layer can differ slightly.

The file is streamed: tensor infos are planned from the shard headers, then one
tensor at a time is read, converted and written, so peak memory stays near one
layer's stacked projection (a tensor the mapping transforms is converted whole;
none of those is an expert stack). The output is written to a temporary sibling
and renamed into place when complete.
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
from .gguf_arch import (
    RESIDENT_TYPES,
    Architecture,
    GGUFConversionError,
    TensorPlan,
    gguf_module,
    plan_tensors,
    tensor_name,
)
from ..model_patches import resolve_model_type
from .gguf_bailingmoe3 import BAILINGMOE3
from .gguf_qwen3moe import QWEN3MOE
from .gguf_qwen35moe import QWEN35MOE

__all__ = [
    "RESIDENT_TYPES",
    "GGUFConversionError",
    "GGUFReport",
    "check_config",
    "dequantize_affine",
    "dequantize_q4_0",
    "quantize_q4_0",
    "with_gguf_experts",
    "write_gguf",
]
ARCHITECTURES = {a.model_type: a for a in (QWEN3MOE, QWEN35MOE, BAILINGMOE3)}  # by mlx-lm module
EXPERT_CHUNK = 8  # experts dequantized and requantized at a time (bounds the float32 copy)
RESIDENT_CHUNK = 4096  # rows of a resident matrix requantized at a time
NP_TYPES = {"q4_0": np.uint8, "f16": np.float16, "f32": np.float32}


@dataclass(frozen=True)
class GGUFReport:
    """What :func:`write_gguf` wrote.

    Attributes:
        expert_rel_error: ||Q4_0(W) - W|| / ||W|| over every routed expert weight,
            W being the mlx affine int4 weight dequantized (Frobenius norms).
        expert_max_abs_error: the largest |Q4_0(W) - W| over the same weights.
    """

    path: str
    arch: str  # llama.cpp's architecture
    tensors: int
    file_bytes: int
    expert_bytes: int
    expert_rel_error: float
    expert_max_abs_error: float
    tokenizer: str  # "gpt2" (from tokenizer.json) or "none" (vocab size only)
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def architecture(config: dict, where: Path) -> Architecture:
    """The mapping for ``config`` (read from ``where``), found by the mlx-lm module
    that loads it (Ling 3.0 says ``bailing_hybrid`` and loads as ``bailing_moe_v3``),
    checked against what llama.cpp runs.

    Raises:
        GGUFConversionError: a model type without a mapping, or a config the
            mapped llama.cpp architecture cannot run (each problem naming its field).
    """
    arch = ARCHITECTURES.get(resolve_model_type(config))
    if arch is None:
        known = ", ".join(f"{a.model_type} (as {a.name})" for a in ARCHITECTURES.values())
        raise GGUFConversionError(f"{where}: model_type {config.get('model_type')!r}; bench gguf writes {known}")
    problems = arch.problems(arch.text(config))
    if problems:
        raise GGUFConversionError(f"{where}: llama.cpp's {arch.name} cannot run this checkpoint: {'; '.join(problems)}")
    return arch


def check_config(config: dict, where: Path) -> None:
    """Refuse what llama.cpp cannot run (see :func:`architecture`)."""
    architecture(config, where)


def _quant_params(config: dict, module: str) -> tuple[int, int, str]:
    """(bits, group_size, mode) mlx-lm used for ``module`` (per-path overrides first)."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    own = q.get(module)
    q = own if isinstance(own, dict) else q
    return int(q.get("bits", 4)), int(q.get("group_size", 64)), q.get("mode", "affine")


class _Weights:
    """Every tensor of the checkpoint's shards, loaded lazily (nothing is read
    until a tensor is evaluated). A source is a module (``<source>.weight``, plus
    ``.scales`` / ``.biases`` when quantized) or a bare parameter (``A_log``)."""

    def __init__(self, root: Path, config: dict):
        files = sorted(root.glob("model*.safetensors"))
        if not files:
            raise GGUFConversionError(f"{root}: no model*.safetensors files")
        self.root, self.config, self.arrays = root, config, {}
        for f in files:
            self.arrays.update(mx.load(str(f)))

    def _key(self, source: str) -> Optional[str]:
        for key in (f"{source}.weight", source):
            if key in self.arrays:
                return key
        return None

    def __contains__(self, source: str) -> bool:
        return self._key(source) is not None

    def shape(self, source: str) -> tuple[int, ...]:
        w = self.arrays[self._key(source)]
        scales = self.arrays.get(f"{source}.scales")
        if scales is None:
            return tuple(w.shape)
        return (*w.shape[:-1], scales.shape[-1] * _quant_params(self.config, source)[1])

    def materialize(self, source: str) -> None:
        """Read ``source``'s tensors once, so that slicing them does not read them again."""
        mx.eval([self.arrays[k] for k in self._parts(source)])

    def release(self, source: str) -> None:
        """Drop ``source``'s arrays (what was read is freed)."""
        for key in self._parts(source):
            del self.arrays[key]

    def _parts(self, source: str) -> list[str]:
        return [self._key(source), *(k for k in (f"{source}.scales", f"{source}.biases") if k in self.arrays)]

    def dense(self, source: str, rows: Optional[slice] = None) -> np.ndarray:
        """The weight as float32 numpy (dequantized in float32 if quantized, as
        mlx-lm computes at float32); ``rows`` slices axis 0."""
        pick = (lambda a: a[rows]) if rows is not None else (lambda a: a)
        w = pick(self.arrays[self._key(source)])
        if f"{source}.scales" in self.arrays:
            bits, group, mode = _quant_params(self.config, source)
            if mode != "affine":
                raise GGUFConversionError(f"{self.root}: {source} uses quantization mode {mode!r}; only affine")
            scales = pick(self.arrays[f"{source}.scales"]).astype(mx.float32)
            biases = pick(self.arrays[f"{source}.biases"]).astype(mx.float32)
            w = dequantize_affine(w, scales, biases, bits=bits, group_size=group)
        w = w.astype(mx.float32)
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


def quantize_q4_0(dense: np.ndarray) -> np.ndarray:
    """Q4_0 blocks of ``dense`` (last axis a multiple of 32), as llama.cpp's
    reference quantizer makes them: uint8, last axis 18 bytes per 32 weights."""
    gguf = gguf_module()
    return gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q4_0)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    gguf = gguf_module()
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


def _tensor_data(weights: _Weights, t: TensorPlan, meter: _ErrorMeter) -> np.ndarray:
    if t.kind != "q4_0" or t.transform:
        dense = weights.dense(t.source)
        if t.transform:
            dense = np.ascontiguousarray(t.transform(dense), np.float32)
        assert dense.shape == t.shape, (t.name, dense.shape, t.shape)
        return quantize_q4_0(dense) if t.kind == "q4_0" else dense.astype(NP_TYPES[t.kind])
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
    gguf = gguf_module()
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


def write_gguf(
    src: Path | str,
    out: Path | str,
    *,
    resident_type: str = "f16",
    progress: Optional[Callable[[int, int], None]] = None,
) -> GGUFReport:
    """Write the mlx-lm checkpoint ``src`` (a model type above) as a GGUF file ``out``.

    Args:
        src: an mlx-lm checkpoint directory (config.json, model*.safetensors,
            optionally tokenizer.json).
        out: the GGUF file to write (replaced atomically).
        resident_type: ``f16`` or ``f32`` for the dequantized attention,
            linear-attention, shared-expert, embedding and LM-head matrices, or
            ``q4_0`` to requantize them (the int4 checkpoint's size); routers,
            gates, the convolution and norms are always F32.
        progress: called as ``progress(layers_written, layers)`` after each
            layer's experts, the bulk of the file.

    Returns:
        A :class:`GGUFReport`, including the Q4_0 requantization error.

    Raises:
        GGUFConversionError: a checkpoint llama.cpp cannot run (see
            :func:`check_config`), a quantization mode other than affine, or the
            peers extra missing.
    """
    if resident_type not in RESIDENT_TYPES:
        raise GGUFConversionError(f"resident_type must be one of {RESIDENT_TYPES}, got {resident_type!r}")
    gguf = gguf_module()
    start = time.perf_counter()
    src, out = Path(src), Path(out)
    config = read_config(src)
    arch = architecture(config, src / "config.json")
    text = arch.text(config)
    weights = _Weights(src, config)
    try:
        plan = plan_tensors(arch, text, weights, resident_type)
    except GGUFConversionError as e:
        raise GGUFConversionError(f"{src}: {e}") from None
    meter = _ErrorMeter()
    raw_types = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "f16": None, "f32": None}
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch.name)
        writer.add_name(src.name)
        arch.hparams(writer, text)
        tokenizer = _add_tokenizer(writer, src, text["vocab_size"])
        for t in plan:
            writer.add_tensor_info(t.name, t.byte_shape, np.dtype(NP_TYPES[t.kind]), t.nbytes, raw_types[t.kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            writer.write_tensor_data(_tensor_data(weights, t, meter))
            weights.release(t.source)
            if progress and t.name.endswith("ffn_down_exps.weight"):
                progress(int(t.name.split(".")[1]) + 1, text["num_hidden_layers"])
        writer.close()
    return GGUFReport(
        path=str(out),
        arch=arch.name,
        tensors=len(plan),
        file_bytes=out.stat().st_size,
        expert_bytes=sum(t.nbytes for t in plan if t.expert),
        expert_rel_error=meter.relative,
        expert_max_abs_error=meter.max_abs,
        tokenizer=tokenizer,
        seconds=time.perf_counter() - start,
    )


def with_gguf_experts(model, gguf_path: Path | str):
    """``model`` (a stock mlx-lm model of a type above) dequantized, with every
    routed expert replaced by the GGUF's Q4_0 weights: mlx-lm computing what the
    GGUF holds, to tell the requantization's effect apart from llama.cpp's numerics.
    mlx-lm dequantizes in the scales' dtype: cast the model to float32 first
    (``set_dtype``), or bf16 rounding of every resident weight adds its own error."""
    gguf = gguf_module()
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    for i, layer in enumerate(model.layers):
        if tensor_name("FFN_GATE_EXP", i) not in tensors:
            continue  # a dense layer (bailing_moe_v3's first_k_dense_replace)
        swapped = []
        for proj, tensor in (("gate_proj", "FFN_GATE_EXP"), ("up_proj", "FFN_UP_EXP"), ("down_proj", "FFN_DOWN_EXP")):
            dense = dequantize_q4_0(np.asarray(tensors[tensor_name(tensor, i)].data))
            swapped.append((f"{proj}.weight", mx.array(dense)))
        layer.mlp.switch_mlp.load_weights(swapped, strict=False)
    mx.eval(model.parameters())
    return model

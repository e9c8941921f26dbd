"""What a llama.cpp architecture mapping is, for the GGUF writer (``gguf_peer.py``).

A mapping (:class:`Architecture`) says, for one mlx-lm model type (the module
mlx-lm loads the checkpoint with), which llama.cpp architecture it becomes,
what in its config llama.cpp cannot run, which GGUF tensor each mlx-lm
parameter of a layer becomes (:class:`Mapped`, with a transform where llama.cpp
stores it differently from mlx-lm) and which hyperparameters it writes. It
never reads a weight: :func:`plan_tensors` turns it into one :class:`TensorPlan`
per GGUF tensor from the config and the checkpoint's tensor shapes, and the
writer streams the plan.

What every mapping shares lives here once: the softmax-attention and
routed-expert tensors (mlx-lm names them alike in qwen3_moe and qwen3_5_moe),
the top-level tensors, the tensor kinds (routed experts Q4_0; routers, gates,
the convolutions, the absorbed MLA matrices and every vector F32; the other
matrices the resident type) and the hyperparameters every architecture reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .peers import peers_package

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (f16 scale + 16 nibble bytes)
RESIDENT_TYPES = ("f16", "f32", "q4_0")
EXPERT_TENSORS = ("FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP")
# Kept at full precision whatever the resident type: routing and gating are what
# the arms compare; convert_hf_to_gguf keeps the conv kernels F32 too. The absorbed
# MLA matrices stay F32 because llama.cpp's default load (CPU repack buffers) takes
# them in F16 or Q4_0 and then has no backend for their per-head matmul: it aborts.
F32_TENSORS = (
    "FFN_GATE_INP",
    "FFN_GATE_INP_SHEXP",
    "SSM_CONV1D",
    "SSM_CONV1D_Q",
    "SSM_CONV1D_K",
    "SSM_CONV1D_V",
    "SSM_A",
    "ATTN_K_B",
    "ATTN_V_B",
)


class GGUFConversionError(ValueError):
    pass


def gguf_module():
    """The ``gguf`` package (the peers extra)."""
    return peers_package("gguf", GGUFConversionError, "the GGUF writer")


@dataclass(frozen=True)
class Mapped:
    """The GGUF tensor one mlx-lm parameter becomes.

    Attributes:
        tensor: its ``gguf.MODEL_TENSOR`` member name.
        suffix: appended to the tensor's name (``.weight``; ``.bias``; none).
        transform: applied to the whole dequantized float32 array, where llama.cpp
            stores the parameter otherwise than mlx-lm does.
        shape: the transform's output shape, where it differs from the source's.
    """

    tensor: str
    suffix: str = ".weight"
    transform: Optional[Callable[[np.ndarray], np.ndarray]] = None
    shape: Optional[tuple[int, ...]] = None


TOP_TENSORS = {"model.embed_tokens": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}


@dataclass(frozen=True)
class Architecture:
    """One mlx-lm model type written as one llama.cpp architecture.

    Attributes:
        name: llama.cpp's architecture (``general.architecture``).
        model_type: mlx-lm's ``model_type`` (config.json).
        prefix: where mlx-lm keeps the text model (``language_model.`` for Qwen3.5).
        text: config.json -> the text model's fields, as the mappings below read them.
        problems: text config -> what llama.cpp cannot run, each naming its field.
        layer: (text config, layer) -> {parameter path below the layer: tensor}.
        hparams: (``gguf.GGUFWriter``, text config) -> writes the metadata keys.
        top: text-model module path -> tensor, for the embedding, final norm and LM head.
    """

    name: str
    model_type: str
    prefix: str
    text: Callable[[dict], dict]
    problems: Callable[[dict], list[str]]
    layer: Callable[[dict, int], dict[str, Mapped]]
    hparams: Callable[[Any, dict], None]
    top: dict[str, str] = field(default_factory=lambda: dict(TOP_TENSORS))


SOFTMAX_ATTENTION = {
    "self_attn.q_proj": Mapped("ATTN_Q"),
    "self_attn.k_proj": Mapped("ATTN_K"),
    "self_attn.v_proj": Mapped("ATTN_V"),
    "self_attn.o_proj": Mapped("ATTN_OUT"),
    "self_attn.q_norm": Mapped("ATTN_Q_NORM"),
    "self_attn.k_norm": Mapped("ATTN_K_NORM"),
}
ROUTED_EXPERTS = {
    "mlp.gate": Mapped("FFN_GATE_INP"),
    "mlp.switch_mlp.gate_proj": Mapped("FFN_GATE_EXP"),
    "mlp.switch_mlp.up_proj": Mapped("FFN_UP_EXP"),
    "mlp.switch_mlp.down_proj": Mapped("FFN_DOWN_EXP"),
}


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: its name, where its source lives and how to convert it."""

    name: str
    source: str  # mlx-lm parameter or module path (``.weight`` / ``.scales`` / ``.biases`` appended)
    kind: str  # "q4_0" | "f32" | "f16"
    shape: tuple[int, ...]  # logical shape, numpy order (the GGUF reverses it)
    expert: bool = False  # a routed expert stack (its requantization error is reported)
    transform: Optional[Callable[[np.ndarray], np.ndarray]] = None

    @property
    def byte_shape(self) -> tuple[int, ...]:
        if self.kind == "q4_0":
            return (*self.shape[:-1], self.shape[-1] // Q4_0_BLOCK * Q4_0_BYTES)
        return self.shape

    @property
    def nbytes(self) -> int:
        width = {"q4_0": 1, "f16": 2, "f32": 4}[self.kind]
        return int(np.prod(self.byte_shape)) * width


class Shapes(Protocol):
    """The checkpoint's tensors, as far as planning needs them."""

    def __contains__(self, source: str) -> bool: ...

    def shape(self, source: str) -> tuple[int, ...]: ...


def tensor_name(tensor: str, bid: Optional[int] = None, suffix: str = ".weight") -> str:
    """The GGUF name of ``gguf.MODEL_TENSOR.<tensor>`` (in block ``bid``)."""
    gguf = gguf_module()
    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, tensor)].format(bid=bid) + suffix


def plan_tensors(arch: Architecture, text: dict, shapes: Shapes, resident_type: str) -> list[TensorPlan]:
    """Every GGUF tensor of ``arch`` for a checkpoint with text config ``text``.

    Raises:
        GGUFConversionError: a tensor the mapping needs is missing, or a Q4_0
            tensor's input dimension is not a multiple of 32.
    """
    plan = []

    def add(source: str, mapped: Mapped, bid: Optional[int] = None) -> None:
        shape = mapped.shape or shapes.shape(source)
        if mapped.tensor in EXPERT_TENSORS:
            kind = "q4_0"
        elif mapped.tensor in F32_TENSORS or len(shape) == 1:
            kind = "f32"
        else:
            kind = resident_type
        if kind == "q4_0" and shape[-1] % Q4_0_BLOCK:
            raise GGUFConversionError(f"{source}: input dim {shape[-1]} is not a multiple of {Q4_0_BLOCK}")
        name = tensor_name(mapped.tensor, bid, mapped.suffix)
        plan.append(TensorPlan(name, source, kind, shape, mapped.tensor in EXPERT_TENSORS, mapped.transform))

    for module, tensor in arch.top.items():
        source = arch.prefix + module
        if source in shapes:
            add(source, Mapped(tensor))
        elif tensor != "OUTPUT":  # a tied LM head is the embedding, as llama.cpp falls back to
            raise GGUFConversionError(f"no {source}.weight in the checkpoint")
    for layer in range(text["num_hidden_layers"]):
        for rel, mapped in arch.layer(text, layer).items():
            source = f"{arch.prefix}model.layers.{layer}.{rel}"
            if source not in shapes:
                raise GGUFConversionError(f"no {source} in the checkpoint ({arch.name} needs it in every layer)")
            add(source, mapped, layer)
    return plan


def add_common_hparams(writer, text: dict) -> None:
    """The keys both Qwen architectures read: sizes, attention heads, RoPE base,
    norm epsilon and the routed experts."""
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(text.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(text["rms_norm_eps"]))
    add_expert_hparams(writer, text)


def add_expert_hparams(writer, text: dict) -> None:
    """The routed experts' keys and the file type, which every architecture writes."""
    gguf = gguf_module()
    writer.add_expert_count(text["num_experts"])
    writer.add_expert_used_count(text["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(text["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

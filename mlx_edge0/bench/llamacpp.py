"""llama.cpp, the peer arm: a GGUF loaded the way a Linux user would run it, fed token ids.

Driven through llama-cpp-python's C API (the ``[peers]`` extra) rather than its
``Llama`` class, because the class does not expose the two load settings the
comparison depends on:

- ``use_extra_bufts = False``: llama.cpp's CPU backend otherwise *repacks* Q4_0
  weights into its interleaved layout, which copies every weight into anonymous
  memory; a model larger than the memory cap then OOMs instead of paging from
  the mmap'd file.
- ``load_mode``: ``mmap`` (the default, pages come from the file on demand) or
  ``direct-io`` (tensors read with O_DIRECT into llama.cpp's own buffers,
  bypassing the page cache; llama.cpp falls back to buffered reads where the
  file system has no O_DIRECT).

Everything runs on the CPU (no layers offloaded) with ``n_threads`` threads for
both prompt and decode. :meth:`LlamaCppModel.forward` appends tokens to one
sequence's KV cache and returns the logits of the positions asked for, so a
caller can teacher-force any token sequence.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from .peers import peers_package

LOAD_MODES = ("mmap", "direct-io")
TOPK_PREFIX = b"ffn_moe_topk-"  # llama.cpp's name for a MoE layer's routed ids ([K, tokens], int32)
GGML_TYPE_I32 = 26


class _GGMLTensor(ctypes.Structure):
    """The head of ggml's ``struct ggml_tensor`` (ggml.h), as far as ``name``;
    checked against ``ggml_get_name`` before it is trusted."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


class LlamaCppError(RuntimeError):
    pass


def _llama_cpp():
    return peers_package("llama_cpp", LlamaCppError, "the llama.cpp arm")


def llama_cpp_version() -> str:
    return _llama_cpp().__version__


def _ggml_get_name(lc):
    libs = sorted((Path(lc.__file__).parent / "lib").glob("*ggml-base.*"))
    if not libs:
        raise LlamaCppError(f"no ggml-base library under {Path(lc.__file__).parent / 'lib'} to trace routing with")
    lib = ctypes.CDLL(str(libs[0]))
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    return lib.ggml_get_name


class LlamaCppModel:
    """One GGUF model and one context (a single sequence), CPU only.

    Args:
        path: the GGUF file (:func:`mlx_edge0.bench.gguf_peer.write_gguf`).
        load_mode: ``mmap`` or ``direct-io`` (see the module docstring).
        n_threads: threads for prompt processing and decode.
        n_ctx: KV cache length (prompt + decoded tokens must fit).
        verbose: let llama.cpp's log through to stderr.
        trace_routing: record each MoE layer's routed expert ids (llama.cpp's
            ``ffn_moe_topk`` tensors, through its graph-evaluation callback; slow:
            for comparing routing, not for timing). See :meth:`routing`.

    Raises:
        LlamaCppError: the extra is missing, or llama.cpp refused the file.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        load_mode: str = "mmap",
        n_threads: int = 2,
        n_ctx: int = 512,
        verbose: bool = False,
        trace_routing: bool = False,
    ):
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {load_mode!r}")
        lc = self._lc = _llama_cpp()
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False
        mp.load_mode = lc.LLAMA_LOAD_MODE_DIRECT_IO if load_mode == "direct-io" else lc.LLAMA_LOAD_MODE_MMAP
        self.path, self.load_mode, self.n_ctx = Path(path), load_mode, n_ctx
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise LlamaCppError(f"{self.path}: llama.cpp could not load it (run with verbose=True for its log)")
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.no_perf = True
        self._picks: dict[int, list[np.ndarray]] = {}
        self._trace_error = ""
        if trace_routing:
            self._get_name = _ggml_get_name(lc)
            self._eval_callback = lc.ggml_backend_sched_eval_callback(self._observe)  # kept alive with self
            cp.cb_eval = self._eval_callback
        self._ctx = lc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise LlamaCppError(f"{self.path}: llama.cpp could not create a context of {n_ctx} tokens")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self.n_past = 0

    def forward(self, tokens: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Append ``tokens`` to the sequence; the logits of every position
        (``all_logits``, shape [len, vocab]) or of the last one ([1, vocab])."""
        lc, n = self._lc, len(tokens)
        if n == 0 or self.n_past + n > self.n_ctx:
            raise LlamaCppError(f"{n} tokens after {self.n_past} do not fit a {self.n_ctx}-token context")
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i] = int(token)
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == n - 1
            batch.n_tokens = n
            status = lc.llama_decode(self._ctx, batch)
            if status != 0:
                raise LlamaCppError(self._trace_error or f"llama_decode returned {status}")
        finally:
            lc.llama_batch_free(batch)
        self.n_past += n
        rows = range(n) if all_logits else (n - 1,)
        out = np.empty((len(rows), self.n_vocab), np.float32)
        for j, i in enumerate(rows):
            ptr = lc.llama_get_logits_ith(self._ctx, i)
            out[j] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))
        return out

    def _observe(self, tensor: int, ask: bool, _user_data) -> bool:
        t = _GGMLTensor.from_address(tensor)
        if not t.name.startswith(TOPK_PREFIX):
            return not ask  # not wanted; an observed node must not cancel the graph
        if ask:
            return True
        if t.name != self._get_name(tensor) or t.type != GGML_TYPE_I32:
            self._trace_error = "this llama.cpp's ggml_tensor layout differs from the one the routing trace reads"
            return False  # cancels the graph; forward() raises the reason
        k, n = t.ne[0], t.ne[1]
        rows = [np.frombuffer(ctypes.string_at(t.data + j * t.nb[1], 4 * k), np.int32) for j in range(n)]
        self._picks.setdefault(int(t.name[len(TOPK_PREFIX) :]), []).append(np.stack(rows))
        return True

    def routing(self) -> list[np.ndarray]:
        """Per MoE layer, the routed expert ids of every position computed since
        the last :meth:`reset`, [tokens, K], sorted per token. Only positions
        whose logits were asked for reach the last layer's experts (llama.cpp
        drops the others before it), so trace with ``all_logits=True``."""
        return [np.sort(np.concatenate(self._picks[i]), axis=-1) for i in sorted(self._picks)]

    def reset(self) -> None:
        """Forget the sequence (clear the KV cache)."""
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)
        self.n_past = 0
        self._picks = {}

    def model_bytes(self) -> int:
        return int(self._lc.llama_model_size(self._model))

    def close(self) -> None:
        if self._ctx:
            self._lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._lc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaCppModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Float stand-ins for a model's quantized layers, for a forward over thousands of tokens.

The router calibration runs 5,120 tokens through a full-depth synthetic int4
model on the CPU. There MLX's quantized matmul kernels do the same work per
token whatever the batch, while a float matmul goes to BLAS, which batches:
with an optimized BLAS the matmuls take two orders of magnitude less time and
what is left of a layer is its other ops. (The ``mlx[cpu]`` wheel links the
reference BLAS, no faster than the quantized kernels; preload an optimized
one, as BENCHMARKS.md shows.)

The stand-ins dequantize their weights when called, so the model holds no more
than its int4 weights, and keep the quantized modules' parameter names, so a
caller's lazy reloads by name still find them. The experts multiply expert by
expert over the rows mlx-lm's ``SwitchGLU`` has already sorted by expert: one
dense matmul each, where ``gather_mm`` multiplies row by row.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear


def _dequantized(layer: nn.Module, index: Optional[int] = None) -> mx.array:
    """``layer``'s float weight (expert ``index``'s, where it has experts), in its scales' dtype."""
    pick = (lambda a: a) if index is None else (lambda a: a[index])
    biases = layer.get("biases")
    return mx.dequantize(
        pick(layer["weight"]),
        pick(layer["scales"]),
        None if biases is None else pick(biases),
        layer.group_size,
        layer.bits,
        mode=layer.mode,
    )


def _share(stand_in: nn.Module, layer: nn.Module) -> None:
    """Give ``stand_in`` ``layer``'s arrays and quantization, under the same names."""
    stand_in.group_size, stand_in.bits, stand_in.mode = layer.group_size, layer.bits, layer.mode
    for name, value in layer.items():
        if isinstance(value, mx.array) or value is None:
            stand_in[name] = value
    stand_in.freeze()


class DenseLinear(nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` (same parameters, same numbers) that multiplies
    by its dequantized weight. It skips the parent's ``__init__``, which would
    draw and quantize a random weight only to drop it."""

    def __init__(self, layer: nn.QuantizedLinear):
        nn.Module.__init__(self)
        _share(self, layer)

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ _dequantized(self).T
        return y + self["bias"] if "bias" in self else y


class DenseSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's ``QuantizedSwitchLinear`` (same parameters, same numbers) that
    multiplies the rows of each expert by that expert's dequantized weight."""

    def __init__(self, layer: QuantizedSwitchLinear):
        nn.Module.__init__(self)
        _share(self, layer)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        rows = indices.size
        if not sorted_indices or x.shape != (rows, 1, x.shape[-1]):
            y = mx.gather_mm(x, _dequantized(self).swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        else:
            bounds = np.searchsorted(np.array(indices), np.arange(self.num_experts + 1))
            flat = x.reshape(rows, -1)
            pairs = zip(bounds[:-1], bounds[1:])
            y = mx.concatenate([flat[a:b] @ _dequantized(self, e).T for e, (a, b) in enumerate(pairs) if b > a])
            y = y.reshape(rows, 1, -1)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y


def _stand_in(module: nn.Module) -> Optional[nn.Module]:
    if getattr(module, "mode", None) != "affine" or module.get("global_scale") is not None:
        return None
    if isinstance(module, nn.QuantizedLinear):
        return DenseLinear(module)
    if isinstance(module, QuantizedSwitchLinear):
        return DenseSwitchLinear(module)
    return None


class DenseLayers:
    """Context: the quantized modules of ``model.layers`` compute through float stand-ins.

    The stand-ins are quantized modules themselves, so code that dispatches on
    the type (a router's gate) or updates parameters by name works unchanged.
    :meth:`restore` puts one decoder layer's quantized modules back early,
    with whatever was set in the stand-ins: the originals, not the stand-ins,
    must hold the parameters when a caller reloads that layer's weights, or
    the arrays the forward evaluated would stay referenced until the end.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.originals: dict[int, list[tuple[str, nn.Module]]] = {}

    def __enter__(self) -> "DenseLayers":
        for i, layer in enumerate(self.model.layers):
            swaps = [
                (name, module, dense)
                for name, module in layer.named_modules()
                if (dense := _stand_in(module)) is not None
            ]
            if swaps:
                self.originals[i] = [(name, module) for name, module, _ in swaps]
                layer.update_modules(tree_unflatten([(name, dense) for name, _, dense in swaps]))
        return self

    def restore(self, layer: int) -> None:
        """Layer ``layer``'s quantized modules back, with the stand-ins' current parameters."""
        originals = self.originals.pop(layer, [])
        if originals:
            target = self.model.layers[layer]
            current = dict(tree_flatten(target.parameters()))
            for name, module in originals:
                prefix = f"{name}."
                module.update(
                    tree_unflatten([(k[len(prefix) :], v) for k, v in current.items() if k.startswith(prefix)])
                )
            target.update_modules(tree_unflatten(originals))

    def __exit__(self, *exc) -> None:
        for layer in list(self.originals):
            self.restore(layer)

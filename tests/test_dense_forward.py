"""The calibration forward's float stand-ins compute what the quantized modules
compute, and put them back."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from mlx_edge0.bench.dense_forward import DenseLayers, DenseLinear, DenseSwitchLinear

D, F, E, K = 128, 64, 16, 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = SwitchGLU(D, F, E)

    def __call__(self, x: mx.array) -> mx.array:
        indices = mx.argpartition(self.gate(x), kth=-K, axis=-1)[..., -K:]
        return self.experts(self.proj(x), indices).sum(axis=-2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [Layer(), Layer()]


def model() -> Model:
    mx.random.seed(0)
    m = Model()
    nn.quantize(m, group_size=64, bits=4)
    m.set_dtype(mx.float32)
    return m


def test_stand_ins_compute_what_the_quantized_modules_compute():
    m = model()
    long, short = mx.random.normal((2, 40, D)), mx.random.normal((1, 3, D))  # 320 rows sorted, 12 not
    want = [m.layers[0](long), m.layers[0](short)]
    with DenseLayers(m) as dense:
        layer = m.layers[0]
        assert isinstance(layer.proj, DenseLinear) and isinstance(layer.experts.up_proj, DenseSwitchLinear)
        got = [layer(long), layer(short)]
        assert dense.originals
    for w, g in zip(want, got):
        assert w.shape == g.shape
        assert mx.allclose(w, g, rtol=1e-5, atol=1e-5).item()


def test_stand_ins_are_quantized_modules_and_restore_puts_every_original_back():
    m = model()
    originals = [(layer.proj, layer.gate, layer.experts.down_proj) for layer in m.layers]
    with DenseLayers(m) as dense:
        assert all(
            isinstance(layer.gate, nn.QuantizedLinear) and layer.gate is not gate
            for layer, (_, gate, _) in zip(m.layers, originals)
        )
        dense.restore(0)
        assert m.layers[0].proj is originals[0][0] and isinstance(m.layers[1].proj, DenseLinear)
        m.layers[1].load_weights([("proj.bias", mx.ones(D))], strict=False)  # a reload into the stand-in
    for layer, (proj, gate, down) in zip(m.layers, originals):
        assert layer.proj is proj and layer.gate is gate and layer.experts.down_proj is down
        assert isinstance(layer.experts.down_proj, QuantizedSwitchLinear)
    assert mx.array_equal(m.layers[1].proj.bias, mx.ones(D)).item()

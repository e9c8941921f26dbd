"""Loading a model leaves process-wide MLX settings alone: another model in
the process (a teacher beside its student) keeps its own. The buffer-cache
cap is the caller's explicit choice."""

from __future__ import annotations

import mlx.core as mx

import mlx_edge0
from mlx_edge0.default_model import default_checkpoint


def test_loading_leaves_the_buffer_cache_limit_alone():
    sentinel = 123 << 20
    before = mx.set_cache_limit(sentinel)
    try:
        model = mlx_edge0.load_model(default_checkpoint(), cache_gib=0)
        assert mx.set_cache_limit(sentinel) == sentinel  # unchanged by the load
        assert model.limit_buffer_cache() == sentinel
        assert mx.set_cache_limit(sentinel) == model.edge0_runtime.loader.layer_bytes
    finally:
        mx.set_cache_limit(before)

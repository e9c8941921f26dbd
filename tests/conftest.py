"""Shared fixtures: a local tokenizer and, per family, a tiny stock mlx-lm
model saved as an int4 mlx-lm checkpoint and converted to edge0 (built once
per session; nothing is downloaded)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import pytest

from mlx_edge0 import tiny
from mlx_edge0.families import FAMILIES  # noqa: F401 (the tests import it from here)
from mlx_edge0.conversions import ConvertOptions, convert


@dataclass(frozen=True)
class Converted:
    model_type: str
    source: Path  # stock mlx-lm int4 checkpoint
    edge0: Path  # its edge0 conversion


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return tiny.train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def converted(tmp_path_factory, tokenizer_dir):
    """(model_type, build_tiny_model's keywords, e.g. ``tied=True``) -> Converted,
    built lazily and cached for the session."""
    cache: dict[tuple, Converted] = {}

    def get(model_type: str, **build) -> Converted:
        key = (model_type, *sorted(build.items()))
        if key not in cache:
            root = tmp_path_factory.mktemp(model_type)
            model, config = tiny.build_tiny_model(model_type, seed=0, **build)
            src = root / "source"
            tiny.save_mlx(model, config, src, tokenizer_dir, bits=4)
            out = root / "edge0"
            convert(src, out, ConvertOptions(show_progress=False))
            cache[key] = Converted(model_type, src, out)
        return cache[key]

    return get


def load_stock(path: Path, dtype=mx.float32):
    """Stock mlx-lm model (everything resident), cast like edge0's compute dtype."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    model.set_dtype(dtype)
    return model


def load_benchmark_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py``, imported as a module: the scripts are not a
    package, and their tests call their functions directly."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""mlx-edge0: serve MoE models that do not fit in memory from SSD, inside mlx-lm.

``load(path, **options)`` returns what ``mlx_lm.load`` returns, for an edge0
checkpoint (made by ``edge0 convert``); options are the fields of
:class:`mlx_edge0.options.Options`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .options import RUNTIME_KEY, Options

__version__ = "0.1.0"
__all__ = ["load", "load_model", "Options", "__version__"]


def _model_config(options: dict[str, Any]) -> dict[str, Any]:
    return {RUNTIME_KEY: Options(**options).to_dict()}


def _check(path: str | Path) -> None:
    """The edge0 section and the resident file's header, before mlx-lm reads
    anything (MLX's own error for a truncated file names no file)."""
    from .checkpoint import RESIDENT_FILE, Edge0Section, read_config
    from .integrity import check_generation
    from .tensorfile import read_header

    section = Edge0Section.from_config(read_config(path), Path(path) / "config.json")
    header = read_header(Path(path) / RESIDENT_FILE)
    check_generation(header.path, header.metadata, section.generation)


def load(path: str | Path, **options: Any):
    """Load an edge0 checkpoint with its tokenizer: ``(model, tokenizer)``.

    Keyword arguments are :class:`Options` fields (e.g. ``compute_dtype``).
    """
    from mlx_lm import load as mlx_lm_load

    from .integrity import load_consistently

    def attempt():
        _check(path)
        return mlx_lm_load(str(path), model_config=_model_config(options), trust_remote_code=True)

    return load_consistently(path, attempt)  # one conversion, even under `convert --force`


def load_model(path: str | Path, **options: Any):
    """Load only the model of an edge0 checkpoint (no tokenizer needed)."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from .integrity import load_consistently

    def attempt():
        _check(path)
        return mlx_lm_load_model(Path(path), model_config=_model_config(options), trust_remote_code=True)

    model, _ = load_consistently(path, attempt)  # one conversion, even under `convert --force`
    return model

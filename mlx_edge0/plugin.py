"""The ``trust_remote_code`` entry point of an edge0 checkpoint.

A converted checkpoint's config.json names a one-line shim (``model_file``)
that calls :func:`bind` with its own path. mlx-lm then calls
``ModelArgs.from_dict(config)`` and ``Model(args)`` as for any model file; the
shim defines no classes (mlx-lm executes it unregistered, where dataclasses
break), it only hands over the checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .checkpoint import CONFIG_FILE, Edge0Section
from .model import Edge0Args
from .options import RUNTIME_KEY, Options


class ModelArgsReader:
    """``ModelArgs`` as mlx-lm sees it: ``from_dict(config) -> Edge0Args``."""

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint_dir = checkpoint_dir

    def from_dict(self, config: dict) -> Edge0Args:
        from .model_patches import family_for

        where = self.checkpoint_dir / CONFIG_FILE
        section = Edge0Section.from_config(config, where)
        family = family_for(config, where)
        try:
            options = Options.from_dict(config.get(RUNTIME_KEY))
        except (TypeError, ValueError) as e:
            raise ValueError(f"edge0 options: {e}") from None
        return Edge0Args(
            model_type=config["model_type"],
            family=family,
            stock_args=family.stock_module.ModelArgs.from_dict(config),
            section=section,
            options=options,
            checkpoint_dir=self.checkpoint_dir,
        )


def build_model(args: Edge0Args):
    """``Model(args)`` as mlx-lm sees it: the patched stock model."""
    return args.family.model_class(args)


def bind(shim_file: str) -> tuple[Callable, ModelArgsReader]:
    """(Model, ModelArgs) for the checkpoint that holds ``shim_file``."""
    return build_model, ModelArgsReader(Path(shim_file).resolve().parent)

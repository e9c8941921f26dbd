"""The model classes mlx-lm builds an edge0 checkpoint with.

Two ways in. mlx-edge0's own loaders pass :func:`model_classes` to mlx-lm's
``load_model`` (``get_model_classes``), so nothing of the checkpoint is
imported. Stock mlx-lm commands run with ``--trust-remote-code`` import the
checkpoint's one-line shim (``model_file``), which calls :func:`bind` with its
own path. Either way mlx-lm then calls ``ModelArgs.from_dict(config)`` and
``Model(args)`` as for any model file; the shim defines no classes (mlx-lm
executes it unregistered, where dataclasses break), it only hands over the
checkpoint directory: the one it was loaded from, after the trust check, not
wherever a symlink points.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .checkpoint import CONFIG_FILE, Edge0Section
from .model import Edge0Args
from .options import RUNTIME_KEY, Options
from .parallel import PARALLEL_KEY
from .trust import check_code


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
            parallel=config.get(PARALLEL_KEY),
        )


def build_model(args: Edge0Args):
    """``Model(args)`` as mlx-lm sees it: the patched stock model."""
    return args.family.model_class(args)


def build_model_alone(args: Edge0Args):
    """``Model(args)`` for a stock mlx-lm command (the shim's way in), whose
    process runs this model: also caps MLX's buffer cache
    (:meth:`~mlx_edge0.model.Edge0Model.limit_buffer_cache`)."""
    model = build_model(args)
    model.limit_buffer_cache()
    return model


def model_classes(checkpoint_dir: Path) -> Callable[..., tuple[Callable, ModelArgsReader]]:
    """mlx-lm's ``get_model_classes`` for a checked checkpoint directory."""

    def get_model_classes(config: dict) -> tuple[Callable, ModelArgsReader]:
        return build_model, ModelArgsReader(checkpoint_dir)

    return get_model_classes


def bind(shim_file: str) -> tuple[Callable, ModelArgsReader]:
    """(Model, ModelArgs) for the checkpoint directory that holds ``shim_file``
    as mlx-lm named it (a symlinked shim binds to *its* directory, and fails
    the trust check there).

    Raises:
        UntrustedCodeError: the checkpoint fails :func:`mlx_edge0.trust.check_code`.
    """
    return build_model_alone, ModelArgsReader(check_code(Path(os.path.abspath(shim_file)).parent))

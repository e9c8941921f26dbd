"""mlx-edge0: serve MoE models that do not fit in memory from SSD, inside mlx-lm.

``load(path, **options)`` returns what ``mlx_lm.load`` returns, for an edge0
checkpoint (made by ``edge0 convert``); options are the fields of
:class:`mlx_edge0.options.Options`. Neither ``load`` nor ``load_model``
imports anything from the checkpoint: the model is built from this package
once :func:`mlx_edge0.trust.check_code` has passed (see that module), and
what they return comes from one conversion even while ``convert --force``
replaces the checkpoint (:func:`mlx_edge0.integrity.load_consistently`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .options import RUNTIME_KEY, Options

__version__ = "0.1.0"
__all__ = ["load", "load_model", "Options", "__version__"]


def _load_checked(path: str | Path, options: dict[str, Any], tokenizer: bool, group: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer or None) after the trust check and the edge0 section
    and resident header checks (MLX's own error for a truncated file names no
    file), all of it from one conversion. With a ``group`` of several ranks,
    this process's share of the model (:mod:`mlx_edge0.parallel`), once every
    rank has been found to load the same checkpoint."""
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    from .checkpoint import RESIDENT_FILE, Edge0Section, read_config
    from .integrity import check_generation, load_consistently
    from .parallel import PARALLEL_KEY, Parallel, check_same_checkpoint, ranks_on_host
    from .plugin import model_classes
    from .tensorfile import read_header
    from .trust import check_code

    directory = check_code(path)
    options = Options(**options)
    # ``model_file: None`` keeps mlx-lm from importing the checkpoint's shim;
    # the classes come from this package, bound to the checked directory.
    model_config = {"model_file": None, RUNTIME_KEY: options.to_dict()}
    if group is not None and group.size() > 1:
        section = Edge0Section.from_config(read_config(directory), directory / "config.json")
        check_same_checkpoint(group, directory, section)
        model_config[PARALLEL_KEY] = Parallel(group, options.parallel, ranks_on_host(group))

    def attempt() -> tuple[Any, Any]:
        check_code(directory)
        section = Edge0Section.from_config(read_config(directory), directory / "config.json")
        header = read_header(directory / RESIDENT_FILE)
        check_generation(header.path, header.metadata, section.generation)
        model, config = mlx_lm_load_model(
            directory, model_config=model_config, get_model_classes=model_classes(directory)
        )
        if not tokenizer:
            return model, None
        return model, load_tokenizer(directory, eos_token_ids=config.get("eos_token_id"))

    return load_consistently(directory, attempt)  # one conversion, even under `convert --force`


def load(path: str | Path, group: Any = None, **options: Any):
    """Load an edge0 checkpoint with its tokenizer: ``(model, tokenizer)``.

    Keyword arguments are :class:`Options` fields (e.g. ``compute_dtype``).
    ``group``: an ``mx.distributed`` group (``mx.distributed.init()`` in a
    process ``mlx.launch`` started) whose ranks share the model as
    ``parallel`` says ("expert" or "pipeline"); every rank calls ``load``.
    """
    return _load_checked(path, options, tokenizer=True, group=group)


def load_model(path: str | Path, group: Any = None, **options: Any):
    """Load only the model of an edge0 checkpoint (no tokenizer needed)."""
    return _load_checked(path, options, tokenizer=False, group=group)[0]

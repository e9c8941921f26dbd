"""The ``[peers]`` extra (llama-cpp-python, gguf): imported on demand, so that
nothing else in mlx-edge0 needs it and its absence is said with the fix."""

from __future__ import annotations

import importlib
from types import ModuleType


def peers_package(name: str, error: type[Exception], user: str) -> ModuleType:
    """The extra's package ``name``.

    Raises:
        error: ``name`` is not installed; the message says ``user`` needs the
            extra and how to install it.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        raise error(f'{user} needs the peers extra: pip install -e ".[peers]"') from None

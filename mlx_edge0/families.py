"""The model families mlx-edge0 supports, by mlx-lm ``model_type``.

The one list: the model patches (``mlx_edge0.model_patches``), the converter's
source architectures (``mlx_edge0.conversions.registry``) and the tiny test
models (:mod:`mlx_edge0.tiny`) each have an entry per family and check at
import that they cover exactly these; the tests run every family listed here.
"""

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "bailing_moe", "bailing_moe_v3")


def check_covers(table: dict, where: str) -> None:
    """Assert that ``table`` (keyed by model_type) has an entry for exactly the :data:`FAMILIES`."""
    missing, extra = sorted(set(FAMILIES) - set(table)), sorted(set(table) - set(FAMILIES))
    assert not missing and not extra, f"{where}: families missing {missing}, not in FAMILIES {extra}"

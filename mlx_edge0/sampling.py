"""Sampling settings that travel with a checkpoint, and the flags that override them.

A checkpoint's ``generation_config.json`` (Hugging Face's file; mlx-lm reads it
for eos ids and ``edge0 convert`` copies it) says how the model wants to be
sampled: a weak model such as the embedded default loops under greedy
decoding and needs a temperature and a repetition penalty. ``edge0 generate``
starts from that file and lets its flags win. The settings become mlx-lm's
own sampler and logits processors (``make_sampler``,
``make_logits_processors``), so they mean what they mean there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

GENERATION_CONFIG = "generation_config.json"
# Hugging Face key -> Sampling field; "temperature" only counts with "do_sample": true.
FILE_KEYS = {
    "temperature": "temp",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "repetition_context_size": "repetition_context_size",  # mlx-lm's name; not a HF key
}


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn from the logits.

    Attributes:
        temp: temperature; 0 = greedy.
        top_p / top_k / min_p: nucleus, top-k and min-p filters (0 = off).
        repetition_penalty: logits of tokens seen in the last
            ``repetition_context_size`` tokens are divided (positive) or
            multiplied (negative) by it; 1 = off.
        repetition_context_size: how many recent tokens the penalty looks at.
    """

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20

    def __post_init__(self):
        checks = {
            "temp": _number(self.temp) and self.temp >= 0,
            "top_p": _number(self.top_p) and 0 <= self.top_p <= 1,
            "top_k": _integer(self.top_k) and self.top_k >= 0,
            "min_p": _number(self.min_p) and 0 <= self.min_p <= 1,
            "repetition_penalty": _number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_context_size": _integer(self.repetition_context_size) and self.repetition_context_size >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            allowed = {
                "temp": ">= 0 (0 = greedy)",
                "top_p": "in [0, 1]",
                "top_k": "an integer >= 0",
                "min_p": "in [0, 1]",
                "repetition_penalty": "> 0 (1 = off)",
                "repetition_context_size": "an integer >= 1",
            }
            raise ValueError("; ".join(f"{n} must be {allowed[n]}, got {getattr(self, n)!r}" for n in bad))

    def override(self, **flags: Optional[Any]) -> "Sampling":
        """These settings with every flag that was given (not None) put over them."""
        return replace(self, **{k: v for k, v in flags.items() if v is not None})

    def sampler(self) -> Callable:
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(temp=self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self) -> list[Callable]:
        from mlx_lm.sample_utils import make_logits_processors

        penalty = None if self.repetition_penalty == 1.0 else self.repetition_penalty
        return make_logits_processors(repetition_penalty=penalty, repetition_context_size=self.repetition_context_size)

    def describe(self) -> str:
        """One line for the user: what differs from plain greedy decoding."""
        default = Sampling()
        changed = [
            f"{f.name} {getattr(self, f.name):g}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return ", ".join(changed) if changed else "greedy"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_sampling(checkpoint: Path) -> tuple[Sampling, Optional[Path]]:
    """The checkpoint's sampling settings and the file they came from
    (plain greedy and None when it has no ``generation_config.json``).

    Raises:
        ValueError: the file is not a JSON object or holds an invalid value
            (the message names the file and the field).
    """
    path = Path(checkpoint) / GENERATION_CONFIG
    if not path.is_file():
        return Sampling(), None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    values = {field: config[key] for key, field in FILE_KEYS.items() if config.get(key) is not None}
    if not config.get("do_sample", False):
        values.pop("temp", None)  # Hugging Face's rule: without do_sample, decoding is greedy
    try:
        return Sampling(**values), path
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None

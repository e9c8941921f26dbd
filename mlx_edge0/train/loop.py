"""The one training loop every phase runs: AdamW, checkpoints, resume, a JSON log.

Contract: ``run_loop`` trains ``model.trainable_parameters()`` (the caller
freezes and unfreezes before calling) on ``batch_at(step)``, which must be a
pure function of ``step``. The global MLX RNG is reseeded from ``(seed, step)``
before every step, and every ``checkpoint_every`` steps the trainable weights,
the optimizer state and the log are written atomically under ``out_dir``. A
run interrupted at any point and started again with the same options resumes
from the newest checkpoint and ends with bit-identical weights to a run that
was never interrupted.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..progress import bar
from ..atomic import atomic_directory, write_json_atomic

CHECKPOINTS = "checkpoints"
LOG_FILE = "log.json"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
KEEP_CHECKPOINTS = 2
# Options that change the weight trajectory; a resume must match them exactly.
TRAJECTORY_FIELDS = ("steps", "learning_rate", "seed", "warmup_steps", "grad_clip", "weight_decay")


@dataclass(frozen=True)
class LoopOptions:
    out_dir: Path  # step checkpoints + log.json live here
    steps: int
    learning_rate: float
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    warmup_steps: int = 0  # linear warmup then cosine decay to 10%
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    weight_decay: float = 0.01  # AdamW's decoupled decay
    compile: bool = False  # mx.compile the step (loss_fn must be pure array code)

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.checkpoint_every < 1 or self.log_every < 1:
            raise ValueError("checkpoint_every and log_every must be >= 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables it), got {self.grad_clip}")

    def trajectory(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k in TRAJECTORY_FIELDS}


def learning_rate_schedule(options: LoopOptions) -> Callable[[mx.array], mx.array]:
    """Linear warmup from 0 to the peak, then cosine decay to 10% of it at ``steps``."""
    peak = options.learning_rate
    decay = optim.cosine_decay(peak, max(options.steps - options.warmup_steps, 1), peak * 0.1)
    if options.warmup_steps == 0:
        return decay
    warmup = optim.linear_schedule(0.0, peak, options.warmup_steps)
    return optim.join_schedules([warmup, decay], [options.warmup_steps])


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of one step: a pure function of (seed, step), so resume replays it."""
    return (seed * 1_000_003 + step) % (2**63)


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch: the size of its first array (inputs come first by convention)."""
    leaves = [v for _, v in tree_flatten(batch) if isinstance(v, mx.array)]
    return leaves[0].size if leaves else 0


def run_loop(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], mx.array],
    batch_at: Callable[[int], Any],
    options: LoopOptions,
    description: str,
    eval_fn: Optional[Callable[[nn.Module], dict]] = None,
    *,
    show_progress: bool = True,
) -> list[dict]:
    """Train ``model``'s trainable parameters for ``options.steps`` steps.

    Args:
        model: updated in place; holds the final weights on return.
        loss_fn: ``loss_fn(model, batch)`` -> scalar loss.
        batch_at: ``batch_at(step)`` -> the batch of that step, deterministic.
        options: see :class:`LoopOptions`.
        description: labels the progress bar and is stored in the log.
        eval_fn: called at every checkpoint and at the end; its dict is logged.
        show_progress: draw a bar on stderr (steps, loss, tokens/s, ETA).

    Returns:
        The log: ``{"step", "loss", "learning_rate", "grad_norm", "tokens_per_s",
        "elapsed_s"}`` per log step and ``{"step", "eval"}`` per evaluation.

    Raises:
        ValueError: a checkpoint in ``out_dir`` was written with other options
            or other trainable parameters.
    """
    out_dir = Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = learning_rate_schedule(options)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=options.weight_decay)
    optimizer.init(model.trainable_parameters())
    resumed = _resume(out_dir, model, optimizer, options)
    start, log, elapsed = resumed if resumed else (0, [], 0.0)
    pending = [e["loss"] for e in log if e.get("pending")]
    log = [e for e in log if not e.get("pending")]

    value_and_grad = nn.value_and_grad(model, lambda batch: loss_fn(model, batch))

    def step_fn(batch):
        loss, grads = value_and_grad(batch)
        if options.grad_clip > 0:
            grads, norm = optim.clip_grad_norm(grads, options.grad_clip)
        else:
            norm = mx.sqrt(sum(mx.sum(g.astype(mx.float32) ** 2) for _, g in tree_flatten(grads)))
        optimizer.update(model, grads)
        return loss, norm

    if options.compile:
        state = [model.state, optimizer.state, mx.random.state]
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    steps = bar(options.steps, description, unit="step", initial=start, show=show_progress)
    window_tokens, window_start = 0, time.perf_counter()
    for step in range(start, options.steps):
        mx.random.seed(step_seed(options.seed, step))
        batch = batch_at(step)
        loss, norm = step_fn(batch)
        mx.eval(loss, norm, model.state, optimizer.state)
        pending.append(loss.item())
        window_tokens += batch_tokens(batch)
        done = step + 1
        steps.update()
        if done % options.log_every == 0 or done == options.steps:
            now = time.perf_counter()
            elapsed += now - window_start
            entry = {
                "step": done, "loss": sum(pending) / len(pending),
                "learning_rate": schedule(mx.array(step)).item(),
                "grad_norm": norm.item(), "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": elapsed,
            }  # fmt: skip
            log.append(entry)
            steps.set_postfix(
                loss=f"{entry['loss']:.4f}",
                lr=f"{entry['learning_rate']:.2e}",
                tok_s=f"{entry['tokens_per_s']:.0f}",
                refresh=False,
            )
            pending, window_tokens, window_start = [], 0, time.perf_counter()
        if done % options.checkpoint_every == 0 or done == options.steps:
            if eval_fn is not None:
                log.append({"step": done, "eval": eval_fn(model)})
            pending_entries = [{"step": done, "loss": v, "pending": True} for v in pending]
            _save_checkpoint(out_dir, done, model, optimizer, options, description, log + pending_entries, elapsed)
            write_json_atomic(out_dir / LOG_FILE, {"description": description, "log": log}, indent=2)
            window_start = time.perf_counter()
    steps.close()
    if not (out_dir / LOG_FILE).exists():
        write_json_atomic(out_dir / LOG_FILE, {"description": description, "log": log}, indent=2)
    return log


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete step checkpoints under ``out_dir``, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def _save_checkpoint(
    out_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: optim.Optimizer,
    options: LoopOptions,
    description: str,
    log: list[dict],
    elapsed: float,
) -> Path:
    """Write step_NNNNNN/ through a temp sibling and one rename, then prune old ones."""
    root = out_dir / CHECKPOINTS
    root.mkdir(exist_ok=True)
    final = root / f"step_{step:07d}"
    with atomic_directory(final, replace=True) as tmp:
        mx.save_safetensors(str(tmp / TRAINABLE_FILE), dict(tree_flatten(model.trainable_parameters())))
        mx.save_safetensors(str(tmp / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)))
        state = {
            "step": step,
            "seed": options.seed,
            "description": description,
            "options": options.trajectory(),
            "elapsed_s": elapsed,
            "log": log,
        }
        _write_json(tmp / STATE_FILE, state)
    for old in checkpoint_dirs(out_dir)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)
    return final


def _resume(
    out_dir: Path, model: nn.Module, optimizer: optim.Optimizer, options: LoopOptions
) -> Optional[tuple[int, list[dict], float]]:
    """Load the newest checkpoint into ``model`` and ``optimizer``; None when there is none."""
    found = checkpoint_dirs(out_dir)
    if not found:
        return None
    ckpt = found[-1]
    state = json.loads((ckpt / STATE_FILE).read_text())
    if state["options"] != options.trajectory():
        raise ValueError(
            f"{ckpt / STATE_FILE} was written with {state['options']}, not "
            f"{options.trajectory()}; use another out_dir or the same options"
        )
    if state["step"] > options.steps:
        raise ValueError(f"{ckpt} is at step {state['step']}, past steps={options.steps}")
    weights = mx.load(str(ckpt / TRAINABLE_FILE))
    expected = dict(tree_flatten(model.trainable_parameters()))
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise ValueError(
            f"{ckpt / TRAINABLE_FILE} does not match the model's trainable "
            f"parameters (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for name, v in weights.items():
        if v.shape != expected[name].shape:
            raise ValueError(
                f"{ckpt / TRAINABLE_FILE}: {name} has shape {v.shape}, the model has {expected[name].shape}"
            )
    model.update(tree_unflatten(list(weights.items())))
    optimizer.state = tree_unflatten(list(mx.load(str(ckpt / OPTIMIZER_FILE)).items()))
    optimizer.init(model.trainable_parameters())
    mx.eval(model.state, optimizer.state)
    return state["step"], state["log"], state["elapsed_s"]


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")

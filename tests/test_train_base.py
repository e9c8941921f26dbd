"""The training loop (resume, log, atomic checkpoints), the stdlib corpus and the base model."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_edge0.tiny import build_tiny_model
from mlx_edge0.train.loop import (
    CHECKPOINTS,
    LOG_FILE,
    STATE_FILE,
    LoopOptions,
    checkpoint_dirs,
    learning_rate_schedule,
    run_loop,
)

VOCAB = 512


def lm_loss(model: nn.Module, batch: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(batch[:, :-1]), batch[:, 1:]).mean()


def random_batch(step: int) -> mx.array:
    return mx.random.randint(0, VOCAB, (2, 17), key=mx.random.key(step))


class Interrupted(Exception):
    pass


def tiny_moe(seed: int = 0) -> nn.Module:
    model, _ = build_tiny_model("qwen3_moe", seed=seed, vocab_size=VOCAB)
    model.train()
    return model


def params(model: nn.Module) -> dict:
    return dict(tree_flatten(model.parameters()))


def test_loop_lowers_the_loss(tmp_path):
    model = tiny_moe()
    fixed = random_batch(0)
    before = lm_loss(model, fixed).item()
    log = run_loop(model, lm_loss, lambda step: fixed,
                   LoopOptions(tmp_path, steps=8, learning_rate=1e-2, log_every=1), "fit")
    after = lm_loss(model, fixed).item()
    assert after < before - 1.0, (before, after)
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_only_trainable_parameters_change(tmp_path):
    model = tiny_moe()
    model.freeze()
    model.model.norm.unfreeze()
    start = params(model)
    run_loop(model, lm_loss, random_batch, LoopOptions(tmp_path, steps=2, learning_rate=1e-2), "norm")
    end = params(model)
    changed = sorted(k for k in start if not mx.array_equal(start[k], end[k]))
    assert changed == ["model.norm.weight"]


def test_resume_after_interruption_is_bit_identical(tmp_path):
    options = dict(steps=7, learning_rate=5e-3, seed=3, checkpoint_every=2, log_every=3, warmup_steps=2)
    straight = tiny_moe()
    straight_log = run_loop(straight, lm_loss, random_batch,
                            LoopOptions(tmp_path / "a", **options), "straight")

    def dies_at_5(step):
        if step == 5:
            raise Interrupted
        return random_batch(step)

    with pytest.raises(Interrupted):
        run_loop(tiny_moe(), lm_loss, dies_at_5, LoopOptions(tmp_path / "b", **options), "dies")
    assert [p.name for p in checkpoint_dirs(tmp_path / "b")] == ["step_0000002", "step_0000004"]
    resumed = tiny_moe()
    resumed_log = run_loop(resumed, lm_loss, random_batch, LoopOptions(tmp_path / "b", **options), "resumed")

    a, b = params(straight), params(resumed)
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    strip = lambda log: [(e["step"], e.get("loss"), e.get("grad_norm")) for e in log]  # noqa: E731
    assert strip(resumed_log) == strip(straight_log)
    # A finished run resumes at its end: nothing left to do, same weights.
    again = tiny_moe()
    run_loop(again, lm_loss, random_batch, LoopOptions(tmp_path / "b", **options), "again")
    assert all(mx.array_equal(a[k], v) for k, v in params(again).items())


def test_log_and_checkpoint_files(tmp_path):
    evals = []

    def eval_fn(model):
        evals.append(1)
        return {"calls": len(evals)}

    log = run_loop(tiny_moe(), lm_loss, random_batch,
                   LoopOptions(tmp_path, steps=5, learning_rate=1e-3, checkpoint_every=2, log_every=2),
                   "files", eval_fn=eval_fn)
    written = json.loads((tmp_path / LOG_FILE).read_text())
    assert written["description"] == "files"
    assert written["log"] == log
    assert [e["step"] for e in log if "loss" in e] == [2, 4, 5]
    assert [(e["step"], e["eval"]["calls"]) for e in log if "eval" in e] == [(2, 1), (4, 2), (5, 3)]
    # Only the newest two complete checkpoints remain, and no temp dirs.
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir()) == ["step_0000004", "step_0000005"]
    state = json.loads((tmp_path / CHECKPOINTS / "step_0000005" / STATE_FILE).read_text())
    assert state["step"] == 5 and state["seed"] == 0


def test_half_written_checkpoint_is_ignored(tmp_path):
    options = LoopOptions(tmp_path, steps=2, learning_rate=1e-3, checkpoint_every=1)
    run_loop(tiny_moe(), lm_loss, random_batch, options, "first")
    # A crash mid-write leaves a temp dir, or a step dir without its state file.
    (tmp_path / CHECKPOINTS / ".step_0000009.tmp").mkdir()
    (tmp_path / CHECKPOINTS / "step_0000008").mkdir()
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_0000001", "step_0000002"]


def test_resume_with_other_options_is_refused(tmp_path):
    run_loop(tiny_moe(), lm_loss, random_batch, LoopOptions(tmp_path, steps=2, learning_rate=1e-3), "a")
    with pytest.raises(ValueError, match=r"state.json was written with"):
        run_loop(tiny_moe(), lm_loss, random_batch, LoopOptions(tmp_path, steps=2, learning_rate=2e-3), "b")


def test_resume_with_other_trainable_parameters_is_refused(tmp_path):
    run_loop(tiny_moe(), lm_loss, random_batch, LoopOptions(tmp_path, steps=1, learning_rate=1e-3), "a")
    model = tiny_moe()
    model.freeze()
    model.model.norm.unfreeze()
    with pytest.raises(ValueError, match=r"trainable.safetensors does not match"):
        run_loop(model, lm_loss, random_batch, LoopOptions(tmp_path, steps=1, learning_rate=1e-3), "b")


def test_schedule_warms_up_then_decays_to_a_tenth():
    schedule = learning_rate_schedule(LoopOptions(Path("x"), steps=10, learning_rate=1.0, warmup_steps=2))
    lrs = [schedule(mx.array(s)).item() for s in range(11)]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.5) and lrs[2] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


@pytest.mark.parametrize("bad, message", [
    (dict(steps=-1), "steps"), (dict(learning_rate=0.0), "learning_rate"),
    (dict(checkpoint_every=0), "checkpoint_every"), (dict(warmup_steps=20), "warmup_steps"),
    (dict(grad_clip=-1.0), "grad_clip"),
])  # fmt: skip
def test_bad_loop_options(bad, message):
    fields = dict(out_dir=Path("x"), steps=10, learning_rate=1e-3) | bad
    with pytest.raises(ValueError, match=message):
        LoopOptions(**fields)

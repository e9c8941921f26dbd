"""Recipe: trained prerouter heads and the recovery LoRA for the default model, in one command.

Runs after ``examples/train_tiny_moe.py WORKDIR`` (which leaves the bf16 teacher in
``WORKDIR/teacher`` and its int4 edge0 checkpoint with warm-started heads in
``WORKDIR/edge0``): the three phases on ``WORKDIR/edge0`` with the settings
QUALITY.md reports (``edge0 train heads|sft|distill``), then ``edge0 eval``.
Resumes if interrupted. About 30–45 CPU-minutes.

    python examples/train_recovery.py WORKDIR [--install-default]

``--install-default`` copies the three files the phases write (trained
``prerouter.safetensors``, ``adapters.safetensors``, ``adapter_config.json``)
into ``mlx_edge0/default/edge0`` — only when that checkpoint holds the very
weights they were trained on — and loads it back to validate them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx_edge0
from mlx_edge0.default_model import DEFAULT_ROOT, EDGE0_DIR, TEACHER_DIR
from mlx_edge0.evaluate import EvalOptions, evaluate, format_table
from mlx_edge0.lora import ADAPTER_CONFIG_FILE, ADAPTERS_FILE
from mlx_edge0.prerouter_heads import PREROUTER_FILE
from mlx_edge0.train.distill import train_distill
from mlx_edge0.train.heads import train_heads
from mlx_edge0.train.phases import GenerationOptions, PhaseOptions
from mlx_edge0.train.sft import train_sft

OUTPUTS = (PREROUTER_FILE, ADAPTERS_FILE, ADAPTER_CONFIG_FILE)


def main(workdir: Path, install: bool) -> None:
    checkpoint, teacher = workdir / EDGE0_DIR, workdir / TEACHER_DIR
    runs = workdir / "recovery"
    train_heads(
        PhaseOptions(checkpoint, runs / "heads", steps=200, learning_rate=3e-3, batch_size=8, checkpoint_every=50)
    )
    train_sft(
        PhaseOptions(checkpoint, runs / "sft", steps=400, learning_rate=2e-3, batch_size=4, checkpoint_every=50),
        teacher,
        GenerationOptions(sequences=512),
        rank=32,
        alpha=64,
    )
    train_distill(
        PhaseOptions(
            checkpoint,
            runs / "distill",
            steps=150,
            learning_rate=2e-3,
            batch_size=4,
            checkpoint_every=50,
            warmup_steps=5,
        ),
        teacher,
        GenerationOptions(sequences=64),
    )
    result = evaluate(
        checkpoint,
        teacher,
        {"SFT LoRA": runs / "sft", "distill LoRA": runs / "distill"},
        EvalOptions(seq_len=128, windows=32),
    )
    (workdir / "recovery.json").write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    if install:
        target = DEFAULT_ROOT / EDGE0_DIR
        same = (target / "model.safetensors").read_bytes() == (checkpoint / "model.safetensors").read_bytes()
        if not same:
            raise SystemExit(
                f"{target} is not the checkpoint these files were trained on; install "
                f"it first (examples/train_tiny_moe.py {workdir} --install-default)"
            )
        for name in OUTPUTS:
            shutil.copy(checkpoint / name, target / name)
        model = mlx_edge0.load_model(target)  # validates heads and adapters against it
        print(f"installed {', '.join(OUTPUTS)} into {target} ({len(model.edge0_adapters.config.targets)} LoRA targets)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--install-default", action="store_true")
    args = parser.parse_args()
    main(args.workdir, args.install_default)

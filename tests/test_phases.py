"""The three training phases: one optimisation step lowers each phase's loss on
every family's tiny model; the commands drop their files into the checkpoint,
resume, and ``edge0 eval`` reports on the result."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from click.testing import CliRunner

from mlx_edge0 import lora
from mlx_edge0.cli import main
from mlx_edge0.prerouter_heads import PrerouterSpec, init_heads
from mlx_edge0.train.base import load_teacher
from mlx_edge0.train.distill import distill_loss, distill_terms
from mlx_edge0.train.heads import HeadSet, head_features, head_losses
from mlx_edge0.train.phase_commands import distill_command, heads_command, sft_command
from mlx_edge0.train.phases import generate_batch, load_served
from mlx_edge0.train.sft import attach_trainable_adapters, sft_loss
from mlx_edge0.train.student import StudentPath

from conftest import FAMILIES
from test_student import TEXT, copy_with_heads

PROMPT = 6


def _rows(path, batch: int = 2, length: int = 24) -> mx.array:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    ids = load_tokenizer(path).encode(TEXT * 2)
    return mx.array([ids[i : i + length] for i in range(0, batch * 3, 3)])


def _one_step_lowers(module: nn.Module, loss, learning_rate: float) -> tuple[float, float]:
    """Loss before and after one Adam step on the same batch."""
    before = loss(module)
    optimizer = optim.Adam(learning_rate=learning_rate)
    _, grads = nn.value_and_grad(module, loss)(module)
    optimizer.update(module, grads)
    mx.eval(module.parameters())
    return before.item(), loss(module).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_lowers_the_heads_loss(converted, family):
    model = load_served(converted(family).edge0, prerouter=False)
    model.freeze()
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    consumer_of = dict(zip(spec.owners, spec.consumers))
    features = head_features(StudentPath(model, heads={}), _rows(converted(family).edge0), consumer_of)
    heads = HeadSet(init_heads(model, spec))

    def loss(m):
        return sum(sum(head_losses(h, features[o])[:2]) for o, h in m.as_dict().items())

    before, after = _one_step_lowers(heads, loss, 1e-3)
    assert after < before
    assert not model.trainable_parameters() or not any(
        v.size for _, v in nn.utils.tree_flatten(model.trainable_parameters())
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_lowers_the_sft_and_distill_losses(converted, tmp_path, family):
    path = copy_with_heads(converted, tmp_path, family)
    rows = _rows(path)
    model = load_served(path)
    attach_trainable_adapters(model, seed=0, rank=lora.RANK, alpha=lora.ALPHA)
    trainable = dict(nn.utils.tree_flatten(model.trainable_parameters()))
    assert trainable and all(k.endswith(("lora_a", "lora_b")) for k in trainable)
    student = StudentPath(model)
    assert student.heads  # prerouting on, as served
    before, after = _one_step_lowers(model, lambda m: sft_loss(student, rows, PROMPT), 1e-3)
    assert after < before
    teacher_logits = load_teacher(converted(family).source)(rows[:, :-1])
    batch = {"tokens": rows, "teacher_logits": teacher_logits}
    before, after = _one_step_lowers(model, lambda m: distill_loss(student, batch, PROMPT), 1e-3)
    assert after < before


def test_distill_terms_vanish_when_student_equals_teacher_and_are_kls_otherwise():
    logits = mx.random.normal((2, 5, 64), key=mx.random.key(0))
    same = distill_terms(logits, logits, top_k=4)
    for term in same.values():
        assert mx.abs(term).max().item() < 1e-5
    other = distill_terms(logits, logits * 2 + 1, top_k=4)
    assert mx.min(other["reverse_kl"]).item() > 0
    assert mx.min(other["topk"] + other["tail"]).item() > 0  # the forward KL over k + 1 buckets


def test_generate_batch_matches_generate_step_on_the_served_path(converted, tmp_path):
    from mlx_lm.generate import generate_step

    path = copy_with_heads(converted, tmp_path, "qwen3_5_moe")
    model = load_served(path)
    prompts = _rows(path, batch=2, length=PROMPT)
    out = generate_batch(model, prompts, 10, 0.0, seed=0)
    for row in range(2):
        alone = [int(t) for (t, _), _ in zip(generate_step(prompts[row], model, max_tokens=10), range(10))]
        assert out[row, PROMPT:].tolist() == alone
    sampled = [generate_batch(model, prompts, 10, 1.0, seed=s)[:, PROMPT:].tolist() for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def _invoke(command, args):
    result = CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_phase_commands_drop_files_in_resume_and_evaluate(converted, tmp_path):
    family = "qwen3_next"
    path, teacher = copy_with_heads(converted, tmp_path, family), converted(family).source
    common = [
        "--batch-size",
        2,
        "--seq-len",
        32,
        "--max-files",
        2,
        "--eval-windows",
        2,
        "--checkpoint-every",
        2,
        "--warmup-steps",
        0,
    ]
    gen = ["--sequences", 4, "--prompt-tokens", 6, "--new-tokens", 10]
    heads_before = (path / "prerouter.safetensors").read_bytes()
    _invoke(heads_command, [path, "--out", tmp_path / "run1", "--steps", 2, *common])
    assert (path / "prerouter.safetensors").read_bytes() != heads_before
    report = json.loads((tmp_path / "run1" / "report.json").read_text())
    assert set(report["trained"]) >= {"recall", "kl"} and set(report["warm_start"]) >= {"recall", "kl"}
    assert report["trained"]["kl"] < report["warm_start"]["kl"]

    _invoke(sft_command, [path, "--out", tmp_path / "run2", "--steps", 3, "--teacher", teacher, *common, *gen])
    log = json.loads((tmp_path / "run2" / "log.json").read_text())
    assert [e["step"] for e in log["log"] if "loss" in e] == [3]
    assert (path / lora.ADAPTERS_FILE).exists() and (tmp_path / "run2" / lora.ADAPTERS_FILE).exists()
    served = load_served(path, lora=True)
    assert served.edge0_adapters is not None
    data = (tmp_path / "run2" / "sft_data.npy").read_bytes()
    _invoke(sft_command, [path, "--out", tmp_path / "run2", "--steps", 3, "--teacher", teacher, *common, *gen])
    assert json.loads((tmp_path / "run2" / "log.json").read_text()) == log  # resumed at the end
    assert (tmp_path / "run2" / "sft_data.npy").read_bytes() == data

    sft_adapters = (path / lora.ADAPTERS_FILE).read_bytes()
    _invoke(
        distill_command,
        [
            path,
            "--out",
            tmp_path / "run3",
            "--steps",
            2,
            "--teacher",
            teacher,
            *common,
            "--sequences",
            2,
            "--prompt-tokens",
            6,
            "--new-tokens",
            10,
        ],
    )
    assert (path / lora.ADAPTERS_FILE).read_bytes() != sft_adapters

    result = _invoke(
        main,
        [
            "eval",
            path,
            "--teacher",
            teacher,
            "--sft",
            tmp_path / "run2",
            "--distill",
            tmp_path / "run3",
            "--windows",
            2,
            "--seq-len",
            32,
            "--max-files",
            2,
            "--json",
            tmp_path / "eval.json",
        ],
    )
    evaluation = json.loads((tmp_path / "eval.json").read_text())
    rows = [r["row"] for r in evaluation["rows"]]
    assert rows == [
        "fp teacher",
        "int4, exact routing",
        "int4 + warm-start heads",
        "int4 + checkpoint heads",
        "int4 + heads + SFT LoRA",
        "int4 + heads + distill LoRA",
    ]
    assert set(evaluation["head_recall"]) == {"warm_start", "checkpoint"}
    survival = evaluation["merge_survival"]["distill LoRA"]
    assert set(survival["weights"]) == {"attention", "linear_attention", "shared_expert", "dense_mlp"}
    assert "| int4 + heads + distill LoRA |" in result.output


@pytest.mark.parametrize("command, flags, message", [
    (heads_command, ["--warmup-steps", "-1"], "warmup_steps must be in [0, steps=300]"),
    (heads_command, ["--learning-rate", "0"], "learning_rate must be > 0"),
    (sft_command, ["--steps", "-1", "--teacher", "."], "steps must be >= 0"),
    (distill_command, ["--checkpoint-every", "0", "--teacher", "."], "checkpoint_every and log_every must be >= 1"),
    (main, ["--windows", "0"], "windows and batch_size must be >= 1"),
])  # fmt: skip
def test_bad_options_fail_before_any_slow_work(tmp_path, command, flags, message):
    """An empty CHECKPOINT dir: a late check would fail on loading it, not on the option."""
    args = ["eval", tmp_path] if command is main else [tmp_path, "--out", tmp_path / "run"]
    result = CliRunner().invoke(command, [str(a) for a in args + flags])
    assert result.exit_code == 1 and message in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_generated_rows_are_the_same_with_and_without_a_bar(converted, capsys):
    from mlx_edge0.train.phases import GenerationOptions, generate_rows

    path = converted("qwen3_moe").edge0
    model, prompts = load_served(path), _rows(path, batch=3, length=PROMPT)
    options = GenerationOptions(sequences=3, prompt_tokens=PROMPT, new_tokens=2, temperature=0.0, batch=2)
    quiet = generate_rows(model, prompts, options, 0, "gen test", show_progress=False)
    assert capsys.readouterr().err == ""
    shown = generate_rows(model, prompts, options, 0, "gen test")
    err = capsys.readouterr().err
    assert (quiet == shown).all() and "gen test" in err and "3/3" in err


def test_distill_needs_phase_2_adapters(converted, tmp_path):
    path = copy_with_heads(converted, tmp_path, "qwen3_moe")
    result = CliRunner().invoke(
        distill_command, [str(path), "--out", str(tmp_path / "run"), "--teacher", str(converted("qwen3_moe").source)]
    )
    assert result.exit_code != 0 and "run `edge0 train sft` first" in result.output


def check_quality_ordering(checkpoint, teacher) -> dict:
    """What QUALITY.md reports, on a few held-out windows: int4 alone costs about nothing
    (within 2% either way on few windows); warm-started heads cost the most, trained heads
    less, the recovery LoRA less again, closing most of the trained heads' gap to the
    teacher: QUALITY.md measures 80.3% on 32 windows (target 70%); these 6 windows give
    68.2% for the shipped adapters, so the bound is 60%, far above an unloaded LoRA's 0%."""
    from mlx_edge0.evaluate import EvalOptions, evaluate

    result = evaluate(
        checkpoint, teacher, options=EvalOptions(seq_len=128, windows=6, batch_size=6), log=lambda m: None
    )
    ppl = {r["row"]: r["ppl"] for r in result["rows"]}
    teacher_ppl = ppl.pop("fp teacher")
    exact = ppl.pop("int4, exact routing")
    assert abs(exact / teacher_ppl - 1) < 0.02
    lora = ppl.pop("int4 + heads + checkpoint LoRA")
    assert all(teacher_ppl <= v for v in ppl.values())  # heads without the LoRA cost something
    assert ppl["int4 + warm-start heads"] > ppl["int4 + checkpoint heads"] > lora
    heads = ppl["int4 + checkpoint heads"]
    assert (heads - lora) / (heads - teacher_ppl) >= 0.60
    recall = result["head_recall"]
    assert recall["checkpoint"]["recall"] > recall["warm_start"]["recall"]
    return result


def test_eval_on_the_shipped_default_model():
    from mlx_edge0.default_model import default_checkpoint, default_teacher

    result = check_quality_ordering(default_checkpoint(), default_teacher())
    assert set(result["merge_survival"]) == {"checkpoint LoRA"}

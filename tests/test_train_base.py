"""The training loop (resume, log, atomic checkpoints), the stdlib corpus and the base model."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_edge0.tiny import build_tiny_model, model_module, train_tokenizer
from mlx_edge0.train import base, data
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
    log = run_loop(
        model, lm_loss, lambda step: fixed, LoopOptions(tmp_path, steps=8, learning_rate=1e-2, log_every=1), "fit"
    )
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
    straight_log = run_loop(straight, lm_loss, random_batch, LoopOptions(tmp_path / "a", **options), "straight")

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

    log = run_loop(
        tiny_moe(),
        lm_loss,
        random_batch,
        LoopOptions(tmp_path, steps=5, learning_rate=1e-3, checkpoint_every=2, log_every=2),
        "files",
        eval_fn=eval_fn,
    )
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
    (tmp_path / CHECKPOINTS / ".step_0000009.edge0-tmp-1").mkdir()
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


# --- the stdlib corpus ---------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_corpus_files_skip_tests_packages_and_build_data(tmp_path):
    root = write_tree(tmp_path, {
        "os.py": "a", "json/decoder.py": "b", "json/README": "c", "test/test_os.py": "d",
        "unittest/test/test_case.py": "e", "idlelib/idle_test/t.py": "f",
        "site-packages/pkg/m.py": "g", "encodings/cp1252.py": "h", "pydoc_data/topics.py": "i",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "j", "__pycache__/os.py": "k",
    })  # fmt: skip
    assert data.corpus_files(root) == ["json/decoder.py", "os.py"]


def test_corpus_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        data.corpus_files(tmp_path)
    (tmp_path / "bad.py").write_bytes(b"x = '\xff'\n")
    with pytest.raises(ValueError, match=r"bad\.py: not UTF-8"):
        data.split_corpus(tmp_path, fraction=0.5).texts("train" if not data.is_held_out("bad.py", 0.5) else "held_out")
    with pytest.raises(ValueError, match="fraction"):
        data.split_corpus(tmp_path, fraction=1.0)


def test_split_is_by_file_and_depends_only_on_the_path(tmp_path):
    files = {f"pkg{i % 7}/mod_{i}.py": f"x = {i}\n" for i in range(400)}
    a = data.split_corpus(write_tree(tmp_path / "a", files))
    b = data.split_corpus(write_tree(tmp_path / "b", {k: "other text\n" for k in files}))
    assert (a.train, a.held_out) == (b.train, b.held_out)
    assert set(a.train).isdisjoint(a.held_out) and set(a.train) | set(a.held_out) == set(files)
    assert 5 <= len(a.held_out) <= 40  # ~5% of 400
    digest = int.from_bytes(__import__("hashlib").sha256(b"pkg0/mod_0.py").digest()[:8], "big")
    assert data.is_held_out("pkg0/mod_0.py") == (digest < 0.05 * 2**64)


def test_real_stdlib_split():
    split = data.split_corpus()
    assert len(split.train) > 100 and 0.02 < len(split.held_out) / len(split.train) < 0.1
    assert "os.py" in split.train + split.held_out
    assert not any(p.startswith("test/") for p in split.train + split.held_out)
    assert data.split_corpus() == split


def test_fingerprint_sees_names_and_contents(tmp_path):
    root = write_tree(tmp_path, {"a.py": "1", "b.py": "2"})
    base = data.fingerprint(root, ["a.py", "b.py"])
    assert data.fingerprint(root, ["a.py", "b.py"]) == base
    assert data.fingerprint(root, ["a.py"]) != base
    (root / "b.py").write_text("3")
    assert data.fingerprint(root, ["a.py", "b.py"]) != base


TOKENIZER_TEXTS = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    out = train_tokenizer(tmp_path_factory.mktemp("tok"), 300, texts=TOKENIZER_TEXTS)
    return out, Tokenizer.from_file(str(out / "tokenizer.json"))


def test_tokenizer_from_texts_is_deterministic(small_tokenizer, tmp_path):
    first, tok = small_tokenizer
    again = train_tokenizer(tmp_path, 300, texts=TOKENIZER_TEXTS)
    assert (again / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert tok.token_to_id(data.DOCUMENT_SEPARATOR) == 0
    assert 259 < tok.get_vocab_size() <= 300  # bytes + specials + merges, capped


def test_tokenize_documents_separates_documents(small_tokenizer):
    _, tok = small_tokenizer
    stream = data.tokenize_documents(tok, ["def f", "class A"])
    expected = tok.encode("def f").ids + [0] + tok.encode("class A").ids + [0]
    assert stream.dtype == np.int32 and stream.tolist() == expected


def test_batches_are_a_pure_function_of_the_step():
    tokens = np.arange(1000, dtype=np.int32)
    batches = data.TokenBatches(tokens, seq_len=9, batch_size=4, seed=1)
    assert batches.num_windows == 100 and batches.steps_per_epoch == 25
    first = batches(3)
    assert first.shape == (4, 10) and first.dtype == mx.int32
    assert mx.array_equal(data.TokenBatches(tokens, 9, 4, seed=1)(3), first)
    assert not mx.array_equal(data.TokenBatches(tokens, 9, 4, seed=2)(3), first)
    # Each window is a contiguous slice starting on a multiple of 10.
    starts = np.array(first[:, 0])
    assert np.array_equal(np.array(first), starts[:, None] + np.arange(10)) and (starts % 10 == 0).all()
    # One epoch visits every window once; the next epoch reshuffles.
    epoch = np.concatenate([batches.window_ids(s) for s in range(25)])
    assert sorted(epoch.tolist()) == list(range(100))
    assert not np.array_equal(batches.window_ids(25), batches.window_ids(0))


def test_batches_and_eval_windows_reject_short_streams():
    with pytest.raises(ValueError, match="fewer than batch_size"):
        data.TokenBatches(np.arange(30, dtype=np.int32), seq_len=9, batch_size=4)
    with pytest.raises(ValueError, match="fewer than one window"):
        data.eval_windows(np.arange(5, dtype=np.int32), seq_len=9)
    assert data.eval_windows(np.arange(35, dtype=np.int32), 9).shape == (3, 10)
    assert data.eval_windows(np.arange(35, dtype=np.int32), 9, max_windows=2).shape == (2, 10)


# --- the base model -------------------------------------------------------------------------


def test_base_config_builds_the_stock_model():
    config = base.base_config(4096)
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == []
    model = model_module(config).Model(model_module(config).ModelArgs.from_dict(config))
    assert len(model.layers) == 6
    assert all(layer.mlp.switch_mlp.gate_proj.weight.shape == (16, 64, 128) for layer in model.layers)
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 3.6e6 < n < 3.8e6  # the size the docs state


def test_balance_loss_is_one_when_uniform_and_grows_with_collapse():
    k = 4
    uniform = base.balance_loss(mx.zeros((64, 16)), k)
    assert uniform.item() == pytest.approx(1.0)
    collapsed = mx.zeros((64, 16)).at[:, :4].add(10.0)  # everyone picks experts 0..3
    assert base.balance_loss(collapsed, k).item() == pytest.approx(4.0, rel=1e-3)
    grad = mx.grad(lambda x: base.balance_loss(x, k))(collapsed)
    assert (grad[:, :4] > 0).all().item()  # the gradient pushes the favourites down


def test_tapped_routers_keep_names_outputs_and_untap(tmp_path):
    model = tiny_moe()
    tokens = random_batch(0)[:, :8]
    before, names = model(tokens), sorted(params(model))
    tap = base.tap_routers(model)
    assert sorted(params(model)) == names
    assert mx.array_equal(model(tokens), before)
    moe_layers = [layer for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]
    assert len(tap.logits) == len(moe_layers) and tap.logits[0].shape == (2, 8, 16)
    base.untap_routers(model)
    assert all(type(layer.mlp.gate) is nn.Linear for layer in moe_layers)
    assert mx.array_equal(model(tokens), before) and sorted(params(model)) == names


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    model = tiny_moe()
    model.lm_head.weight = mx.zeros_like(model.lm_head.weight)  # every logit 0
    windows = np.array(random_batch(0))
    result = base.held_out_perplexity(model, windows, batch_size=1)
    assert result["tokens"] == 2 * 16
    assert result["perplexity"] == pytest.approx(VOCAB, rel=1e-5)
    assert base.lm_loss(model, mx.array(windows)).item() == pytest.approx(np.log(VOCAB), rel=1e-5)


def test_train_base_command_is_registered_and_validates():
    from click.testing import CliRunner

    from mlx_edge0.cli import main

    r = CliRunner().invoke(main, ["train", "base", "--help"])
    assert r.exit_code == 0 and "--steps" in r.output
    r = CliRunner().invoke(main, ["train", "base", "/tmp/never-written", "--vocab-size", "100"])
    assert r.exit_code == 1 and "vocab_size must be >= 512" in r.output
    assert not Path("/tmp/never-written").exists()


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_training_record_holds_no_path_of_the_build_machine(tmp_path):
    from mlx_edge0.default_model import default_checkpoint, default_teacher

    split = data.split_corpus(write_tree(tmp_path / "lib", {f"m{i}.py": f"x = {i}\n" for i in range(40)}))
    report = base.BaseReport(
        teacher=tmp_path / "out" / "teacher",
        train_tokens=1,
        held_out_tokens=1,
        final_train_loss=1.0,
        held_out={},
        training_seconds=1.0,
        tokens_per_s=1.0,
    )
    record = base.training_record(base.BaseOptions(out_dir=tmp_path / "out"), split, report)
    assert record["report"]["teacher"] == "teacher" and "out_dir" not in record["options"]
    assert record["corpus_sha256"] == data.fingerprint(split.root, split.train + split.held_out)
    assert not [s for s in _strings(record) if str(tmp_path) in s]
    json.dumps(record)
    for shipped in (default_checkpoint(), default_teacher()):
        strings = list(_strings(json.loads((shipped / base.TRAINING_FILE).read_text())))
        assert strings and not [s for s in strings if s.startswith("/")], shipped


@pytest.mark.parametrize("flags, message", [
    (["--warmup-steps", "-1"], "warmup_steps must be in [0, steps=400]"),
    (["--steps", "10", "--warmup-steps", "20"], "warmup_steps must be in [0, steps=10]"),
    (["--learning-rate", "0"], "learning_rate must be > 0"),
    (["--log-every", "0"], "checkpoint_every and log_every must be >= 1"),
    (["--batch-size", "0"], "batch_size and seq_len must be >= 1"),
])  # fmt: skip
def test_train_base_checks_every_option_before_reading_the_corpus(monkeypatch, tmp_path, flags, message):
    from click.testing import CliRunner

    from mlx_edge0.cli import main

    def no_corpus(*args, **kwargs):
        raise AssertionError("the corpus was read before the options were checked")

    monkeypatch.setattr(base, "split_corpus", no_corpus)
    r = CliRunner().invoke(main, ["train", "base", str(tmp_path / "out"), *flags])
    assert r.exit_code == 1 and message in r.output, r.output
    assert "corpus" not in r.output and not (tmp_path / "out").exists()


def test_tokenizing_with_a_label_draws_a_bar_and_gives_the_same_tokens(small_tokenizer, capsys):
    _, tokenizer = small_tokenizer
    texts = ["def f(x):\n    return x\n"] * (data.TOKENIZE_BATCH + 3)
    quiet = data.tokenize_documents(tokenizer, texts)
    assert capsys.readouterr().err == ""
    shown = data.tokenize_documents(tokenizer, texts, label="tokenizing test")
    err = capsys.readouterr().err
    assert np.array_equal(quiet, shown) and "tokenizing test" in err and "100%" in err

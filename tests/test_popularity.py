"""The routing profile: ``edge0 profile`` counts a text's routings, the file
is validated against its checkpoint, and a load seeds the hot cache's LFU."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0.bench.eviction import simulate
from mlx_edge0.bench.locality import RoutingTrace
from mlx_edge0.checkpoint import CheckpointError, Edge0Section, read_config
from mlx_edge0.cli import main
from mlx_edge0.cache_policy import FrequencyPolicy
from mlx_edge0.popularity import (
    PROFILE_FILE,
    RoutingProfile,
    load_profile,
    measure_profile,
    prior_counts,
    require_profile,
    save_profile,
)
from mlx_edge0.telemetry import Telemetry
from mlx_edge0.tensorfile import TensorWriter

FAMILY = "qwen3_moe"


@pytest.fixture
def checkpoint(converted, tmp_path):
    path = tmp_path / "edge0"
    shutil.copytree(converted(FAMILY).edge0, path)
    return path


def _section(path) -> Edge0Section:
    return Edge0Section.from_config(read_config(path), path / "config.json")


def _tokens(n: int) -> list[int]:
    return np.random.default_rng(7).integers(0, 256, n).tolist()


def test_a_prompt_chunk_and_single_tokens_count_the_same_routings(checkpoint):
    """Every token counted once per MoE layer, K routings each, whether a
    chunk goes through the whole-layer path or tokens go one by one through
    the hot path: the two counting sites agree exactly."""
    tokens = _tokens(48)
    whole = measure_profile(mlx_edge0.load_model(checkpoint, prefill="whole-layer"), tokens, "t", 48, False)
    single = measure_profile(mlx_edge0.load_model(checkpoint), tokens, "t", 1, False)
    section = _section(checkpoint)
    k = section.num_experts_per_tok
    assert whole.counts.shape == (len(section.moe_layers), section.experts.num_experts)
    assert (whole.counts.sum(axis=1) == 48 * k).all()
    assert np.array_equal(whole.counts, single.counts)
    assert whole.tokens == 48 and whole.k == (k,) * 3 and whole.layers == section.moe_layers


def test_counting_reports_each_layer_and_a_profile_leaves_nothing_counting(checkpoint):
    """``edge0 profile``'s bar moves by MoE layer (``counted_layer``), and a
    profile turns counting off again when it is done."""
    telemetry, seen = Telemetry(routing_counts={}), []
    telemetry.counted_layer = seen.append
    telemetry.count_routings(3, np.array([[1, 2], [2, 5]]))
    assert seen == [3] and telemetry.routing_counts[3].tolist() == [0, 1, 2, 0, 0, 1]
    model = mlx_edge0.load_model(checkpoint, prefill="whole-layer")
    measure_profile(model, _tokens(10), "t", 4, False)
    assert model.edge0_runtime.telemetry.routing_counts is None
    assert model.edge0_runtime.telemetry.counted_layer is None


def test_the_command_writes_a_profile_that_info_and_verify_accept(checkpoint, tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["profile", str(checkpoint), "--random-tokens", "40", "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert (
        f"wrote {checkpoint / PROFILE_FILE}: 3 MoE layers x 16 experts, 40 tokens (random tokens, seed 3)" in r.output
    )
    profile = load_profile(checkpoint, _section(checkpoint))
    assert profile.tokens == 40 and profile.source == "random tokens, seed 3"
    assert (profile.counts.sum(axis=1) == 40 * np.array(profile.k)).all()
    r = runner.invoke(main, ["info", str(checkpoint)])
    assert "routing profile 40 tokens (random tokens, seed 3), K=4: seeds the hot cache's counts" in r.output
    r = runner.invoke(main, ["info", "--verify", str(checkpoint)])
    assert r.exit_code == 0 and "verify          ok" in r.output, r.output

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 8)
    r = runner.invoke(main, ["profile", str(checkpoint), "--text", str(text), "--max-tokens", "20"])
    assert r.exit_code == 0, r.output
    assert load_profile(checkpoint, _section(checkpoint)).tokens == 20


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give one of --text FILE or --random-tokens N"),
        (["--random-tokens", "4", "--text", "x.txt"], "give one of --text FILE or --random-tokens N"),
        (["--text", "{bad}"], "cannot be read as UTF-8 text"),
        (["--text", "{empty}"], "no tokens to count (the file is empty)"),
        (["--random-tokens", "4", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    ],
)
def test_bad_command_input_is_a_clear_error_and_writes_nothing(checkpoint, tmp_path, args, message):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    (tmp_path / "empty.txt").write_text("")
    args = [a.format(bad=tmp_path / "bad.txt", empty=tmp_path / "empty.txt") for a in args]
    r = CliRunner().invoke(main, ["profile", str(checkpoint), *args])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output
    assert not (checkpoint / PROFILE_FILE).exists()


def test_a_load_seeds_the_hot_cache_with_the_profile_unless_told_not_to(checkpoint):
    section = _section(checkpoint)
    counts = np.zeros((len(section.moe_layers), section.experts.num_experts), np.float32)
    counts[:, 5] = 30
    counts[:, 9] = 10
    save_profile(checkpoint, RoutingProfile(section.moe_layers, counts, 10, (4, 4, 4), "hand-made"))
    hot = mlx_edge0.load_model(checkpoint).edge0_runtime.hot
    k = section.num_experts_per_tok
    # 128 tokens' worth of K routings, split 3:1
    assert hot.policy.count == {(layer, 5): 96.0 * k for layer in section.moe_layers} | {
        (layer, 9): 32.0 * k for layer in section.moe_layers
    }
    assert hot.prior == hot.policy.count  # kept, so the bench's replay starts from them too
    unseeded = mlx_edge0.load_model(checkpoint, popularity_prior=False).edge0_runtime.hot
    assert unseeded.policy.count == unseeded.prior == {}


def test_a_checkpoint_named_for_its_profile_must_have_one(checkpoint):
    """``require_profile``: the replay scripts' ``--profile`` names a
    checkpoint; without a profile it is a clear error naming the file."""
    with pytest.raises(CheckpointError, match=f"{checkpoint}: no {PROFILE_FILE} \\(make it with `edge0 profile`\\)"):
        require_profile(checkpoint)
    section = _section(checkpoint)
    counts = np.ones((len(section.moe_layers), section.experts.num_experts), np.float32)
    save_profile(checkpoint, RoutingProfile(section.moe_layers, counts, 10, (4, 4, 4), "hand-made"))
    assert require_profile(checkpoint).source == "hand-made"


def test_a_bench_run_of_a_profiled_checkpoint_replays_from_the_profiles_counts(checkpoint):
    """The bench's own replay of a hot arm's decode starts from the counts
    the runtime's LFU started from: the record says so, and its LFU from the
    decode's start is ``simulate``'s with those counts."""
    from mlx_edge0.bench.eviction import RecordedDecode
    from mlx_edge0.bench.run_spec import RunSpec
    from mlx_edge0.bench.runner import run_child

    section = _section(checkpoint)
    counts = np.ones((len(section.moe_layers), section.experts.num_experts), np.float32)
    counts[:, 3] = 40
    save_profile(checkpoint, RoutingProfile(section.moe_layers, counts, 10, (4, 4, 4), "hand-made"))
    r = run_child(RunSpec("edge0-hot@1", checkpoint, 8, 6, "float32", 0), timeout_s=120)
    assert r["ok"], r.get("stderr_tail")
    assert r["eviction_replay"]["popularity_prior"] is True
    decode = RecordedDecode.of(r)
    k_of = dict(zip(decode.trace.layers, decode.trace.routed_k()))
    prior = prior_counts(load_profile(checkpoint, section), k_of)
    replayed = simulate(decode.trace, decode.capacity, "lfu", prior=prior, **decode.start()).hit_rate
    assert r["eviction_replay"]["from_start"]["hit_rate"]["lfu"] == replayed


def test_a_version_1_profile_still_seeds_the_cache_and_says_its_k_is_not_recorded(checkpoint):
    """A profile made before the file kept each layer's K has the same counts:
    it loads, seeds the cache as a version 2 file does, and ``edge0 info``
    says what it lacks rather than printing the one K it kept."""
    counts = np.zeros((3, 16), np.float32)
    counts[:, 5] = 30
    counts[:, 9] = 10
    _write(checkpoint, counts, version="1", k="4", source="v1")
    profile = load_profile(checkpoint, _section(checkpoint))
    assert profile.k is None and profile.tokens == 4 and np.array_equal(profile.counts, counts)
    seeded = mlx_edge0.load_model(checkpoint).edge0_runtime.hot.policy.count
    _write(checkpoint, counts)
    assert seeded == mlx_edge0.load_model(checkpoint).edge0_runtime.hot.policy.count
    assert seeded[(_section(checkpoint).moe_layers[0], 5)] == 96.0 * 4
    _write(checkpoint, counts, version="1", k="4", source="v1")
    r = CliRunner().invoke(main, ["info", str(checkpoint)])
    assert "routing profile 4 tokens (v1), K of each layer not recorded (a version 1 file)" in r.output, r.output


def test_prior_counts_split_each_layers_weight_by_its_shares():
    counts = np.array([[3, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    profile = RoutingProfile((1, 2), counts, 2, (2, 2), "x")
    assert prior_counts(profile, {1: 4, 2: 4, 7: 4}, tokens=10) == {(1, 0): 30.0, (1, 1): 10.0}
    assert prior_counts(profile, {1: 2}, experts=[1, 3], tokens=10) == {(1, 1): 5.0}


def test_a_prior_keeps_the_popular_expert_that_plain_lfu_evicts():
    """Two rows, filled by 1 and 2 (twice each) before 0, which is then used
    every other call. Plain LFU evicts 0 for 3 (0 has been seen once, 2
    twice) and reads it again; told 0 is popular, it evicts 2 instead and
    hits on every later 0."""
    calls = [[1], [1], [2], [2], [0], [3], [0], [4], [0], [5], [0]]
    trace = RoutingTrace(layers=[1], num_experts=8, k=1, tokens=[(tuple(c),) for c in calls])
    plain = simulate(trace, 2, "lfu")
    told = simulate(trace, 2, "lfu", prior={(1, 0): 2.0})
    assert (plain.hits, told.hits) == (4, 5)
    policy = FrequencyPolicy(4)
    policy.add_prior({"a": 1.5})
    policy.touch(["b", "b"])
    assert policy.victims(["a", "b", "c"], 2) == ["c", "a"]


def test_the_profile_records_each_layers_k_on_a_k_tier_checkpoint(checkpoint):
    """With heads for K=2, the layers they predict route at 2 and the first
    MoE layer, which no head predicts, at the checkpoint's 4: the file says
    so per layer, and so do the command and ``edge0 info``."""
    runner = CliRunner()
    assert runner.invoke(main, ["heads", "init", str(checkpoint), "--k", "2"]).exit_code == 0
    section = _section(checkpoint)
    first = section.moe_layers[0]
    r = runner.invoke(main, ["profile", str(checkpoint), "--random-tokens", "12"])
    assert r.exit_code == 0, r.output
    assert f"12 tokens (random tokens, seed 0), K=2 (4 on layer {first})" in r.output
    profile = load_profile(checkpoint, section)
    assert profile.k == (4, 2, 2)
    assert (profile.counts.sum(axis=1) == 12 * np.array([4, 2, 2])).all()
    r = runner.invoke(main, ["info", str(checkpoint)])
    assert f"routing profile 12 tokens (random tokens, seed 0), K=2 (4 on layer {first})" in r.output


def _write(checkpoint, counts, **metadata):
    config = read_config(checkpoint)
    meta = {
        "format": "edge0-popularity",
        "version": "2",
        "layers": json.dumps(list(config["edge0"]["moe_layers"])),
        "tokens": "4",
        "k": "[4, 4, 4]",
        "generation": config["edge0"]["generation"],
    } | metadata
    with TensorWriter(checkpoint / PROFILE_FILE, [("counts", "F32", counts.shape)], meta) as w:
        w.write("counts", counts)


@pytest.mark.parametrize(
    "counts, metadata, message",
    [
        (np.ones((3, 16), np.float32), {"generation": "0123456789abcdef"}, "files of two conversions are mixed"),
        (np.ones((3, 8), np.float32), {}, "expected one F32 tensor 'counts' of shape [3, 16]"),
        (np.full((3, 16), -1, np.float32), {}, "counts must be finite and >= 0"),
        (np.full((3, 16), np.nan, np.float32), {}, "counts must be finite and >= 0"),
        (np.ones((3, 16), np.float32), {"format": "edge0-prerouter"}, "not an edge0 routing profile"),
        (np.ones((3, 16), np.float32), {"layers": "[0, 1, 2]"}, "counts are for MoE layers [0, 1, 2]"),
        (np.ones((3, 16), np.float32), {"tokens": "many"}, "malformed metadata"),
        (np.ones((3, 16), np.float32), {"k": "4"}, "malformed metadata"),
        (np.ones((3, 16), np.float32), {"k": "[4, 4]"}, "one K in 1..16 per MoE layer"),
        (np.ones((3, 16), np.float32), {"k": "[4, 0, 4]"}, "one K in 1..16 per MoE layer"),
        (np.ones((3, 16), np.float32), {"version": "3"}, "not an edge0 routing profile of version 1 to 2"),
        (np.ones((3, 16), np.float32), {"version": "1", "k": "[4, 4, 4]"}, "malformed metadata"),
        (np.ones((3, 16), np.float32), {"version": "1", "k": "17"}, "one K in 1..16 per MoE layer"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_file(checkpoint, counts, metadata, message):
    _write(checkpoint, counts, **metadata)
    with pytest.raises(CheckpointError, match="popularity.safetensors") as e:
        load_profile(checkpoint, _section(checkpoint))
    assert message in str(e.value)
    r = CliRunner().invoke(main, ["generate", "--model", str(checkpoint), "--max-tokens", "2"])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output


def test_a_truncated_profile_is_refused_naming_the_file(checkpoint):
    _write(checkpoint, np.ones((3, 16), np.float32))
    path = checkpoint / PROFILE_FILE
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="popularity.safetensors"):
        load_profile(checkpoint, _section(checkpoint))


def test_random_tokens_need_no_tokenizer_and_text_without_one_is_a_clear_error(checkpoint, tmp_path):
    """A synthetic checkpoint (``edge0 bench synth``) has no tokenizer: its
    profile counts random token ids, which need none; ``--text`` there is
    refused, not a traceback."""
    from mlx_edge0.tiny import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        (checkpoint / name).unlink(missing_ok=True)
    runner = CliRunner()
    r = runner.invoke(main, ["profile", str(checkpoint), "--random-tokens", "12"])
    assert r.exit_code == 0, r.output
    assert load_profile(checkpoint, _section(checkpoint)).tokens == 12
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n")
    r = runner.invoke(main, ["profile", str(checkpoint), "--text", str(text)])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert f"{checkpoint}: no tokenizer to count --text with" in r.output

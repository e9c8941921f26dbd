"""Several processes, one model (mlx_edge0.parallel), on MLX's real distributed
engine: ``mlx.launch -n 2 --backend ring`` on 127.0.0.1.

One launch runs every case (tests/parallel_worker.py); each test compares its
ranks' results with the same case run here in one process. Tolerance: none.
Every (token, slot) output is written on exactly one rank and added to zeros
on the others, so the all_sum reproduces the one-process tensor exactly, and
the CPU's quantized matmul computes a pair's product the same whether it is
multiplied alone or with the other pairs; the logits are compared bit for
bit. (On Metal the kernels chosen for a rank's smaller calls may round
differently; there the greedy tokens are what holds.) The same holds for the
vocabulary each rank holds a slice of: an embedding row is looked up on one
rank and added to zeros on the others, and a logit is one row's product,
gathered as computed.
"""

from __future__ import annotations

import gc
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0.cli import main
from mlx_edge0.parallel import ExpertShard, VocabShard, pipeline_stage

from conftest import FAMILIES
from parallel_worker import run_one, vocab_rows

HERE = Path(__file__).parent
PROMPT = [5, 17, 33, 9, 101, 7, 64, 12, 250, 3]
TOKENS = 12
PIPELINED = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")  # the families whose mlx-lm model has `pipeline`
RANKS = 2
LAUNCH_TIMEOUT_S = 600
ODD_VOCAB = 511  # split 255 + 256 over two ranks


def free_port_pair() -> int:
    """A loopback port whose successor was free too (rank r listens on port + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free pair of loopback ports")


def launch(args: list[str], timeout: int = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``mlx.launch`` with the ring backend on 127.0.0.1 only; ends by itself."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(RANKS)]
    command += ["--starting-port", str(free_port_pair()), "--", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def heads_copy(source: Path, into: Path) -> Path:
    shutil.copytree(source, into)
    result = CliRunner().invoke(main, ["heads", "init", str(into)])
    assert result.exit_code == 0, result.output
    return into


@pytest.fixture(scope="module")
def cases(converted, tmp_path_factory):
    """name -> (run spec, {rank: results or error text}), all from one launch."""
    root = tmp_path_factory.mktemp("parallel")
    runs = []
    for family in FAMILIES:
        edge0 = converted(family).edge0
        runs.append({"name": f"{family}-expert", "checkpoint": str(edge0), "options": {"parallel": "expert"}})
        runs.append({"name": f"{family}-pipeline", "checkpoint": str(edge0), "options": {"parallel": "pipeline"}})
    # The prerouter, its staging buffers (per layer and a window), the hot
    # cache off and on, whole-layer prefill: each under expert parallel.
    for family in ("qwen3_moe", "bailing_moe_v3"):
        heads = heads_copy(converted(family).edge0, root / f"{family}-heads")
        for tag, options in {
            "heads": {},
            "heads-window": {"staged_window": 3, "cache_gib": 0},
            "staged-whole-layer": {"prerouter": False, "staged": True, "prefill": "whole-layer"},
        }.items():
            runs.append(
                {
                    "name": f"{family}-expert-{tag}",
                    "checkpoint": str(heads),
                    "options": {"parallel": "expert", **options},
                }
            )
    # A vocabulary the ranks cannot split evenly, with its own (unquantized) LM head and tied to the embedding.
    for name, family, build in [
        ("bailing_moe_v3-expert-odd-vocab", "bailing_moe_v3", {}),
        ("qwen3_moe-expert-odd-vocab-tied", "qwen3_moe", {"tied": True}),
    ]:
        edge0 = converted(family, vocab_size=ODD_VOCAB, **build).edge0
        runs.append({"name": name, "checkpoint": str(edge0), "options": {"parallel": "expert"}})
    # Stock mlx-lm's sharded_load (its tensor-parallel hook, ``shard``) through the checkpoint's shim.
    for family in ("qwen3_next", "bailing_moe"):
        runs.append({"name": f"{family}-sharded-load", "checkpoint": str(converted(family).edge0)})
        runs[-1]["loader"] = "mlx_lm.sharded_load"
    heads = root / "qwen3_moe-heads"
    runs.append({"name": "qwen3_moe-pipeline-heads", "checkpoint": str(heads), "options": {"parallel": "pipeline"}})
    # Two conversions of one source differ in their generation ids.
    other = root / "qwen3_moe-other"
    shutil.copytree(converted("qwen3_moe").edge0, other)
    config = json.loads((other / "config.json").read_text())
    config["edge0"]["generation"] = "another-conversion"
    (other / "config.json").write_text(json.dumps(config))
    runs.append({"name": "disagree", "checkpoint": [str(converted("qwen3_moe").edge0), str(other)]})
    for run in runs:
        run.setdefault("options", {})
        run.update(prompt=PROMPT, tokens=TOKENS)
    spec = root / "spec.json"
    spec.write_text(json.dumps(runs))
    out = root / "out"
    out.mkdir()
    done = launch([sys.executable, str(HERE / "parallel_worker.py"), str(spec), str(out)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {}
    for run in runs:
        per_rank = {}
        for rank in range(RANKS):
            stem = out / f"{run['name']}-rank{rank}"
            error = stem.with_suffix(".error")
            per_rank[rank] = error.read_text() if error.exists() else dict(np.load(stem.with_suffix(".npz")))
        results[run["name"]] = (run, per_rank)
    return results


def one_process(run: dict) -> dict:
    options = {k: v for k, v in run["options"].items() if k != "parallel"}
    return run_one({**run, "options": options}, None)


def assert_same_numbers(ranks: dict, alone: dict, *, tokens_vary: bool = True) -> None:
    for rank, got in ranks.items():
        assert not isinstance(got, str), f"rank {rank}: {got}"
        assert got["tokens"].tolist() == alone["tokens"].tolist(), f"rank {rank}"
        assert np.array_equal(got["prompt_logits"], alone["prompt_logits"]), f"rank {rank}"
        assert np.array_equal(got["logprobs"], alone["logprobs"]), f"rank {rank}"
    assert len(set(alone["tokens"].tolist())) > 1 or not tokens_vary  # not one token repeated


def experts_read(result: dict) -> set[tuple[int, int]]:
    return {(int(layer), int(e)) for layer, e in result["read"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_equals_one_process_and_each_rank_reads_its_own_experts(cases, family):
    run, ranks = cases[f"{family}-expert"]
    alone = one_process(run)
    assert_same_numbers(ranks, alone)
    for rank, got in ranks.items():
        read = experts_read(got)
        assert read and all(e % RANKS == rank for _, e in read), f"rank {rank} read another rank's expert"
        assert got["bytes_read"] < alone["bytes_read"]
    assert all(int(got["memory_sharers"]) == RANKS for got in ranks.values())  # one host: "auto" splits
    # between them the ranks read every expert one process reads
    assert experts_read(ranks[0]) | experts_read(ranks[1]) == experts_read(alone)


@pytest.mark.parametrize(
    "name", [f"{family}-expert" for family in FAMILIES] + ["qwen3_next-sharded-load", "bailing_moe-sharded-load"]
)
def test_expert_parallel_each_rank_holds_only_its_rows_of_the_vocabulary(cases, name):
    run, ranks = cases[name]
    whole = mlx_edge0.load_model(run["checkpoint"])
    vocab = int(vocab_rows(whole)[0])
    assert vocab_rows(whole).tolist() == [vocab]
    for rank, got in ranks.items():
        assert got["vocab_rows"].tolist() == [vocab // RANKS], f"rank {rank}"  # every tensor of embedding and head
        assert int(got["vocab_bytes"]) * RANKS == whole.stats()["resident_bytes"]["vocab"], f"rank {rank}"


@pytest.mark.parametrize("name", ["bailing_moe_v3-expert-odd-vocab", "qwen3_moe-expert-odd-vocab-tied"])
def test_expert_parallel_splits_an_odd_vocabulary_and_a_tied_head(cases, name):
    run, ranks = cases[name]
    alone = one_process(run)
    # a random tied head scores the input token highest: greedy repeats the prompt's last
    assert_same_numbers(ranks, alone, tokens_vary="tied" not in name)
    assert alone["prompt_logits"].shape[-1] == ODD_VOCAB
    assert [ranks[r]["vocab_rows"].tolist() for r in range(RANKS)] == [[255], [256]]
    assert sum(int(got["vocab_bytes"]) for got in ranks.values()) == int(alone["vocab_bytes"])


@pytest.mark.parametrize("family", ["qwen3_moe", "bailing_moe_v3"])
@pytest.mark.parametrize("tag", ["heads", "heads-window", "staged-whole-layer"])
def test_expert_parallel_prerouted_staged_and_whole_layer_paths(cases, family, tag):
    run, ranks = cases[f"{family}-expert-{tag}"]
    alone = one_process(run)
    assert_same_numbers(ranks, alone)
    for rank, got in ranks.items():
        assert all(e % RANKS == rank for _, e in experts_read(got))
        assert int(got["prerouted"]) == int(alone["prerouted"])  # every rank prerouts every consumer call
    if tag.startswith("heads"):
        assert int(alone["prerouted"]) > 0


@pytest.mark.parametrize("family", ["qwen3_next", "bailing_moe"])
def test_mlx_lm_sharded_load_runs_an_edge0_checkpoint_expert_parallel(cases, family):
    run, ranks = cases[f"{family}-sharded-load"]
    alone = one_process({**run, "loader": None})
    assert_same_numbers(ranks, alone)
    for rank, got in ranks.items():
        assert all(e % RANKS == rank for _, e in experts_read(got))


@pytest.mark.parametrize("family", PIPELINED)
def test_pipeline_equals_one_process_and_each_rank_opens_its_layers(cases, family):
    run, ranks = cases[f"{family}-pipeline"]
    alone = one_process(run)
    assert_same_numbers(ranks, alone)
    opened = [set(ranks[r]["open_layers"].tolist()) for r in range(RANKS)]
    assert opened[0] and opened[1] and not opened[0] & opened[1]
    assert opened[0] | opened[1] == set(alone["open_layers"].tolist())
    for rank in range(RANKS):
        assert {layer for layer, _ in experts_read(ranks[rank])} <= opened[rank]
        assert ranks[rank]["bytes_read"] < alone["bytes_read"]
    assert min(opened[0]) > max(opened[1])  # mlx-lm's split: rank 0 holds the last layers


def test_pipeline_with_heads_drops_the_head_whose_consumer_is_on_the_other_rank(cases):
    run, ranks = cases["qwen3_moe-pipeline-heads"]
    # tiny models: MoE layers 1, 2, 3; heads 1 -> 2 and 2 -> 3; rank 1 holds
    # layers 0-1, rank 0 layers 2-3: only 2 -> 3 stays, on rank 0
    alone = one_process(run)  # prerouts layers 2 and 3 on every one-token forward
    assert int(ranks[1]["prerouted"]) == 0
    assert 2 * int(ranks[0]["prerouted"]) == int(alone["prerouted"]) > 0
    assert ranks[0]["tokens"].tolist() == ranks[1]["tokens"].tolist()


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(PIPELINED)))
def test_pipeline_of_a_family_mlx_lm_cannot_pipeline_is_a_clear_error(cases, family):
    _, ranks = cases[f"{family}-pipeline"]
    for rank, got in ranks.items():
        assert isinstance(got, str), f"rank {rank} loaded"
        assert "no pipeline parallel" in got and "parallel='expert'" in got


def test_ranks_with_different_checkpoints_refuse_naming_the_rank(cases):
    _, ranks = cases["disagree"]
    for rank, got in ranks.items():
        assert isinstance(got, str), f"rank {rank} loaded"
        assert "rank(s) 1 differs from rank 0" in got


def test_generate_under_mlx_launch_prints_once_what_one_process_prints(converted):
    path = converted("qwen3_moe").edge0
    args = ["--model", str(path), "--prompt", "def f(x):", "-m", "12", "--temp", "0", "--repetition-penalty", "1"]
    alone = CliRunner().invoke(main, ["generate", *args])
    assert alone.exit_code == 0, alone.output
    edge0 = Path(sys.executable).parent / "edge0"
    done = launch([str(edge0), "generate", *args, "--parallel", "expert", "--stats"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == alone.stdout
    assert "rank 0 of 2:" in done.stderr and "rank 1 of 2:" in done.stderr


def test_expert_shard_pairs_and_ownership():
    group = SimpleNamespace(rank=lambda: 1, size=lambda: 3)
    shard = ExpertShard(group, 8)
    assert shard.owned.tolist() == [1, 4, 7]
    assert shard.local(np.array([0, 1, 2, 4, 5, 7])).tolist() == [1, 4, 7]
    inds = mx.array([[[1, 2], [4, 0]], [[3, 7], [5, 6]]], mx.uint32)  # [B=2, L=2, K=2]
    pairs = shard.pairs(inds)
    assert pairs.positions.tolist() == [0, 2, 5]
    assert pairs.tokens.tolist() == [0, 1, 2]
    assert pairs.experts.tolist() == [1, 4, 7]
    x_pairs, experts = shard.inputs(mx.arange(4 * 3).reshape(2, 2, 3), pairs)
    assert x_pairs.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert experts.tolist() == [[1], [4], [7]]


def test_vocab_shard_splits_near_equal_and_keeps_a_copy_of_its_rows_only():
    shard = VocabShard(SimpleNamespace(rank=lambda: 2, size=lambda: 3), 10)
    assert shard.bounds == [0, 3, 6, 10] and (shard.start, shard.end, shard.width) == (6, 10, 4)
    # the gathered [3 ranks x 4] logits, ranks 0 and 1 padded by one column each
    assert shard.columns.tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
    assert VocabShard(SimpleNamespace(rank=lambda: 0, size=lambda: 2), 512).columns is None
    embedding = nn.Embedding(1000, 1024)  # 4 MB
    mx.eval(embedding.parameters())
    want = np.array(embedding.weight[250:500])
    gc.collect()
    before = mx.get_active_memory()
    VocabShard(SimpleNamespace(rank=lambda: 1, size=lambda: 4), 1000).keep_rows(embedding)
    mx.eval(embedding.parameters())
    assert embedding.weight.shape == (250, 1024) and np.array_equal(np.array(embedding.weight), want)
    # the whole table is freed (a slice view would have kept all of it): 750 of its 1000 rows
    assert mx.get_active_memory() - before < -700 * 1024 * 4


def test_a_store_refuses_to_read_another_ranks_expert(converted):
    from mlx_edge0.checkpoint import Edge0Section, read_config
    from mlx_edge0.slots import SlotBuffers
    from mlx_edge0.store import ExpertStore

    path = converted("qwen3_moe").edge0
    section = Edge0Section.from_config(read_config(path))
    store = ExpertStore(path, section, experts=[0, 2, 4])
    try:
        target = SlotBuffers(section.experts, 2)
        store.submit(section.moe_layers[0], [0, 2], [0, 1], target).wait()
        with pytest.raises(ValueError, match=r"experts \[3\] are not this store's"):
            store.submit(section.moe_layers[0], [2, 3], [0, 1], target)
    finally:
        store.close()


def test_pipeline_stage_is_found_where_mlx_lm_puts_it(converted):
    import mlx_edge0

    for family in FAMILIES:
        model = mlx_edge0.load_model(converted(family).edge0)
        assert (pipeline_stage(model) is not None) == (family in PIPELINED), family


def test_mlx_lm_server_under_mlx_launch_serves_an_edge0_checkpoint(converted, tmp_path):
    """The serving recipe of the README: stock mlx_lm.server, rank 0 answers
    over HTTP, rank 1 follows its batches; the real OpenAI client gets what
    one process generates."""
    import os
    import signal

    import openai
    from mlx_lm.generate import generate

    import mlx_edge0
    from test_server import checkpoint_with_heads_and_adapters, wait_healthy

    ckpt = checkpoint_with_heads_and_adapters(converted("bailing_moe").edge0, tmp_path / "ckpt")
    model, tokenizer = mlx_edge0.load(ckpt)
    prompt = "def fibonacci(n):"
    want = generate(model, tokenizer, prompt, max_tokens=10)
    port = free_port_pair()
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(RANKS)]
    command += ["--starting-port", str(free_port_pair()), "--", sys.executable, "-m", "mlx_lm.server"]
    command += ["--model", str(ckpt), "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        got = client.completions.create(model="default_model", prompt=prompt, max_tokens=10, temperature=0)
        assert got.choices[0].text == want
        assert len(set(tokenizer.encode(want))) > 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_edge0_serve_under_mlx_launch_says_what_serves_a_group(converted):
    edge0 = Path(sys.executable).parent / "edge0"
    port = free_port_pair()
    done = launch([str(edge0), "serve", "--model", str(converted("qwen3_moe").edge0), "--port", str(port)], timeout=120)
    # mlx.launch itself exits 0 and warns when a rank fails (and stops the others)
    assert "exited with code 2" in done.stderr
    assert "under mlx.launch serve with mlx_lm.server" in done.stderr

"""Faults while generating: an expert file truncated, deleted or failing
mid-generation raises a clear error in the caller, never a hang; once the file
is restored (in place, or a new file renamed over it) the same model generates
exactly what it generated before the fault: no slot, hot-cache, read-ahead or
prerouter state of the failed step survives into the next one."""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0 import reads as reads_module
from mlx_edge0.checkpoint import expert_file
from mlx_edge0.cli import main
from mlx_edge0.store import ExpertReadError
from mlx_edge0.tensorfile import read_header


PROMPT = [5, 17, 99, 3, 250, 7, 7, 31, 64, 12, 200, 9]
N = 12
FAULTY = (2, 3)  # the two consumer layers of the heads: both fail in one step
BUNDLE_GIB = 13824 / 2**30
PATHS = {
    "exact": dict(cache_gib=0, prefill="exact", prerouter=False),
    "hot": dict(cache_gib=12 * BUNDLE_GIB, prefill="exact", prerouter=False),
    "staged+hot": dict(cache_gib=8 * BUNDLE_GIB, staged=True, prefill="exact", prerouter=False),
    "whole-layer": dict(cache_gib=0, prefill="whole-layer", prerouter=False),
    "prerouted": dict(cache_gib=0),
    "prerouted, staged window": dict(cache_gib=0, staged_window=3),
}


@pytest.fixture(scope="module")
def ckpt(converted, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "ckpt"
    shutil.copytree(converted("qwen3_next").edge0, path)
    result = CliRunner().invoke(main, ["heads", "init", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture
def backup(ckpt, tmp_path):
    """Originals of the faulty layers, put back after the test whatever happens."""
    saved = {}
    for layer in FAULTY:
        saved[layer] = tmp_path / f"layer_{layer}"
        shutil.copyfile(ckpt / expert_file(layer), saved[layer])
    yield saved
    for layer, copy in saved.items():
        shutil.copyfile(copy, ckpt / expert_file(layer))


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], mx.array]:
    """Greedy tokens and their log-probabilities (compared exactly: a stale
    slot can leave the argmax alone and still change the numbers)."""
    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model)):
        tokens.append(int(tok))
        logprobs.append(lp)
    return tokens, mx.stack(logprobs)


def _same(a, b) -> bool:
    return a[0] == b[0] and mx.array_equal(a[1], b[1]).item()


def _truncate_data(ckpt: Path) -> None:
    """Keep only each faulty file's header: every expert read fails."""
    for layer in FAULTY:
        f = ckpt / expert_file(layer)
        os.truncate(f, read_header(f).data_start)


def _replace(ckpt: Path, backup: dict) -> None:
    """Restore by renaming a fresh copy over the file (a new inode)."""
    for layer, copy in backup.items():
        fresh = ckpt / f"{expert_file(layer)}.new"
        shutil.copyfile(copy, fresh)
        os.replace(fresh, ckpt / expert_file(layer))


def _fail_mid_generation(model, after: int) -> ExpertReadError:
    """Generate ``after`` tokens, break the files, and return the error the
    next steps raise (within seconds)."""
    steps = generate_step(mx.array(PROMPT), model, max_tokens=N, prompt_cache=make_prompt_cache(model))
    for _ in range(after):
        next(steps)
    _truncate_data(model.edge0_runtime.store.checkpoint_dir)
    t0 = time.monotonic()
    with pytest.raises(ExpertReadError) as info:
        for _ in steps:
            pass
    assert time.monotonic() - t0 < 10
    return info.value


@pytest.mark.parametrize("after", [0, 3], ids=["in-prefill", "in-decode"])
@pytest.mark.parametrize("name", list(PATHS))
def test_restored_file_gives_the_tokens_of_before(ckpt, backup, name, after):
    model = mlx_edge0.load_model(ckpt, **PATHS[name])
    want = greedy(model, PROMPT, N)
    error = _fail_mid_generation(model, after=after)
    assert "layer_00" in str(error) and "short read" in str(error)
    assert model.stats()["read_errors"] >= 1
    _replace(ckpt, backup)
    assert _same(greedy(model, PROMPT, N), want)


def test_reopen_of_a_missing_file_fails_clearly_then_recovers(ckpt, backup):
    model = mlx_edge0.load_model(ckpt, **PATHS["exact"])
    want = greedy(model, PROMPT, N)
    _fail_mid_generation(model, after=1)
    (ckpt / expert_file(FAULTY[0])).unlink()
    with pytest.raises(ExpertReadError, match=r"layer_002\.safetensors: file not found"):
        greedy(model, PROMPT, N)
    _replace(ckpt, backup)
    assert _same(greedy(model, PROMPT, N), want)


def test_worker_exception_is_raised_in_the_caller_never_hangs(ckpt, monkeypatch):
    """A bug (not an OSError) in an I/O thread reaches the caller too."""
    model = mlx_edge0.load_model(ckpt, **PATHS["prerouted"])
    want = greedy(model, PROMPT, N)

    def broken(*args, **kwargs):
        raise RuntimeError("widening failed")

    monkeypatch.setattr(reads_module, "_convert", broken)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="widening failed"):
        greedy(model, PROMPT, N)
    assert time.monotonic() - t0 < 10
    monkeypatch.undo()
    assert _same(greedy(model, PROMPT, N), want)


# ------------------------------------------------------------- while serving


def _ask(client, stream: bool, seed=None) -> tuple[str, str | None]:
    """(text, finish_reason) of a greedy completion; a cut-off stream has no
    finish_reason."""
    r = client.completions.create(
        model="default_model", prompt="def main():", max_tokens=24, temperature=0.0, stream=stream, seed=seed
    )
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in r:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _eventually(check, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_served_fault_fails_the_request_and_serving_resumes(ckpt, backup, tmp_path):
    """Sequential requests (``seed`` set: mlx_lm.server serves them alone)
    fail alone and the same server process reads the restored file; a fault
    in a batched request ends mlx_lm.server's generation loop, and edge0
    serve restarts the server."""
    import openai

    from test_server import EDGE0, free_port, running

    port, log = free_port(), tmp_path / "serve.log"
    argv = [*EDGE0, "serve", "--model", str(ckpt), "--port", str(port), "--cache-gib", "0", "--prefill-step-size", "16"]
    with running(argv, port, log) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="edge0", max_retries=0, timeout=30)
        want = _ask(client, stream=False)
        assert want[1] == "length"

        _truncate_data(ckpt)  # alone: the stream is cut off, the process keeps serving
        t0 = time.monotonic()
        text, finish = _ask(client, stream=True, seed=0)
        assert finish is None and len(text) < len(want[0]) and time.monotonic() - t0 < 20
        _replace(ckpt, backup)
        assert _ask(client, stream=False, seed=0) == want
        assert "restarting" not in log.read_text()

        for restarts in (1, 2):  # batched: the generation loop dies, edge0 serve restarts it
            _truncate_data(ckpt)
            t0 = time.monotonic()
            with pytest.raises(openai.APIConnectionError):
                _ask(client, stream=False)
            assert time.monotonic() - t0 < 20
            _replace(ckpt, backup)

            def restarted():
                assert log.read_text().count("generation loop died") == restarts

            _eventually(restarted, 30)
            assert _eventually(lambda: _ask(client, stream=False)) == want
        # the delay does not grow with repeated deaths: a client cannot lengthen the outage
        assert log.read_text().count("restarting it in 1 s") == 2
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda s: _ask(client, s), [False, True, False, True])) == [want] * 4
    errors = [line for line in log.read_text().splitlines() if line.startswith("mlx_edge0.reads.ExpertReadError")]
    assert len(errors) >= 2 and all("safetensors: short read" in line for line in errors)

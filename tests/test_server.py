"""Stock ``mlx_lm.server --trust-remote-code`` serves an edge0 checkpoint, and
concurrent (batched) requests return exactly what each returns alone;
``edge0 serve`` is that server pinned to the checkpoint, with the edge0
options, on loopback.

The helpers here (a free port, a server process with its log in a file, a
checkpoint with prerouter heads and LoRA adapters) are shared by the other
serving tests."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import pytest
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0 import lora
from mlx_edge0.checkpoint import SHIM_FILE
from mlx_edge0.cli import main

from test_equivalence import greedy

PROMPTS = ["def main():", "import os\nimport sys\n", "class Parser:\n    def", "for i in range("]
MAX_TOKENS = 24
EDGE0 = [sys.executable, "-c", "from mlx_edge0.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> int | None:
    """HTTP status of ``GET url`` (None: not answering)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while status(f"{url}/health") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy: {log.read_text()[-3000:]}")
        time.sleep(0.2)


@contextmanager
def running(argv: list[str], port: int, log: Path, **popen) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server process (stderr to ``log``, never a pipe that could fill up)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=err, stderr=subprocess.STDOUT, **popen)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def checkpoint_with_heads_and_adapters(source: Path, out: Path) -> Path:
    """A checkpoint copy with warm-started prerouter heads and LoRA adapters
    whose B is non-zero (as after training), so both are on when served."""
    shutil.copytree(source, out)
    result = CliRunner().invoke(main, ["heads", "init", str(out)])
    assert result.exit_code == 0, result.output
    model = mlx_edge0.load_model(out, cache_gib=0)
    mx.random.seed(3)
    lora.attach(model, tuple(lora.lora_targets(model)))
    for m in lora.lora_modules(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    mx.eval(model.parameters())
    lora.save_adapters(out, model, out, lora.consumer_k(model))
    return out


@pytest.fixture(scope="module")
def served(converted, tmp_path_factory):
    return checkpoint_with_heads_and_adapters(converted("qwen3_next").edge0, tmp_path_factory.mktemp("server") / "ckpt")


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    """Stock mlx_lm.server on the checkpoint (prediction state per sequence
    and the adapters are what batching must keep apart and apply)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        str(served),
        "--trust-remote-code",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with running(argv, port, tmp_path_factory.mktemp("server-log") / "server.log") as (url, _):
        yield served, url


def _complete(url: str, prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_completion_matches_in_process_greedy(server):
    edge0, url = server
    model, tokenizer = mlx_edge0.load(edge0)
    assert model.edge0_adapters is not None and model.edge0_runtime.prerouting is not None
    tokens = greedy(model, tokenizer.encode(PROMPTS[0]), MAX_TOKENS)
    stop = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
    want = tokenizer.decode(tokens[: stop[0]] if stop else tokens)
    assert _complete(url, PROMPTS[0]) == want


def test_concurrent_requests_equal_sequential(server):
    _, url = server
    alone = [_complete(url, p) for p in PROMPTS]
    assert len(set(alone)) == len(PROMPTS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    assert together == alone


# ------------------------------------------------------------------ edge0 serve


def test_serve_refuses_bad_options_and_foreign_model_code(served, tmp_path):
    result = CliRunner().invoke(main, ["serve", "--model", str(served), "--io-threads", "0"])
    assert result.exit_code == 1 and "io_threads must be an integer in 1..64" in result.output
    foreign = tmp_path / "foreign"
    shutil.copytree(served, foreign)
    (foreign / SHIM_FILE).write_text("import os\n" + (foreign / SHIM_FILE).read_text())
    result = CliRunner().invoke(main, ["serve", "--model", str(foreign)])
    assert result.exit_code == 1
    assert f"{foreign / SHIM_FILE}: not the mlx-edge0 shim" in result.output
    # our shim, but a tokenizer whose custom class transformers would import
    shutil.copyfile(served / SHIM_FILE, foreign / SHIM_FILE)
    (foreign / "tokenization_x.py").write_text("import os\n")
    config = json.loads((foreign / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (foreign / "tokenizer_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["info", str(foreign)])
    assert result.exit_code == 0 and "is the mlx-edge0 shim" in result.output
    assert f"WARNING         {foreign}: holds other Python code ['tokenization_x.py']" in result.output
    assert "auto_map in ['tokenizer_config.json']" in result.output
    result = CliRunner().invoke(main, ["serve", "--model", str(foreign)])
    assert result.exit_code == 1 and "holds other Python code ['tokenization_x.py']" in result.output


def test_serve_binds_loopback_and_stops_cleanly_on_sigterm(served, tmp_path):
    port = free_port()
    argv = [*EDGE0, "serve", "--model", str(served), "--port", str(port), "--cache-gib", "0"]
    with running(argv, port, tmp_path / "serve.log") as (url, proc):
        with socket.socket() as s:  # bound to 127.0.0.1 itself, not all addresses
            assert s.connect_ex(("127.0.0.2", port)) != 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert status(f"{url}/health") is None

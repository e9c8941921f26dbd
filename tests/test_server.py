"""Stock ``mlx_lm.server --trust-remote-code`` serves an edge0 checkpoint, and
concurrent (batched) requests return exactly what each returns alone."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from click.testing import CliRunner

import mlx_edge0
from mlx_edge0.cli import main

from test_equivalence import greedy

PROMPTS = ["def main():", "import os\nimport sys\n", "class Parser:\n    def", "for i in range("]
MAX_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    """The server on a checkpoint with prerouter heads (prediction state per
    sequence is what batching must keep apart)."""
    edge0 = tmp_path_factory.mktemp("server") / "ckpt"
    shutil.copytree(converted("qwen3_next").edge0, edge0)
    result = CliRunner().invoke(main, ["heads", "init", str(edge0)])
    assert result.exit_code == 0, result.output
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm", "server", "--model", str(edge0),
         "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not start: {proc.stderr.read()[-2000:]}")
            time.sleep(0.2)
    yield edge0, url
    proc.terminate()
    proc.wait(timeout=30)


def _complete(url: str, prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_completion_matches_in_process_greedy(server):
    edge0, url = server
    model, tokenizer = mlx_edge0.load(edge0)
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

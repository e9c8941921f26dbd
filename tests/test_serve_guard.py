"""``edge0 serve`` against hostile or careless clients and flags, through the
real server (the ``openai`` client and raw HTTP): a request cannot change
the model, inputs that end mlx-lm's generation loop are refused and the loop
lives on, a client that goes away stops its work, prompts past the context
are refused unless the operator opted in, ``/v1/models`` answers without a
hub cache, flags that argparse would expand into ``--model`` are refused,
and a port in use is an error, not a wait."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import openai
import pytest

from mlx_edge0.checkpoint import SHIM_FILE
from mlx_edge0.options import Options
from mlx_edge0.pinned_server import PinnedModelProvider, client_gone
from mlx_edge0.request_checks import RequestPolicy, RequestRefused, check_request

from test_server import EDGE0, checkpoint_with_heads_and_adapters, free_port, running

EOS_BLOCKED = {"0": -100, "1": -100, "2": -100}  # the tiny tokenizer's special tokens


@pytest.fixture(scope="module")
def ckpt(converted, tmp_path_factory) -> Path:
    return checkpoint_with_heads_and_adapters(converted("qwen3_moe").edge0, tmp_path_factory.mktemp("guard") / "ckpt")


def serve(ckpt: Path, port: int, log: Path, *flags: str, home: Path | None = None):
    env = {**os.environ}
    if home is not None:  # no hub cache anywhere
        env.update(HOME=str(home), HF_HOME=str(home / "hf"))
    return running(
        [*EDGE0, "serve", "--model", str(ckpt), "--port", str(port), "--cache-gib", "0", *flags], port, log, env=env
    )


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("guard-server")
    (root / "home").mkdir()
    port = free_port()
    with serve(ckpt, port, root / "serve.log", home=root / "home") as (url, proc):
        yield url, proc, root / "serve.log"


def post(url: str, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        return r.status


def child_of(proc: subprocess.Popen) -> int:
    """The pid of ``edge0 serve``'s server process."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_request_cannot_change_the_model(server, ckpt, tmp_path):
    """``model``, ``adapters`` and ``draft_model`` naming anything else are
    refused; a hostile checkpoint named in ``model`` is never imported."""
    url, proc, _ = server
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile"
    shutil.copytree(ckpt, hostile)
    (hostile / SHIM_FILE).write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="edge0", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=str(hostile), prompt="def f(", max_tokens=2)
    assert f"model '{hostile}' is not served here" in str(refused.value.body)
    for field, value in (("adapters", str(hostile)), ("draft_model", str(hostile))):
        code, body = post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 2, field: value})
        assert code == 400 and body["error"].startswith(field), body
    assert not marker.exists()
    served = client.models.list().data
    assert [m.id for m in served] == [str(ckpt.resolve())]
    for name in ("default_model", str(ckpt.resolve()), ckpt.name):
        r = client.completions.create(model=name, prompt="def f(", max_tokens=2)
        assert r.model == str(ckpt.resolve()) and r.usage.completion_tokens == 2


KILLERS = {
    "empty prompt": ("/v1/completions", {"prompt": ""}, "prompt is empty"),
    "stop entry not a string": ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop must be"),
    "stop entry null": ("/v1/completions", {"prompt": "x", "stop": [None]}, "stop must be"),
    "logit_bias past the vocabulary": (
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"99999999": 1}},
        "outside the vocabulary",
    ),
    "negative logit_bias id": ("/v1/completions", {"prompt": "x", "logit_bias": {"-5": 1}}, "outside the vocabulary"),
    "top_k above the vocabulary": ("/v1/completions", {"prompt": "x", "top_k": 10**9}, "top_k must be at most"),
    "no messages": ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty list"),
    "prompt not a string": ("/v1/completions", {"prompt": [1, 2]}, "prompt must be a string"),
}


def test_inputs_that_end_the_generation_loop_are_refused(server):
    """Each of these ended mlx-lm 0.32's generation loop (or, for the
    logit_bias id, the whole process) when sent to the stock server."""
    url, proc, log = server
    pid = child_of(proc)
    for name, (path, body, message) in KILLERS.items():
        code, answer = post(url, path, {**body, "max_tokens": 2})
        assert code == 400 and message in answer["error"], (name, answer)
        assert health(url) == 200, name
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="edge0", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="default_model", prompt="", max_tokens=2)
    assert "prompt is empty" in str(refused.value.body)
    assert client.completions.create(model="default_model", prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert child_of(proc) == pid and "restarting" not in log.read_text()


def test_prompts_past_the_context_are_refused(server):
    url, _, _ = server
    code, body = post(url, "/v1/completions", {"prompt": "x = 1\n" * 2000, "max_tokens": 2})
    assert code == 400 and "longer than this server's limit of 4096" in body["error"], body


def test_models_endpoint_answers_without_a_hub_cache(server, ckpt):
    url, _, _ = server
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        assert r.status == 200
        assert json.loads(r.read())["data"][0]["id"] == str(ckpt.resolve())


def abandon(url: str, body: dict, after_s: float) -> None:
    """Send a non-streamed request on a raw socket and close it after ``after_s``."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data) + data
        )
        time.sleep(after_s)


def wait_for(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def assert_idle(pid: int, seconds: float = 2.0) -> None:
    """The server process used (almost) no CPU for ``seconds``."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    assert cpu_seconds(pid) - before < 0.25 * seconds


def test_a_client_that_goes_away_stops_its_generation(server):
    url, proc, log = server
    pid = child_of(proc)
    stopped = log.read_text().count("the client closed the connection")
    abandon(url, {"prompt": "def f(", "max_tokens": 100000, "logit_bias": EOS_BLOCKED}, after_s=2)
    wait_for(lambda: log.read_text().count("the client closed the connection") > stopped, 30)
    assert_idle(pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_opted_in_long_prompt_is_served_and_abandoned_prefill_stops(ckpt, tmp_path):
    port = free_port()
    with serve(ckpt, port, tmp_path / "serve.log", "--max-prompt-tokens", "0", "--prefill-step-size", "32") as (
        url,
        proc,
    ):
        code, body = post(url, "/v1/completions", {"prompt": "x = 1\n" * 1200, "max_tokens": 2}, timeout=300)
        assert code == 200 and body["usage"]["prompt_tokens"] > 4096
        pid = child_of(proc)
        abandon(url, {"prompt": "y = 2\n" * 40000, "max_tokens": 2}, after_s=3)
        log = tmp_path / "serve.log"
        wait_for(lambda: "the client closed the connection" in log.read_text(), 60)
        assert_idle(pid)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mod", "/etc"], "--model /etc: edge0 serve serves only the checkpoint it checked"),
        (["--adapter-path", "/etc"], "--adapter-path /etc: edge0 serve runs the checkpoint's own"),
        (["--draft-mod", "/etc"], "--draft-model /etc: edge0 serve runs the checkpoint's own"),
        (["--trust-remote-code"], "--trust-remote-code: edge0 serve imports nothing"),
        (["--hos", "0.0.0.0"], "--host/--port: give them to edge0 serve itself"),
    ],
)
def test_server_flags_that_would_change_the_model_are_refused(ckpt, flags, message):
    result = subprocess.run(
        [*EDGE0, "serve", "--model", str(ckpt), "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_port_in_use_is_an_error_not_a_wait(ckpt):
    other = HTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        port = other.server_address[1]
        t0 = time.monotonic()
        result = subprocess.run(
            [*EDGE0, "serve", "--model", str(ckpt), "--port", str(port)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1 and time.monotonic() - t0 < 30
        assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        other.shutdown()


def test_pinned_provider_loads_with_the_options_and_nothing_else(ckpt):
    options = Options(cache_gib=0, staged=True, prefill="exact", io_threads=2)
    provider = PinnedModelProvider(argparse.Namespace(**_stock_defaults()), ckpt.resolve(), options)
    model, _ = provider.load("default_model", None, "default_model")
    assert model.edge0_runtime.options == options and model.edge0_adapters is not None
    for call in (("/etc",), ("default_model", "/etc"), ("default_model", None, "/etc")):
        with pytest.raises(RequestRefused):
            provider.load(*call)


def _stock_defaults() -> dict:
    return dict(
        model=None,
        adapter_path=None,
        draft_model=None,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        pipeline=False,
    )


def test_check_request_is_pure():
    policy = RequestPolicy("/m", frozenset({"m"}), vocab_size=10, max_prompt_tokens=5)
    count = lambda path, body: len(body.get("prompt", ""))  # noqa: E731
    check_request("/v1/completions", {"model": "m", "prompt": "abc"}, policy, count)
    with pytest.raises(RequestRefused, match="longer than this server's limit of 5"):
        check_request("/v1/completions", {"prompt": "abcdef"}, policy, count)
    with pytest.raises(RequestRefused, match="token id 10 is outside"):
        check_request("/v1/completions", {"prompt": "a", "logit_bias": {"10": 1}}, policy, count)


def test_client_gone_sees_a_closed_peer():
    a, b = socket.socketpair()
    assert not client_gone(a)
    b.sendall(b"more")  # a pipelined byte is not a close
    assert not client_gone(a)
    b.close()
    a.recv(4)
    assert client_gone(a)
    a.close()

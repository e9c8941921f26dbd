"""The real ``openai`` client against ``edge0 serve`` (the stock mlx_lm.server)
on loopback, prerouter heads and LoRA adapters on: chat and completions,
streamed and not, stop sequences, max_tokens, a prompt of many prefill
chunks; concurrent requests equal each alone; a stream closed early leaves
the next request correct. Every answer is checked against in-process greedy
decoding with the same options (including the server's prefill chunking)."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0

from test_server import checkpoint_with_heads_and_adapters, free_port, running

OPTIONS = dict(staged=True, cache_gib=0.0005)
PREFILL_STEP = 16
FLAGS = ["--staged", "--cache-gib", "0.0005", "--prefill-step-size", str(PREFILL_STEP)]
MAX_TOKENS = 20
LONG_PROMPT = "import os\n" + "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(12))
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "sort a list"}]


@dataclass(frozen=True)
class Request:
    kind: str  # "completion" | "chat"
    prompt: object  # str | list of messages
    stream: bool = False
    max_tokens: int = MAX_TOKENS
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    completion_tokens: int | None  # None when streamed


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    ckpt = checkpoint_with_heads_and_adapters(converted("qwen3_next").edge0, root / "ckpt")
    port = free_port()
    argv = [
        sys.executable,
        "-c",
        "from mlx_edge0.cli import main; main()",
        "serve",
        "--model",
        str(ckpt),
        "--port",
        str(port),
        *FLAGS,
    ]
    with running(argv, port, root / "serve.log") as (url, _):
        yield ckpt, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="edge0", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(server):
    model, tokenizer = mlx_edge0.load(server[0], **OPTIONS)
    assert model.edge0_adapters is not None and model.edge0_runtime.prerouting is not None
    return model, tokenizer


def prompt_ids(tokenizer, req: Request) -> list[int]:
    if req.kind == "chat":
        return tokenizer.apply_chat_template(list(req.prompt), add_generation_prompt=True, tokenize=True)
    return tokenizer.encode(req.prompt)


def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    steps = generate_step(
        mx.array(ids), model, max_tokens=n, prompt_cache=make_prompt_cache(model), prefill_step_size=PREFILL_STEP
    )
    return [int(t) for t, _ in steps]


def text_of(tokenizer, tokens: list[int]) -> str:
    """Tokens as mlx-lm's streaming detokenizer writes them (as the server
    does; it drops the answer's leading space)."""
    detokenizer = tokenizer.detokenizer
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def expected(local, req: Request) -> Answer:
    """What the server must answer: greedy tokens up to EOS, max_tokens or a
    stop sequence (which is not returned)."""
    model, tokenizer = local
    tokens = greedy_tokens(model, prompt_ids(tokenizer, req), req.max_tokens)
    for i, t in enumerate(tokens):
        if t in tokenizer.eos_token_ids:
            return Answer(text_of(tokenizer, tokens[:i]), "stop", i + 1)
        for word in req.stop:
            w = tokenizer.encode(word, add_special_tokens=False)
            if tokens[max(0, i + 1 - len(w)) : i + 1] == w:
                return Answer(text_of(tokenizer, tokens[: i + 1 - len(w)]), "stop", i + 1)
    return Answer(text_of(tokenizer, tokens), "length", len(tokens))


def ask(client, req: Request, stop_after_chunks: int | None = None) -> Answer:
    common = dict(
        model="default_model",
        max_tokens=req.max_tokens,
        temperature=0.0,
        stream=req.stream,
        stop=list(req.stop) or None,
    )
    if req.kind == "chat":
        r = client.chat.completions.create(messages=list(req.prompt), **common)
    else:
        r = client.completions.create(prompt=req.prompt, **common)
    if not req.stream:
        choice = r.choices[0]
        text = choice.message.content if req.kind == "chat" else choice.text
        return Answer(text, choice.finish_reason, r.usage.completion_tokens)
    parts, finish = [], None
    for i, chunk in enumerate(r):
        if stop_after_chunks is not None and i == stop_after_chunks:
            r.close()  # the client goes away mid-stream
            break
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        parts.append((choice.delta.content if req.kind == "chat" else choice.text) or "")
        finish = choice.finish_reason or finish
    return Answer("".join(parts), finish, None)


def _matches(got: Answer, want: Answer) -> bool:
    counted = got.completion_tokens is None or got.completion_tokens == want.completion_tokens
    return got.text == want.text and got.finish_reason == want.finish_reason and counted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_chat_and_completion(client, local, kind, stream):
    req = Request(kind, CHAT if kind == "chat" else "def main():", stream)
    got, want = ask(client, req), expected(local, req)
    assert want.text and _matches(got, want)


def test_max_tokens(client, local):
    req = Request("completion", "class Parser:\n    def", max_tokens=5)
    got = ask(client, req)
    assert got.completion_tokens == 5 and got.finish_reason == "length"
    assert _matches(got, expected(local, req))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_sequence(client, local, stream):
    model, tokenizer = local
    plain = Request("completion", "def main():", max_tokens=30)
    tokens = greedy_tokens(model, prompt_ids(tokenizer, plain), plain.max_tokens)
    # a two-token word the tokenizer spells back the same way, first seen mid-answer
    word = next(
        w
        for k in range(3, 25)
        if tokenizer.encode(w := tokenizer.decode(tokens[k : k + 2]), add_special_tokens=False) == tokens[k : k + 2]
        and w not in tokenizer.decode(tokens[: k + 1])
    )
    req = Request("completion", "def main():", stream, max_tokens=30, stop=(word,))
    got, want = ask(client, req), expected(local, req)
    assert want.finish_reason == "stop" and len(want.text) < len(expected(local, plain).text)
    assert _matches(got, want)


def test_long_prompt_spans_many_prefill_chunks(client, local):
    req = Request("completion", LONG_PROMPT)
    assert len(prompt_ids(local[1], req)) > 8 * PREFILL_STEP
    r = client.completions.create(model="default_model", prompt=req.prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert r.usage.prompt_tokens == len(prompt_ids(local[1], req))
    assert _matches(
        Answer(r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens), expected(local, req)
    )


MIXED = [
    Request("completion", "def main():"),
    Request("completion", "import os\nimport sys\n", stream=True),
    Request("chat", CHAT),
    Request("chat", [{"role": "user", "content": "what is a tuple"}], stream=True),
    Request("completion", LONG_PROMPT, max_tokens=12),
    Request("completion", "for i in range(", stream=True, max_tokens=28),
]


def test_concurrent_requests_equal_each_alone(client):
    alone = [ask(client, r) for r in MIXED]
    assert len({a.text for a in alone}) == len(MIXED)
    with ThreadPoolExecutor(len(MIXED)) as pool:
        together = list(pool.map(lambda r: ask(client, r), MIXED))
    assert together == alone


def test_stream_closed_early_leaves_the_next_request_correct(client, local):
    cancelled = Request("chat", CHAT, stream=True, max_tokens=64)
    neighbour = Request("completion", "for i in range(", stream=True, max_tokens=40)
    got_neighbour = {}
    t = threading.Thread(target=lambda: got_neighbour.update(answer=ask(client, neighbour)))
    t.start()
    partial = ask(client, cancelled, stop_after_chunks=3)
    t.join(timeout=60)
    assert partial.finish_reason is None and len(partial.text) < len(expected(local, cancelled).text)
    assert _matches(got_neighbour["answer"], expected(local, neighbour))
    for req in (cancelled, Request("completion", "def main():")):
        assert _matches(ask(client, req), expected(local, req))

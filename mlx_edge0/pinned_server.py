"""The stock mlx_lm.server, pinned to one checked edge0 checkpoint.

``edge0 serve`` runs this module as its child process. What serves requests
is mlx-lm's own: its argument parser and flags, ``ResponseGenerator``
(batching, prompt cache) and ``APIHandler`` (endpoints, streaming, every
OpenAI client). What is ours:

- :class:`PinnedModelProvider` loads the checkpoint with ``mlx_edge0.load``
  (the trust check; nothing of the checkpoint is imported) and refuses any
  other model, adapter or draft model, whatever a request or a flag names;
- :class:`Edge0Handler` refuses, with a 400, requests that would change the
  model or that are known to end mlx-lm's generation loop
  (:mod:`mlx_edge0.request_checks`), stops the work of a client that went
  away (:class:`ClientGuard`), and lists only the served model on
  ``/v1/models``;
- the HTTP server binds before the model loads, so a port in use fails at
  once.

mlx-lm 0.32's ``run()`` takes a ``handler_class`` but does not pass it on, so
the HTTP server is started here (as ``run()`` starts it); mlx-lm's parser is
only reachable through ``mlx_lm.server.main``, which :func:`stock_server_args`
runs with ``run`` swapped for a function that keeps what it parsed.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import select
import socket
import sys
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
from mlx_lm import server as stock
from mlx_lm.models.cache import make_prompt_cache

from .options import Options
from .request_checks import (
    CHAT_PATHS,
    COMPLETIONS,
    DEFAULT_MODEL,
    RequestPolicy,
    RequestRefused,
    check_request,
)


@dataclass(frozen=True)
class ServingSpec:
    """What the parent checked, handed to the child as one JSON argument."""

    checkpoint: str
    options: dict[str, Any]
    host: str
    port: int
    max_prompt_tokens: int  # 0: no limit

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "ServingSpec":
        return cls(**json.loads(text))


class ClientGone(Exception):
    """The client of a request closed its connection."""


def client_gone(connection: socket.socket) -> bool:
    """True once the peer has closed ``connection`` (readable, and a peek reads EOF)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class ClientGuard:
    """The ResponseGenerator as one handler sees it: its ``generate`` raises
    :class:`ClientGone` at the next prompt chunk or token once the client has
    closed the connection, so the stock handler's ``finally: ctx.stop()``
    takes the request out of the batch. Everything else is delegated."""

    def __init__(self, generator: stock.ResponseGenerator, connection: socket.socket):
        self.generator = generator
        self.connection = connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)

    def generate(self, request, args, progress_callback: Optional[Callable[[int, int], None]] = None):
        def progress(done: int, total: int) -> None:
            self.raise_if_gone()
            if progress_callback is not None:
                progress_callback(done, total)

        ctx, responses = self.generator.generate(request, args, progress_callback=progress)
        return ctx, self._guarded(responses)

    def _guarded(self, responses: Iterator) -> Iterator:
        for response in responses:
            self.raise_if_gone()
            yield response

    def raise_if_gone(self) -> None:
        if client_gone(self.connection):
            raise ClientGone()


class PinnedModelProvider(stock.ModelProvider):
    """mlx-lm's ModelProvider that holds one edge0 checkpoint and nothing else."""

    def __init__(self, cli_args: argparse.Namespace, checkpoint: Path, options: Options):
        super().__init__(cli_args)
        self.checkpoint = checkpoint
        self.options = options

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if (
            model_path not in (DEFAULT_MODEL, str(self.checkpoint))
            or adapter_path is not None
            or (draft_model_path not in (DEFAULT_MODEL, None))
        ):
            raise RequestRefused(f"this server runs {self.checkpoint} only")
        if self.model is None:
            import mlx_edge0

            model, tokenizer = mlx_edge0.load(self.checkpoint, **self.options.to_dict())
            model.limit_buffer_cache()  # this process serves this model alone
            if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
                tokenizer.chat_template = tokenizer.default_chat_template
            self.model_key = (str(self.checkpoint), None, None)
            self.model, self.tokenizer = model, tokenizer
            self.processor, self.draft_model = None, None
            self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        return self.model, self.tokenizer


class Edge0Handler(stock.APIHandler):
    """mlx-lm's APIHandler with the request checks and the client guard."""

    def __init__(self, generator, policy: RequestPolicy, counter, request, client_address, server):
        self.policy = policy
        self.counter = counter
        super().__init__(ClientGuard(generator, request), request, client_address, server)

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        check_request(self.path, self.body, self.policy, self.counter)
        # one name for the one model, so requests that name it differently still batch together
        self.requested_model = self.policy.model_id
        self.requested_draft_model = DEFAULT_MODEL

    def do_POST(self) -> None:
        try:
            super().do_POST()
        except ClientGone:
            logging.info("%s: the client closed the connection; its request was stopped", self.path)

    def handle_models_request(self) -> None:
        body = {"object": "list", "data": [{"id": self.policy.model_id, "object": "model", "created": self.created}]}
        self._set_completion_headers(200)
        data = json.dumps(body).encode()
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def token_counter(tokenizer, chat_template_args: dict) -> Callable[[str, dict], Optional[int]]:
    """``count_tokens`` for :func:`check_request`: the prompt as the stock
    handler will tokenize it (None where it cannot be rendered)."""

    def count(path: str, body: dict) -> Optional[int]:
        try:
            if path == COMPLETIONS:
                return len(tokenizer.encode(body["prompt"]))
            if path in CHAT_PATHS:
                kwargs = {**chat_template_args, **(body.get("chat_template_kwargs") or {})}
                return len(
                    tokenizer.apply_chat_template(
                        body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True, **kwargs
                    )
                )
        except Exception:  # the stock handler reports the same failure to the client
            return None
        return None

    return count


def stock_server_args(server_args: list[str]) -> argparse.Namespace:
    """``server_args`` parsed by mlx_lm.server's own parser (with its logging
    and Metal wired-limit set-up), without starting its server."""
    parsed: list[argparse.Namespace] = []
    saved_run, saved_argv = stock.run, sys.argv
    stock.run = lambda host, port, model_provider: parsed.append(model_provider.cli_args)
    sys.argv = ["mlx_lm.server", *server_args]
    try:
        stock.main()
    finally:
        stock.run, sys.argv = saved_run, saved_argv
    return parsed[0]


def refused_flags(cli_args: argparse.Namespace, spec: ServingSpec) -> Optional[str]:
    """Why flags passed through to mlx_lm.server may not run (argparse also
    expands prefixes: ``--mod X`` is ``--model X``)."""
    if cli_args.model is not None:
        return f"--model {cli_args.model}: edge0 serve serves only the checkpoint it checked ({spec.checkpoint})"
    for flag, value in (("--adapter-path", cli_args.adapter_path), ("--draft-model", cli_args.draft_model)):
        if value is not None:
            return f"{flag} {value}: edge0 serve runs the checkpoint's own model and adapters only"
    if cli_args.trust_remote_code:
        return "--trust-remote-code: edge0 serve imports nothing from the checkpoint and needs no such flag"
    if (cli_args.host, cli_args.port) != (spec.host, spec.port):
        return "--host/--port: give them to edge0 serve itself"
    return None


def serve(spec: ServingSpec, server_args: list[str]) -> int:
    """Serve until interrupted; returns the process exit status."""
    from mlx_lm.utils import load_tokenizer

    from .checkpoint import read_config, text_config

    if mx.distributed.init().size() > 1:
        print(
            "edge0 serve: runs one process and restarts it alone, which a group of ranks cannot survive; "
            "under mlx.launch serve with mlx_lm.server --model CKPT --trust-remote-code (README, 'More than one Mac')",
            file=sys.stderr,
        )
        return 2
    cli_args = stock_server_args(["--host", spec.host, "--port", str(spec.port), *server_args])
    problem = refused_flags(cli_args, spec)
    if problem:
        print(f"edge0 serve: {problem}", file=sys.stderr)
        return 2
    checkpoint = Path(spec.checkpoint)
    cli_args.model = str(checkpoint)
    family, address = _address(spec.host, spec.port)
    server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family})
    try:
        httpd = server_class(address, None)
    except OSError as e:
        print(
            f"edge0 serve: cannot listen on {spec.host}:{spec.port} ({e.strerror}); "
            "is another server using the port? Pick another with --port",
            file=sys.stderr,
        )
        return 1
    config = text_config(read_config(checkpoint))
    tokenizer = load_tokenizer(checkpoint)
    policy = RequestPolicy(
        model_id=str(checkpoint),
        model_names=frozenset({checkpoint.name}),
        vocab_size=int(config["vocab_size"]),
        max_prompt_tokens=spec.max_prompt_tokens,
    )
    provider = PinnedModelProvider(cli_args, checkpoint, Options(**spec.options))
    generator = stock.ResponseGenerator(provider, stock.LRUPromptCache(cli_args.prompt_cache_size))
    httpd.RequestHandlerClass = functools.partial(
        Edge0Handler, generator, policy, token_counter(tokenizer, cli_args.chat_template_args)
    )
    logging.info("edge0 serve: %s on %s:%d", checkpoint, spec.host, spec.port)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
    return 0


def _address(host: str, port: int) -> tuple[int, tuple]:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, address


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m mlx_edge0.pinned_server SPEC_JSON [mlx_lm.server flags...]``."""
    argv = sys.argv[1:] if argv is None else argv
    sys.exit(serve(ServingSpec.from_json(argv[0]), argv[1:]))


if __name__ == "__main__":
    main()

"""``edge0 serve``: the stock ``mlx_lm.server`` on one checked edge0 checkpoint.

A command-line module: the click command (with the :class:`Options` flags of
:mod:`mlx_edge0.flags`, as ``edge0 generate`` has them) and the supervision
of the server process. Nothing here serves a request:
:mod:`mlx_edge0.pinned_server` runs mlx-lm's server (its endpoints, batching,
prompt cache, and so every OpenAI client) as a child process, pinned to the
checkpoint checked here. ``edge0 serve`` only

- checks the checkpoint before anything starts (the trust check of
  :mod:`mlx_edge0.trust`, then every file as ``edge0 info`` checks it), so a
  bad one is refused before the server is announced;
- binds 127.0.0.1 unless ``--host`` says otherwise, and refuses a port in use;
- hands the :class:`Options` flags and the prompt limit to the child, which
  loads the checkpoint with them (no ``--trust-remote-code``: nothing of the
  checkpoint is imported; a request cannot load another model);
- restarts the server when its generation loop has died (see
  :func:`supervise`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional, Sequence

import click

from .checkpoint import CheckpointError, read_config, text_config
from .flags import model_option, option_flags, options_from_flags
from .interrupts import terminate_as_interrupt
from .pinned_server import ServingSpec
from .tensorfile import TensorFileError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
RESTART_DELAY_S = 1.0


def check_checkpoint(checkpoint: Path) -> Path:
    """The checkpoint directory, after the trust check and every file's checks.

    Raises:
        CheckpointError, TensorFileError: naming the file and the problem.
    """
    from .info import describe
    from .trust import check_code

    directory = check_code(checkpoint)
    describe(directory)
    return directory


def context_length(checkpoint: Path) -> int:
    """The model's context (``max_position_embeddings``), 0 when the config has none."""
    return int(text_config(read_config(checkpoint)).get("max_position_embeddings") or 0)


def port_in_use(host: str, port: int) -> Optional[str]:
    """Why ``host:port`` cannot be listened on (None: it can, right now)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        return e.strerror or str(e)
    return None


def server_argv(spec: ServingSpec, server_args: Sequence[str]) -> list[str]:
    """The child's command line: the pinned stock server for ``spec``."""
    return [sys.executable, "-m", "mlx_edge0.pinned_server", spec.to_json(), *server_args]


def health(url: str, timeout: float = 5.0) -> Optional[bool]:
    """The server's ``/health``: True (ok), False (its generation loop has
    died: 503), None (not answering yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except urllib.error.HTTPError as e:
        return False if e.code == 503 else None
    except OSError:
        return None


def wait_for_failure(child: subprocess.Popen, health_url: str, poll_s: float) -> bool:
    """Block until the server exits (False) or reports its generation loop dead (True)."""
    while child.poll() is None:
        if health(health_url) is False:
            return True
        time.sleep(poll_s)
    return False


def supervise(argv: list[str], health_url: str, poll_s: float = 5.0, log: Callable[[str], None] = print) -> int:
    """Run the server command ``argv``; restart it when its generation loop dies.

    mlx_lm.server (0.32) runs every batch in one generation thread, and an
    exception in a batched forward (e.g. an expert file that became
    unreadable) ends that thread for good: the process stays up and answers
    each request with an error. Restarting the process is the only way back
    with the stock server. The delay is fixed (``RESTART_DELAY_S``): no
    client can make the next outage longer. A server that exits by itself
    (bad flags, port in use, a checkpoint that fails to load) is not
    restarted. ``/health`` is polled every ``poll_s``.
    Returns the server's exit status when it exits by itself; a
    KeyboardInterrupt (Ctrl-C, SIGTERM) stops it.
    """
    while True:
        child = subprocess.Popen(argv)
        try:
            died = wait_for_failure(child, health_url, poll_s)
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait()
        if not died:
            return child.returncode
        log(
            f"edge0 serve: mlx_lm.server's generation loop died (its log above says why); "
            f"restarting it in {RESTART_DELAY_S:.0f} s"
        )
        time.sleep(RESTART_DELAY_S)


def serve_checkpoint(spec: ServingSpec, server_args: Sequence[str] = (), log: Callable[[str], None] = print) -> int:
    """Serve ``spec`` (a checked checkpoint) until interrupted (Ctrl-C,
    SIGTERM: returns 0) or the server exits by itself (returns its status)."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(spec.host, spec.host)
    health_url = f"http://{f'[{local}]' if ':' in local else local}:{spec.port}/health"
    try:
        with terminate_as_interrupt():
            return supervise(server_argv(spec, server_args), health_url, log=log)
    except KeyboardInterrupt:
        return 0


@click.command("serve", context_settings={"ignore_unknown_options": True})
@model_option
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    help="Address to bind. Loopback by default; anything else exposes the server.",
)
@click.option("--port", default=DEFAULT_PORT, show_default=True)
@click.option(
    "--max-prompt-tokens",
    type=int,
    default=None,
    help="Refuse longer prompts with a 400 (default: the model's context; 0: no limit).",
)
@option_flags
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(
    model_path: Optional[Path],
    host: str,
    port: int,
    max_prompt_tokens: Optional[int],
    server_args: tuple[str, ...],
    **option_fields,
) -> None:
    """Serve an edge0 checkpoint with the stock mlx_lm.server (OpenAI API).

    Options not listed here are passed to mlx_lm.server unchanged, e.g.
    --prefill-step-size, --decode-concurrency, --max-tokens, --log-level
    (see `mlx_lm.server --help`); --model, --adapter-path, --draft-model and
    --trust-remote-code are refused.
    """
    options = options_from_flags(**option_fields)
    if max_prompt_tokens is not None and max_prompt_tokens < 0:
        raise click.ClickException(f"--max-prompt-tokens must be 0 (no limit) or positive, got {max_prompt_tokens}")
    if model_path is None:
        from .default_model import ensure_default_model

        model_path = ensure_default_model(log=lambda m: click.echo(m, err=True))
    try:
        checkpoint = check_checkpoint(model_path)
    except (CheckpointError, TensorFileError) as e:
        raise click.ClickException(str(e)) from None
    busy = port_in_use(host, port)
    if busy:
        raise click.ClickException(
            f"cannot listen on {host}:{port} ({busy}); is another server using the port? Pick another with --port"
        )
    limit = context_length(checkpoint) if max_prompt_tokens is None else max_prompt_tokens
    spec = ServingSpec(str(checkpoint), options.to_dict(), host, port, limit)
    click.echo(
        f"edge0 serve: {checkpoint} on http://{host}:{port} (mlx_lm.server; prompts up to "
        f"{limit or 'any number of'} tokens)",
        err=True,
    )
    sys.exit(serve_checkpoint(spec, server_args, log=lambda m: click.echo(m, err=True)))

"""``edge0 serve``: the stock ``mlx_lm.server`` on an edge0 checkpoint.

Nothing here serves a request: ``python -m mlx_lm server`` does (its
endpoints, batching, prompt cache, and so every OpenAI client), as a child
process. ``edge0 serve`` only

- binds 127.0.0.1 unless ``--host`` says otherwise,
- passes ``--trust-remote-code``, after checking (as ``edge0 info`` does)
  that every file is valid, that the model file is the shim that only
  imports ``mlx_edge0`` and that no other code transformers could run is
  there; it refuses anything else,
- turns the :class:`Options` flags into the model config the server loads,
- restarts the server when its generation loop has died (see
  :func:`supervise`).

The stock server loads with ``mlx_lm.load(path)`` and has no ``model_config``
argument; ``load_model`` applies one as ``config.update(model_config)``. So
the options go into the config the server reads: a *runtime view* of the
checkpoint, a temporary directory of symlinks to its files whose config.json
adds the options under ``RUNTIME_KEY``, exactly what ``mlx_edge0.load``
passes as ``model_config``. The checkpoint is never written. The shim
resolves its own path, so experts, heads and adapters are read from the
checkpoint directory itself. The view is removed when ``edge0 serve`` stops
(Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional, Sequence

import click

from .checkpoint import CONFIG_FILE, CheckpointError, Edge0Section, read_config
from .options import RUNTIME_KEY, Options
from .tensorfile import TensorFileError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def check_checkpoint(checkpoint: Path) -> None:
    """Validate ``checkpoint`` and refuse one whose model file is not our shim
    or that holds other code transformers could run: ``serve`` trusts remote
    code on the user's behalf, so only ours.

    Raises:
        CheckpointError, TensorFileError: naming the file and the problem.
    """
    from .info import describe

    shim = describe(checkpoint)["shim"]
    if not shim["ours"]:
        problem = f"{Path(checkpoint) / shim['file']}: not the mlx-edge0 shim"
    elif shim["other_code"] or shim["auto_map"]:
        problem = (f"{checkpoint}: holds other Python code {shim['other_code']} "
                   f"(auto_map in {shim['auto_map']})")
    else:
        return
    raise CheckpointError(
        f"{problem}, so --trust-remote-code would run code mlx-edge0 did not write; inspect it, "
        "and if you trust it run mlx_lm.server --trust-remote-code yourself"
    )


def runtime_view(checkpoint: Path, options: Options, parent: Path) -> Path:
    """A directory under ``parent`` that loads as ``checkpoint`` with ``options``.

    Raises:
        CheckpointError: ``checkpoint`` is not an edge0 checkpoint.
    """
    checkpoint = Path(checkpoint).resolve()
    config = read_config(checkpoint)
    Edge0Section.from_config(config, checkpoint / CONFIG_FILE)
    view = Path(parent) / checkpoint.name
    view.mkdir()
    for entry in checkpoint.iterdir():
        if entry.name != CONFIG_FILE:
            (view / entry.name).symlink_to(entry)
    config[RUNTIME_KEY] = options.to_dict()
    (view / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return view


def server_argv(model: Path, host: str, port: int, server_args: Sequence[str]) -> list[str]:
    """The stock ``mlx_lm.server`` command line for ``model``."""
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--trust-remote-code",
            "--host", host, "--port", str(port), *server_args]


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


def supervise(argv: list[str], health_url: str, poll_s: float = 5.0,
              log: Callable[[str], None] = print) -> int:
    """Run the server command ``argv``; restart it when its generation loop dies.

    mlx_lm.server (0.32) runs every batch in one generation thread, and an
    exception in a batched forward (e.g. an expert file that became
    unreadable) ends that thread for good: the process stays up and answers
    each request with an error. Restarting the process is the only way back
    with the stock server; the backoff doubles while restarts keep failing.
    ``/health`` is polled every ``poll_s`` (each poll is a line in the
    server's request log).
    Returns the server's exit status when it exits by itself (bad arguments,
    port in use); a KeyboardInterrupt (Ctrl-C, SIGTERM) stops it.
    """
    delay = 1.0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(argv)
        try:
            died = wait_for_failure(child, health_url, poll_s)
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait()
        if not died:
            return child.returncode
        log(f"edge0 serve: mlx_lm.server's generation loop died (its log above says why); "
            f"restarting it in {delay:.0f} s")
        time.sleep(delay)
        delay = 1.0 if time.monotonic() - started > 60 else min(2 * delay, 30.0)


def serve_checkpoint(checkpoint: Path, options: Options, host: str = DEFAULT_HOST,
                     port: int = DEFAULT_PORT, server_args: Sequence[str] = (),
                     log: Callable[[str], None] = print) -> int:
    """Serve ``checkpoint`` with ``options`` until interrupted (Ctrl-C,
    SIGTERM: returns 0) or the server exits by itself (returns its status)."""
    check_checkpoint(checkpoint)
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    health_url = f"http://{f'[{local}]' if ':' in local else local}:{port}/health"
    main_thread = threading.current_thread() is threading.main_thread()
    saved = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        with tempfile.TemporaryDirectory(prefix="edge0-serve-") as tmp:
            view = runtime_view(checkpoint, options, Path(tmp))
            return supervise(server_argv(view, host, port, server_args), health_url, log=log)
    except KeyboardInterrupt:
        return 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, saved)


def serve(model_path: Optional[Path], host: str, port: int, server_args: tuple[str, ...],
          **option_fields) -> None:
    """Serve an edge0 checkpoint with the stock mlx_lm.server (OpenAI API).

    Options not listed here are passed to mlx_lm.server unchanged, e.g.
    --prefill-step-size, --decode-concurrency, --max-tokens, --log-level
    (see `mlx_lm.server --help`).
    """
    try:
        options = Options(**option_fields)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if model_path is None:
        from .default_model import ensure_default_model

        model_path = ensure_default_model(log=lambda m: click.echo(m, err=True))
    click.echo(f"edge0 serve: {model_path} on http://{host}:{port} (mlx_lm.server)", err=True)
    try:
        status = serve_checkpoint(model_path, options, host, port, server_args,
                                  log=lambda m: click.echo(m, err=True))
    except (CheckpointError, TensorFileError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(status)


@functools.cache
def serve_command() -> click.Command:
    """``edge0 serve``: :func:`serve` with ``generate``'s Options flags (from
    cli.py, which imports this module, hence a factory)."""
    from .cli import option_flags

    decorators = [
        click.command("serve", context_settings={"ignore_unknown_options": True}),
        click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
                     help="Edge0 checkpoint dir (default: the embedded default model)."),
        click.option("--host", default=DEFAULT_HOST, show_default=True,
                     help="Address to bind. Loopback by default; anything else exposes the server."),
        click.option("--port", default=DEFAULT_PORT, show_default=True),
        option_flags,
        click.argument("server_args", nargs=-1, type=click.UNPROCESSED),
    ]
    command = serve
    for decorate in reversed(decorators):
        command = decorate(command)
    return command

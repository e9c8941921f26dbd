"""What ``edge0 serve`` refuses before a request reaches mlx-lm's generation loop.

mlx_lm.server (0.32) runs every batch in one generation thread; some request
bodies raise inside it and end it for every client (or crash the process),
and some would make it load another model. Each is refused here with a 400
that says why; everything else goes to the stock handler unchanged:

- ``model``, ``adapters``, ``draft_model`` that name anything but the served
  checkpoint: the server runs the model checked at start, whatever a request
  says (nothing else is loaded, so nothing else is imported);
- a prompt of zero tokens (kills the loop), and one longer than the limit
  (the model's context unless the operator raised it);
- ``stop`` entries that are not strings, ``logit_bias`` token ids outside the
  vocabulary (crashes the process) and ``top_k`` above it (kills the loop).

Pure functions of the request body and a :class:`RequestPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

DEFAULT_MODEL = "default_model"  # mlx_lm.server's name for the model it was started with
COMPLETIONS = "/v1/completions"
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")


class RequestRefused(ValueError):
    """A request body the server will not run (its message goes to the client)."""


@dataclass(frozen=True)
class RequestPolicy:
    """What the served model accepts."""

    model_id: str  # the id /v1/models lists
    model_names: frozenset[str]  # other names of the same checkpoint a client may send
    vocab_size: int
    max_prompt_tokens: int  # 0: no limit

    def names(self) -> frozenset[str]:
        return self.model_names | {self.model_id, DEFAULT_MODEL}


def check_request(
    path: str,
    body: dict[str, Any],
    policy: RequestPolicy,
    count_tokens: Callable[[str, dict[str, Any]], Optional[int]],
) -> None:
    """Refuse a request body the served model must not run.

    ``count_tokens(path, body)`` returns the prompt's token count, or None
    when it cannot tell (the stock handler then reports its own error).

    Raises:
        RequestRefused: naming the field and the accepted values.
    """
    model = body.get("model", DEFAULT_MODEL)
    if model not in policy.names():
        raise RequestRefused(
            f"model {model!r} is not served here: this server runs {policy.model_id} only "
            f"(send model {DEFAULT_MODEL!r} or {policy.model_id!r})"
        )
    if body.get("adapters") is not None:
        raise RequestRefused("adapters: this server runs its checkpoint's own adapters only")
    if body.get("draft_model", DEFAULT_MODEL) not in (DEFAULT_MODEL, None):
        raise RequestRefused("draft_model: this server runs no draft model")
    _check_sampling(body, policy.vocab_size)
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestRefused("prompt must be a string")
    elif path in CHAT_PATHS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRefused("messages must be a non-empty list")
    else:
        return
    tokens = count_tokens(path, body)
    if tokens == 0:
        raise RequestRefused("prompt is empty: it must have at least one token")
    if policy.max_prompt_tokens and tokens is not None and tokens > policy.max_prompt_tokens:
        raise RequestRefused(
            f"prompt is {tokens} tokens, longer than this server's limit of {policy.max_prompt_tokens} "
            "(the model's context; the operator can change it with edge0 serve --max-prompt-tokens)"
        )


def _check_sampling(body: dict[str, Any], vocab_size: int) -> None:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestRefused("stop must be a string or a list of strings")
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        for key in bias:
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise RequestRefused(f"logit_bias: {key!r} is not a token id") from None
            if not 0 <= token < vocab_size:
                raise RequestRefused(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab_size - 1})")
    top_k = body.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > vocab_size:
        raise RequestRefused(f"top_k must be at most the vocabulary size {vocab_size}, got {top_k}")

"""vLLM's ``/v1/completions`` answers, trusted only field by field.

What a rollout reads from a server goes into an RL loss: a log-probability
of NaN, of ``inf`` or above 0, or more sampled tokens than ``max_tokens``
asked for, would train on garbage with no error; a field of the wrong type
would escape as a builtin ``TypeError`` deep in the reading. So each field is
checked against what vLLM 0.33.0 sends, and anything else raises
``VLLMProtocolError`` naming the route, the choice and the field.

What vLLM sends (``vllm/entrypoints/openai/completion/protocol.py``:
``CompletionResponseChoice``; ``serving.py``:
``request_output_to_completion_response``, ``_create_completion_logprobs``):
``choices`` as many as prompts x ``n``, each with an int ``index``;
``token_ids`` and ``prompt_token_ids`` lists of token ids (with
``return_token_ids``), at most ``max_tokens`` sampled, each an int32 as
vLLM's model runner holds it (``v1/worker/gpu_model_runner.py``:
``input_ids``), which the rollout's int32 arrays take; ``text`` a str;
``logprobs.tokens`` as ``token_id:N`` (with ``return_tokens_as_token_ids``);
log-probabilities from a log-softmax, so at most 0, with ``-inf`` written
``-9999.0`` and never NaN (the answer is JSON made with ``allow_nan=False``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from uniqueid import VLLMProtocolError

ROUTE = "/v1/completions"
_SHOWN_CHARS = 80
MAX_TOKEN_ID = 2**31 - 1  # vLLM's token ids are int32, as the rollout's arrays
_IDS = f"a list of token ids (ints from 0 to {MAX_TOKEN_ID})"


def protocol_error(where: str, message: str) -> VLLMProtocolError:
    """``VLLMProtocolError`` for an answer of ``where`` (a server's URL).

    Args:
        where: the server's base URL.
        message: what it answered, from ``answered ...`` on.

    Returns:
        The error, naming the route.
    """
    return VLLMProtocolError(f"POST {where}{ROUTE} {message}", ROUTE)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def _wrong(where: str, k: int, field: str, got: Any, want: str) -> VLLMProtocolError:
    return protocol_error(where, f"answered choice {k} with {field} {_shown(got)}, where vLLM "
                                 f"sends {want}")


def _is_ids(value: Any) -> bool:
    """A list of token ids: ints (not bools) from 0 to ``MAX_TOKEN_ID``."""
    return isinstance(value, list) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID
                                           for t in value)


def _is_logprob(value: Any) -> bool:
    """What vLLM's log-softmax gives: a finite number, at most 0."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value <= 0)


def ordered_choices(answer: dict[str, Any], want: int, where: str) -> list[dict[str, Any]]:
    """The answer's ``want`` choices, in ``index`` order.

    Args:
        answer: the decoded answer.
        want: the prompts sent times ``n``.
        where: the server's base URL.

    Returns:
        The choices, ``index`` 0 first.

    Raises:
        VLLMProtocolError: not a list of ``want`` objects, or indices that
            are not the ints ``0 .. want - 1``.
    """
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != want \
            or not all(isinstance(c, dict) for c in choices):
        raise protocol_error(where, f"answered {type(choices).__name__} choices "
                             f"({len(choices) if isinstance(choices, list) else '-'}), not the "
                             f"{want} asked for")
    indices = [c.get("index") for c in choices]
    if not all(type(i) is int for i in indices) or sorted(indices) != list(range(want)):
        raise protocol_error(where, f"answered choices whose index fields are "
                             f"{_shown(indices)}, where vLLM sends the ints 0..{want - 1}")
    return sorted(choices, key=lambda c: c["index"])


def prompt_ids(choice: dict[str, Any], sent: list[int] | None, k: int, where: str) -> list[int]:
    """The prompt a choice answered: the ids sent, checked against those it
    names, or (a text prompt, no tokenizer) the ids it names.

    Args:
        choice: one choice.
        sent: the prompt's ids as sent, or None (the server tokenized it).
        k: the choice's index.
        where: the server's base URL.

    Returns:
        The prompt's token ids.

    Raises:
        VLLMProtocolError: ``prompt_token_ids`` not a list of token ids
            (ints from 0 to ``MAX_TOKEN_ID``), missing where needed, or
            other than those sent.
    """
    got = choice.get("prompt_token_ids")
    if got is not None and not _is_ids(got):
        raise _wrong(where, k, "prompt_token_ids", got, _IDS)
    if sent is None:
        if not got:
            raise protocol_error(where, f"answered choice {k} without prompt_token_ids "
                                 "although return_token_ids was set")
        return got
    if got is not None and got != sent:
        raise protocol_error(where, f"answered choice {k} for prompt tokens other than those "
                             "sent (was the prompt truncated?)")
    return sent


def sampled_ids(choice: dict[str, Any], max_tokens: int, k: int, where: str) -> list[int]:
    """A choice's sampled ids (``token_ids``), checked against ``max_tokens``
    and against the ``token_id:N`` names of its logprobs when they came.

    Args:
        choice: one choice.
        max_tokens: the request's ``max_tokens``.
        k: the choice's index.
        where: the server's base URL.

    Returns:
        The sampled token ids.

    Raises:
        VLLMProtocolError: ``token_ids`` missing or not token ids (ints
            from 0 to ``MAX_TOKEN_ID``), more of them than ``max_tokens``, or
            logprobs naming other tokens.
    """
    ids = choice.get("token_ids")
    if ids is None:
        raise protocol_error(where, f"answered choice {k} without token_ids although "
                             "return_token_ids was set (vLLM 0.33.0 sends them)")
    if not _is_ids(ids):
        raise _wrong(where, k, "token_ids", ids, _IDS)
    if len(ids) > max_tokens:
        raise protocol_error(where, f"answered choice {k} with {len(ids)} token_ids, where "
                             f"vLLM samples at most the max_tokens={max_tokens} asked for")
    lp = choice.get("logprobs")
    named = lp.get("tokens") if isinstance(lp, dict) else None
    if named is not None and named != [f"token_id:{t}" for t in ids]:
        raise protocol_error(where, f"answered choice {k} whose logprobs.tokens name other "
                             "tokens than its token_ids")
    return ids


def sampled_text(choice: dict[str, Any], k: int, where: str) -> str:
    """A choice's ``text`` (the server's detokenization).

    Args:
        choice: one choice.
        k: the choice's index.
        where: the server's base URL.

    Returns:
        The text.

    Raises:
        VLLMProtocolError: not a str.
    """
    text = choice.get("text")
    if not isinstance(text, str):
        raise _wrong(where, k, "text", text, "a str")
    return text


def sampled_logprobs(choice: dict[str, Any], ids: list[int], k: int, where: str) -> np.ndarray:
    """The sampled tokens' log-probabilities (``logprobs.token_logprobs``).

    Args:
        choice: one choice, asked with ``logprobs=0``.
        ids: its sampled ids (``sampled_ids``).
        k: the choice's index.
        where: the server's base URL.

    Returns:
        float32, one per sampled token.

    Raises:
        VLLMProtocolError: missing, not one per token, or a value that is
            not a log-probability (NaN, infinite, above 0, not a number).
    """
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise _wrong(where, k, "logprobs", lp, "an object, logprobs having been set")
    values = lp.get("token_logprobs")
    if not isinstance(values, list) or len(values) != len(ids):
        raise _wrong(where, k, "logprobs.token_logprobs", values,
                     f"a list of {len(ids)}, one logprob per generated token")
    for i, v in enumerate(values):
        if not _is_logprob(v):
            raise _wrong(where, k, f"logprobs.token_logprobs[{i}]", v, _LOGPROB)
    return np.asarray(values, dtype=np.float32)


_LOGPROB = "a log-probability: a finite number at most 0 (-inf comes as -9999.0)"


def prompt_logprobs(choice: dict[str, Any], seq: list[int], start: int, k: int,
                    where: str) -> np.ndarray:
    """The logprobs of ``seq[start:]`` from a choice's ``prompt_logprobs``: a
    list as long as the prompt, None first, then per position a dict from
    the token id (a JSON string) to vLLM's ``Logprob`` (``logprob``,
    ``rank``, ``decoded_token``) that holds the prompt's own token.

    Args:
        choice: one choice, asked with ``echo``, ``max_tokens=0`` and
            ``prompt_logprobs=0``.
        seq: the sequence sent as the prompt.
        start: the first position wanted.
        k: the choice's index.
        where: the server's base URL.

    Returns:
        float32, one per position from ``start``.

    Raises:
        VLLMProtocolError: the prompt's ids other than ``seq``, not one
            entry per token, a position without its token's logprob, or a
            value that is not a log-probability.
    """
    prompt_ids(choice, seq, k, where)
    lps = choice.get("prompt_logprobs")
    if not isinstance(lps, list) or len(lps) != len(seq):
        raise _wrong(where, k, "prompt_logprobs", lps,
                     f"a list of {len(seq)}, one entry per prompt token")
    out = np.empty(len(seq) - start, dtype=np.float32)
    for j, pos in enumerate(range(start, len(seq))):
        entry = lps[pos]
        item = entry.get(str(seq[pos])) if isinstance(entry, dict) else None
        value = item.get("logprob") if isinstance(item, dict) else None
        if value is None:
            raise protocol_error(where, f"answered choice {k} without the logprob of token "
                                 f"{seq[pos]} at position {pos} of prompt_logprobs")
        if not _is_logprob(value):
            raise _wrong(where, k, f"prompt_logprobs[{pos}] of token {seq[pos]}", value,
                         _LOGPROB)
        out[j] = value
    return out

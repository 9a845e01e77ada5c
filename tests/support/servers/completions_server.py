"""A loopback server answering vLLM 0.33.0's ``POST /v1/completions``, for the CPU tests.

vLLM's own ``CompletionRequest`` cannot be imported here (its module imports
``vllm.config``, which needs torch), so what vLLM checks is written out below
from its source, each rule citing where it is read (paths under vLLM 0.33.0's
``vllm/``):

* ``REQUEST_FIELDS`` and ``CompletionRequestModel``: every field of
  ``entrypoints/openai/completion/protocol.py: CompletionRequest`` (lines
  52-295), with vLLM's types for the fields a client of this project sends;
  the nested types it never sends (``StopParam``, ``StreamOptions``,
  ``AnyResponseFormat``, ...) are ``Any`` here;
* ``check_request``: that class's ``model_validator``\\ s
  (``normalize_null_max_tokens``, ``check_logprobs``,
  ``validate_stream_options``, ``validate_prompt_and_prompt_embeds``,
  ``validate_prompt_list_length``), ``renderers/base.py: validate_token_ids``,
  ``entrypoints/serve/utils/api_utils.py: get_max_tokens``, ``to_sampling_params``
  (``max_tokens=1`` for ``echo`` with ``max_tokens=0``; ``prompt_logprobs``
  from ``logprobs`` under ``echo``) and ``sampling_params.py:
  SamplingParams._verify_args`` and its ``max_logprobs`` checks;
* the answer: ``entrypoints/openai/completion/serving.py:
  request_output_to_completion_response`` and ``_create_completion_logprobs``
  (``token_id:N`` strings under ``return_tokens_as_token_ids``, top logprobs
  limited to ``logprobs + 1`` by ``completion_top_logprobs_limit``, ``-inf``
  clamped to ``-9999.0`` by ``clamp_prompt_logprobs``), serialized as
  ``api_router.py: create_completion`` does (``JSONResponse(model_dump())``:
  a ``prompt_logprobs`` entry's int keys become JSON strings, its ``Logprob``
  dataclass ``{"logprob", "rank", "decoded_token"}``).

Deliberate departures from vLLM, each turning a silent surprise into a named
HTTP 400: fields vLLM does not know are refused (vLLM ignores them, so a
misspelt field would be lost), types are checked strictly (pydantic's strict
mode: ``"16"`` is not an int here), and streaming and beam search are refused
(this server does not implement them).

The model is a toy whose next-token distribution depends on the previous
token alone: ``table[prev]`` holds the log-softmax of fixed random logits, so
a test knows every logprob the server gives. Logprobs are raw: prompt
logprobs always (vLLM computes them before any sampling processor:
``v1/worker/gpu_model_runner.py: _get_prompt_logprobs_dict``), sampled
tokens' under vLLM's default ``logprobs_mode`` (``raw_logprobs``).
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from support.servers.recorder import JSONHandler, answer, serve

ROUTE = "/v1/completions"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # protocol.py: _INT64_MIN, _INT64_MAX
# vllm/envs.py: VLLM_MAX_COMPLETION_PROMPTS (default 1024).
MAX_COMPLETION_PROMPTS = 1024
# vllm/config/model.py: ModelConfig.max_logprobs (default 20).
DEFAULT_MAX_LOGPROBS = 20
# protocol.py: CompletionRequest._DEFAULT_SAMPLING_PARAMS (the OpenAI defaults).
DEFAULT_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
_SAMPLING_EPS = 1e-5  # sampling_params.py: _SAMPLING_EPS (below it: greedy)
HOLD_S = 60.0

# protocol.py, CompletionRequest (lines 52-295), in order.
REQUEST_FIELDS = (
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words",
    "prompt_embeds", "add_special_tokens", "response_format", "structured_outputs", "priority",
    "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids",
    "return_weight_versions", "routed_experts_prompt_start", "return_token_offsets",
    "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "thinking_token_budget", "stream_interval",
)

TokenId = Annotated[int, Field(ge=0)]


class CompletionRequestModel(BaseModel):
    """``CompletionRequest``'s fields and types (protocol.py), strict, no extras."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: Any = []
    stream: bool | None = False
    stream_options: Any = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Any = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = []
    prompt_embeds: Any = None
    add_special_tokens: bool = True
    response_format: Any = None
    structured_outputs: Any = None
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Any = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None


assert tuple(CompletionRequestModel.model_fields) == REQUEST_FIELDS


class Refused(Exception):
    """vLLM's 400 ``ErrorResponse`` (serve/engine/serving.py: create_error_response)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.body = {"error": {"message": message, "type": "BadRequestError", "param": param,
                               "code": HTTPStatus.BAD_REQUEST.value}}


def check_request(body: Any, *, vocab_size: int, max_model_len: int,
                  max_logprobs: int) -> CompletionRequestModel:
    """The request as vLLM 0.33.0 would take it, or ``Refused`` with vLLM's message.

    Raises:
        Refused: what vLLM answers 400 to (and this server's departures).
    """
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    data = dict(body)
    if data.get("max_tokens") is None:  # normalize_null_max_tokens
        data["max_tokens"] = 16
    for name in ("prompt_logprobs", "logprobs"):  # check_logprobs
        v = data.get(name)
        if v is not None and not isinstance(v, (int, float)):
            raise Refused(f"`{name}` must be an integer.", name)
        if v is not None and v < 0 and v != -1:
            raise Refused(f"`{name}` must be a positive value or -1.", name)
    if data.get("logprob_token_ids") and data.get("logprobs") is None:
        raise Refused("when using `logprob_token_ids`, `logprobs` must be set.",
                      "logprob_token_ids")
    if data.get("stream_options") and not data.get("stream"):  # validate_stream_options
        raise Refused("Stream options can only be defined when `stream=True`.", "stream_options")
    prompt = data.get("prompt")  # validate_prompt_and_prompt_embeds
    if (prompt is None or prompt == "") and not data.get("prompt_embeds"):
        raise Refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt) \
            and len(prompt) > MAX_COMPLETION_PROMPTS:  # validate_prompt_list_length
        raise Refused(f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                      f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                      "VLLM_MAX_COMPLETION_PROMPTS environment variable.", "prompt")
    try:
        req = CompletionRequestModel.model_validate(data)
    except ValidationError as e:  # FastAPI's RequestValidationError, which vLLM answers 400
        raise Refused(f"{e.error_count()} validation error(s): {e.errors(include_url=False)}") \
            from None
    if req.stream:
        raise Refused("this test server does not stream", "stream")
    if req.use_beam_search:
        raise Refused("this test server has no beam search", "use_beam_search")
    if req.prompt_embeds is not None:
        raise Refused("this test server takes no prompt_embeds", "prompt_embeds")
    for seq in token_prompts(req.prompt):
        if not seq:  # v1/engine/input_processor.py: _validate_prompt_len
            raise Refused("The decoder prompt cannot be empty")
        if max(seq) > vocab_size - 1:  # renderers/base.py: validate_token_ids
            raise Refused(f"Token id {max(seq)} is out of vocabulary", "prompt")
        if len(seq) > max_model_len:  # api_utils.py: get_max_tokens
            raise Refused(f"Input length ({len(seq)}) exceeds model's maximum context length "
                          f"({max_model_len}).")
    # to_sampling_params, then SamplingParams._verify_args
    sampling = {k: (v if (v := getattr(req, k)) is not None else d)
                for k, d in DEFAULT_SAMPLING.items()}
    max_tokens = 1 if (req.echo and req.max_tokens == 0) else req.max_tokens
    if req.n < 1:
        raise Refused(f"n must be at least 1, got {req.n}.", "n")
    t = sampling["temperature"]
    if not math.isfinite(t) or not 0.0 <= t <= 2.0:
        raise Refused(f"temperature must be in [0, 2], got {t}.", "temperature")
    if not 0.0 < sampling["top_p"] <= 1.0:
        raise Refused(f"top_p must be in (0, 1], got {sampling['top_p']}.", "top_p")
    if sampling["top_k"] < -1:
        raise Refused(f"top_k must be 0 (disable), or at least 1, got {sampling['top_k']}.")
    if max_tokens is not None and max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    for name, v in (("sample", req.logprobs), ("prompt", prompt_logprobs)):
        if v is not None and v != -1 and v > max_logprobs:  # sampling_params.py:933, 978
            raise Refused(f"Requested {name} logprobs of {v}, which is greater than max "
                          f"allowed: {max_logprobs}")
    return req


def token_prompts(prompt: Any) -> list[list[int]]:
    """The token-id prompts of a request (none for text prompts)."""
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return [prompt]  # one prompt ([] included: refused as empty)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return prompt
    return []


class CompletionsServer:
    """vLLM's completions route over loopback HTTP, over a toy model.

    Args:
        vocab_size: the model's vocabulary (token ids ``0..vocab_size-1``).
        eos_id: the model's end-of-sequence token.
        max_model_len: the longest prompt taken.
        model_name: the served model's name (the answers' ``model``).
        hang: accept each request and never answer it (until ``close``).
        mangle: applied to each answer before it is sent (a test's way to
            answer what vLLM never would).
        seed: the toy model's logits.

    Attributes:
        requests: every request body received, parsed, in arrival order.
        arrivals: when each arrived (``time.monotonic()``).
        refused: ``(status, body)`` of every 400 answered.
        table: ``table[prev, next]``: the model's log-probability of ``next``
            after ``prev`` (float64, rows are log-softmaxes).
    """

    def __init__(self, *, vocab_size: int = 32, eos_id: int = 1, max_model_len: int = 256,
                 model_name: str = "tiny-qwen3", hang: bool = False, seed: int = 0,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 mangle: Callable[[dict], dict] | None = None):
        self.vocab_size, self.eos_id, self.max_model_len = vocab_size, eos_id, max_model_len
        self.model_name, self.hang = model_name, hang
        self.max_logprobs, self.mangle = max_logprobs, mangle
        logits = np.random.default_rng(seed).standard_normal((vocab_size, vocab_size)) * 2.0
        self.logits = logits
        self.table = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        self.requests: list[Any] = []
        self.arrivals: list[float] = []
        self.refused: list[tuple[int, Any]] = []
        self._rng = np.random.default_rng(seed + 1)
        self._release = threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(JSONHandler):
            def do_POST(self) -> None:
                raw = self.body()
                if self.path.split("?")[0] != ROUTE:
                    answer(self, 404, {"detail": "Not Found"})
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                with server._lock:
                    server.requests.append(body)
                    server.arrivals.append(time.monotonic())
                if server.hang:
                    server._release.wait(HOLD_S)
                    return
                try:
                    status, out = 200, server.complete(body)
                    if server.mangle is not None:
                        out = server.mangle(out)
                except Refused as e:
                    status, out = 400, e.body
                    with server._lock:
                        server.refused.append((status, out))
                answer(self, status, out)

            def do_GET(self) -> None:
                answer(self, 404, {"detail": "Not Found"})

        self.http, self.url = serve(Handler)

    def close(self) -> None:
        self._release.set()
        self.http.shutdown()
        self.http.server_close()

    # -- the model ----------------------------------------------------------------
    def decode(self, token: int) -> str:
        return f"<{token}>"

    def _sample(self, prev: int, req: CompletionRequestModel, rng: np.random.Generator) -> int:
        temperature = req.temperature if req.temperature is not None else 1.0
        logits = self.logits[prev]
        if temperature < _SAMPLING_EPS:
            return int(np.argmax(logits))
        scaled = logits / temperature
        probs = np.exp(scaled - np.logaddexp.reduce(scaled))
        order = np.argsort(-probs, kind="stable")
        keep = np.zeros(self.vocab_size, dtype=bool)
        top_k = req.top_k if req.top_k not in (None, 0, -1) else self.vocab_size
        cum = np.cumsum(probs[order])
        top_p = req.top_p if req.top_p is not None else 1.0
        for rank, tok in enumerate(order[:top_k]):
            keep[tok] = True
            if cum[rank] >= top_p:
                break
        probs = np.where(keep, probs, 0.0)
        return int(rng.choice(self.vocab_size, p=probs / probs.sum()))

    def _position(self, prev: int, tok: int, k: int | None) -> dict:
        """One position's logprobs as the engine gives them (``dict[int, Logprob]``):
        the token itself first, then the top ``k`` (all for -1)."""
        row = [float(self.table[prev, t]) for t in range(self.vocab_size)]
        order = sorted(range(self.vocab_size), key=lambda t: -row[t])
        rank = order.index(tok) + 1
        out = {tok: {"logprob": row[tok], "rank": rank, "decoded_token": self.decode(tok)}}
        top = order if k == -1 else order[:k or 0]
        for r, t in enumerate(top, start=1):
            out.setdefault(t, {"logprob": row[t], "rank": r, "decoded_token": self.decode(t)})
        return out

    # -- one request -----------------------------------------------------------------
    def complete(self, body: Any) -> dict[str, Any]:
        """The answer to one request body, or ``Refused``."""
        req = check_request(body, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                            max_logprobs=self.max_logprobs)
        prompts = token_prompts(req.prompt)
        if not prompts:  # text prompts: this toy's tokenizer is one token per character
            texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            prompts = [[3 + ord(c) % (self.vocab_size - 3) for c in s] for s in texts]
        echo_only = bool(req.echo and req.max_tokens == 0)
        max_tokens = 1 if echo_only else min(req.max_tokens, self.max_model_len - max(map(len, prompts)))
        prompt_k = req.prompt_logprobs if req.prompt_logprobs is not None else (
            req.logprobs if req.echo else None)
        stops = set(req.stop_token_ids or [])
        choices, n_prompt, n_gen = [], 0, 0
        for prompt in prompts:
            prompt_lps = None
            if prompt_k is not None:
                prompt_lps = [None] + [self._position(prompt[i - 1], prompt[i], prompt_k)
                                       for i in range(1, len(prompt))]
            rng = np.random.default_rng(req.seed) if req.seed is not None else self._rng
            for _ in range(req.n):
                out, lps, finish, stop_reason = [], [], "length", None
                prev = prompt[-1]
                while len(out) < max_tokens:
                    tok = self._sample(prev, req, rng)
                    out.append(tok)
                    if req.logprobs is not None:
                        lps.append(self._position(prev, tok, req.logprobs))
                    prev = tok
                    if tok == self.eos_id and not req.ignore_eos:
                        finish = "stop"
                        break
                    if tok in stops:
                        finish, stop_reason = "stop", tok
                        break
                choices.append(self._choice(len(choices), req, prompt, prompt_lps, out,
                                            lps if req.logprobs is not None else None,
                                            finish, stop_reason))
                n_gen += len(out)
            n_prompt += len(prompt)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_gen,
                          "completion_tokens": n_gen, "prompt_tokens_details": None},
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    def _text(self, ids: list[int], req: CompletionRequestModel) -> str:
        skip = req.skip_special_tokens if req.skip_special_tokens is not None else True
        return "".join(self.decode(t) for t in ids if not (skip and t == self.eos_id))

    def _choice(self, index: int, req: CompletionRequestModel, prompt: list[int],
                prompt_lps: list | None, out: list[int], lps: list | None, finish: str,
                stop_reason: int | None) -> dict[str, Any]:
        """serving.py: request_output_to_completion_response, for one output."""
        prompt_text = "" if req.return_token_ids else "".join(self.decode(t) for t in prompt)
        if req.echo:
            if req.max_tokens == 0:
                token_ids, out_lps, text = prompt, prompt_lps, prompt_text
            else:
                token_ids = [*prompt, *out]
                out_lps = None if req.logprobs is None else [*prompt_lps, *lps]
                text = prompt_text + self._text(out, req)
        else:
            token_ids, out_lps, text = out, lps, self._text(out, req)
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._completion_logprobs(token_ids, out_lps, req)
        return {
            "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason, "token_ids": out if req.return_token_ids else None,
            "prompt_logprobs": None if prompt_lps is None else [
                None if e is None else {str(t): dict(v, logprob=max(v["logprob"], -9999.0))
                                        for t, v in e.items()} for e in prompt_lps],
            "prompt_token_ids": prompt if req.return_token_ids else None,
            "routed_experts": None, "weight_versions": None,
        }

    def _completion_logprobs(self, token_ids: list[int], positions: list,
                             req: CompletionRequestModel) -> dict[str, Any]:
        """serving.py: _create_completion_logprobs."""
        as_id = bool(req.return_tokens_as_token_ids)
        name = (lambda t: f"token_id:{t}") if as_id else self.decode
        limit = None if req.logprobs == -1 else req.logprobs + 1
        offsets, values, tokens, tops = [], [], [], []
        last = 0
        for i, tok in enumerate(token_ids):
            step = positions[i]
            token = name(tok)
            tokens.append(token)
            if step is None:
                values.append(None)
                tops.append(None)
            else:
                values.append(max(step[tok]["logprob"], -9999.0))
                items = list(step.items())[:limit]
                tops.append({name(t): max(v["logprob"], -9999.0) for t, v in items})
            offsets.append(0 if not offsets else offsets[-1] + last)
            last = len(token)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

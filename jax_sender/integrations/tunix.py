"""A Tunix rollout engine backed by vLLM servers: weights over NCCL, samples over HTTP.

Tunix's ``RLCluster`` takes any ``BaseRollout`` subclass, or a
``functools.partial`` of one, as ``ClusterConfig.rollout_engine``, and
builds it with ``rollout_actor=``, ``tokenizer=``, ``mesh=`` and
``rollout_config=`` (``tunix/rl/rl_cluster.py``, ``_init_cluster``)::

    rollout_engine=functools.partial(
        VLLMServerRollout, "http://vllm-host:8000", mapping=TUNIX_QWEN3)

* ``update_params`` pushes the trainer's ``nnx.Param`` state into every
  server's workers through a :class:`~jax_sender.WeightSender` (vLLM's
  NCCL weight transfer), asynchronously: it returns once the push is under
  way, and the next ``update_params``, ``generate`` or
  ``get_per_token_logps`` waits for it. ``RLCluster.sync_weights`` calls it
  after every global step, because ``model()`` returns None (the learners'
  ``should_sync_weights``: ``rl_utils.is_sharing_weights(actor, None)`` is
  False).
* ``generate`` posts vLLM's OpenAI-compatible ``/v1/completions`` with the
  prompts as token ids and gets token ids (``return_token_ids``) and the
  sampled tokens' logprobs back; the prompts are tokenized and the result
  laid out as Tunix's own vLLM rollout does (``tunix/generate/vllm_sampler.py``).
* ``get_per_token_logps`` asks the same route for the log-probabilities of
  given completion tokens: the whole sequence as the prompt, ``echo=True``,
  ``max_tokens=0`` and ``prompt_logprobs=0`` (vLLM's extension).

The request and response fields are vLLM 0.33.0's
(``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionRequest``,
``CompletionResponseChoice``; ``serving.py``:
``request_output_to_completion_response``). Every HTTP call has one
deadline for the whole call (``uniqueid.VLLMClient``), and a whole
``generate`` or ``get_per_token_logps`` ends within ``timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from flax import nnx
    from tunix.generate import tokenizer_adapter
    from tunix.rl.rollout import base_rollout
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError("jax_sender.integrations.tunix needs Google's Tunix, which is not "
                      f"importable here ({_e}): pip install google-tunix") from _e

import jax
import jax.numpy as jnp

from jax_sender import Mapping, MetadataError, PendingSend, SendConfig, SendError, WeightSender
from jax_sender._src.core.tensors.naming import dotted
from nccl_cffi import Deadline
from nccl_cffi.waiting import MAX_TIMEOUT_S
from uniqueid import VLLMClient, VLLMTimeout

from . import _completions as answers
from ._completions import ROUTE

__all__ = ["VLLMServerRollout", "strip_prefix"]

log = logging.getLogger("jax_sender.tunix")

# vllm/envs.py: VLLM_MAX_COMPLETION_PROMPTS (1024 by default): the most prompts
# one completions request may carry (protocol.py: validate_prompt_list_length).
MAX_PROMPTS_PER_REQUEST = 1024
# Fields this module sets itself: passing them as extra sampling fields would
# break what it reads back.
_OWN_FIELDS = frozenset({"prompt", "echo", "stream", "logprobs", "prompt_logprobs",
                         "return_token_ids", "return_tokens_as_token_ids", "max_tokens",
                         "model", "n", "use_beam_search", "stream_options"})
_PUSH_GRACE_S = 10.0  # beyond a push's own deadlines, when waiting for it


def strip_prefix(mapping: Mapping, *keys: str) -> Mapping:
    """``mapping`` for a model held under ``keys`` in the tree pushed.

    MaxText's RL trainer hands Tunix a ``TunixMaxTextAdapter``, which holds
    the MaxText model as ``base``: its ``nnx.state`` paths read
    ``base.token_embedder.embedding``, ``base.decoder.layers...``, so
    ``strip_prefix(maxtext_qwen3(num_layers=N), "base")`` names them as
    ``maxtext_qwen3`` names ``token_embedder.embedding``, ``decoder.layers...``.

    Args:
        mapping: the mapping of the inner model (e.g. a ``MAXTEXT_*`` one).
        *keys: the path keys the inner model sits under.

    Returns:
        A mapping that drops ``keys`` from each path, then names and
        transforms as ``mapping``; a leaf outside ``keys`` has no name
        (``KeyError``, which a push refuses before anything is sent).
    """
    keys = tuple(keys)

    def inner(path: tuple[Any, ...]) -> tuple[Any, ...]:
        if tuple(str(k) for k in path[:len(keys)]) != keys:
            raise KeyError(f"{dotted(path)!r} is not under {'.'.join(keys)!r}")
        return tuple(path[len(keys):])

    return Mapping(name=lambda path: mapping.name(inner(path)),
                   transform=lambda path, x: mapping.transform(inner(path), x))


def _is_lora_leaf(leaf: Any) -> bool:
    """An ``nnx.LoRAParam`` (a Variable, or an older ``VariableState`` of that type)."""
    if isinstance(leaf, nnx.LoRAParam):
        return True
    kind = getattr(leaf, "type", None)
    return isinstance(kind, type) and issubclass(kind, nnx.LoRAParam)


def _refuse_lora(params: Any, filter_types: Any) -> None:
    """LoRA adapter weights, named by the filter or found among the leaves,
    refused before any request: vLLM's weight update loads whole tensors."""
    if filter_types is not None and _names_lora(filter_types):
        raise MetadataError(
            "update_params was given LoRA adapter weights (filter_types names "
            "nnx.LoRAParam), which vLLM's weight update cannot load: merge the adapters "
            "into the base weights and push the merged nnx.Param state")
    lora = [leaf for leaf in _leaves(params) if _is_lora_leaf(leaf)]
    if lora:
        raise MetadataError(
            f"update_params was given {len(lora)} LoRA adapter weight(s) (nnx.LoRAParam), "
            "which vLLM's weight update cannot load: merge the adapters into the base "
            "weights and push the merged nnx.Param state")


def _names_lora(filter_types: Any) -> bool:
    items = filter_types if isinstance(filter_types, (tuple, list)) else (filter_types,)
    return any(isinstance(f, type) and issubclass(f, nnx.LoRAParam) for f in items)


def _next_power_of_2(x: int) -> int:
    """``tunix.generate.utils.next_power_of_2``, without going through JAX."""
    return 1 if x <= 0 else 1 << (x - 1).bit_length()


def _seed(seed: Any) -> int | None:
    """``RolloutConfig.seed`` (an int, a scalar array, or None) as vLLM's int64 seed."""
    if seed is None:
        return None
    value = np.asarray(seed)
    if value.size != 1 or value.dtype.kind not in "iu":
        raise ValueError(f"rollout_config.seed must be an integer or a scalar integer array "
                         f"for vLLM's per-request seed, got {seed!r}")
    out = int(value.reshape(()))
    if not -(2**63) <= out < 2**63:
        raise ValueError(f"rollout_config.seed {out} does not fit vLLM's int64 seed")
    return out


def _ids(row: Any, what: str) -> list[int]:
    """A sequence of token ids as a list of non-negative Python ints."""
    arr = np.asarray(row)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got {arr.dtype} "
                         f"of shape {arr.shape}")
    out = [int(t) for t in arr]
    if any(t < 0 for t in out):
        raise ValueError(f"{what} holds a negative token id")
    return out


class VLLMServerRollout(base_rollout.BaseRollout):
    """Tunix's rollout worker for vLLM servers reached over the network.

    The servers are started with vLLM's weight transfer enabled
    (``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config
    '{"backend":"nccl"}'``) and serve the model the trainer trains (same
    architecture and Hugging Face names: ``mapping`` turns the trainer's
    tree into them).

    **Connection.** The weight sender connects when the rollout is built
    (``WeightSender.connect``: init + warm-up with every server's workers,
    within ``config.init_timeout_s``), so a server that cannot take the
    weights fails the cluster's construction, not the first sync after a
    training step. ``lazy_connect=True`` defers it to the first
    ``update_params``. ``sender=`` takes a sender connected elsewhere (then
    ``servers`` only serves the completions route, and ``close()`` leaves
    the sender open).

    Args:
        servers: the vLLM server URL, or a list of them (one NCCL group
            feeds them all; ``generate`` splits each batch between them).
        mapping: the trainer's tree to Hugging Face names, e.g.
            ``TUNIX_QWEN3`` (see ``jax_sender._src.core.tensors.zoo``); with ``sender=``,
            the sender's (leave it out).
        tokenizer: Tunix's ``TokenizerAdapter`` (what ``RLCluster`` passes),
            a Hugging Face or SentencePiece tokenizer, or None (string
            prompts are then tokenized by the server, and ``pad_id`` and
            ``eos_id`` must be given).
        pad_id, eos_id: override the tokenizer's.
        config: the sender's settings (push deadlines, chunking, staging).
        sender: a connected sender to use instead of connecting one.
        model_name: the ``model`` field of each request (the server's
            ``--served-model-name``); None lets the server use its own.
        api_key: sent as ``Authorization: Bearer`` on the completions route.
        timeout_s: the deadline of each whole ``generate`` and
            ``get_per_token_logps`` (every HTTP call in it included).
        connect_timeout_s: the most one HTTP connection may take to open.
        max_body_bytes: the largest completions answer read (a batch's
            tokens and logprobs: about 100 bytes a token).
        max_prompts_per_request: prompts per HTTP request at most (vLLM's
            ``VLLM_MAX_COMPLETION_PROMPTS``, 1024 by default).
        pause: vLLM's pause mode around each push (``"abort"``, ``"wait"``,
            ``"keep"``) or None (no pause: requests in flight see the new
            weights part-way, as with any in-place update).
        async_push: push with ``send(wait=False)``; False pushes blocking
            (needed for a sender made by ``connect_group``).
        weight_version_prefix: pushes are stamped ``f"{prefix}{n}"``, n
            counting this rollout's pushes from 1.
        lazy_connect: connect on the first ``update_params`` instead.
        device: the trainer's CUDA ordinal for the sender (default: JAX's
            first GPU).
        rollout_actor, mesh: what ``RLCluster`` passes; unused (the weights
            come through ``update_params``, the servers own their devices).
        rollout_config: the cluster's train-mode ``RolloutConfig``, the
            default of ``generate``'s.

    Raises:
        ValueError: no server, a URL that is not http(s), or a bad setting.
        TransferError, RendezvousError, NcclError: the sender's connect
            failed (see ``WeightSender.connect``).
    """

    def __init__(self, servers: str | Sequence[str] | None = None, *,
                 mapping: Mapping | None = None,
                 tokenizer: Any = None, pad_id: int | None = None, eos_id: int | None = None,
                 config: SendConfig = SendConfig(), sender: WeightSender | None = None,
                 model_name: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 max_body_bytes: int = 256 * 2**20,
                 max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
                 pause: str | None = None, async_push: bool = True,
                 weight_version_prefix: str = "sync-", lazy_connect: bool = False,
                 device: int | None = None, rollout_actor: Any = None, mesh: Any = None,
                 rollout_config: base_rollout.RolloutConfig | None = None):
        urls = [servers] if isinstance(servers, str) else list(servers or [])
        mapping = _checked(urls, mapping, sender, timeout_s, max_prompts_per_request, pause)
        self._urls = urls
        self._mapping = mapping
        self._config = config
        self._device = device
        if tokenizer is not None and not isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter):
            tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
        self._tokenizer = tokenizer
        self._pad_id = pad_id
        self._eos_id = eos_id
        self._model_name = model_name
        self._timeout_s = float(timeout_s)
        self._max_prompts = max_prompts_per_request
        self._pause = pause
        self._async_push = async_push
        self._prefix = weight_version_prefix
        self._rollout_config = rollout_config
        self._clients = [VLLMClient(u, connect_timeout=connect_timeout_s, timeout=timeout_s,
                                    api_key=api_key, max_body_bytes=max_body_bytes)
                         for u in urls]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, 4 * len(urls)), thread_name_prefix="vllm-rollout")
        self._lock = threading.RLock()  # the sender, the push in flight, the counters
        self._pending: PendingSend | None = None
        self._pending_version: str | None = None
        self._pushes = 0
        self._weight_version: str | None = None  # the last push known to have landed
        self._closed = False
        self._owns_sender = sender is None
        self._sender = sender
        try:
            if sender is None and not lazy_connect:
                self._sender = self._connect()
        except BaseException:
            self._close_http()
            raise

    # -- the weights -----------------------------------------------------------
    def _connect(self) -> WeightSender:
        log.info("connecting the weight sender to %s", ", ".join(self._urls))
        return WeightSender.connect(self._urls if len(self._urls) > 1 else self._urls[0],
                                    device=self._device, mapping=self._mapping,
                                    config=self._config)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None, *,
                      weight_version: str | None = None) -> None:
        """Push ``params`` into every server's workers.

        Asynchronous (``async_push``): returns once the push is under way
        (its bytes snapshotted, so the trainer may update or donate the
        parameters at once); the next call here, ``generate`` or
        ``get_per_token_logps`` waits for it. A push that failed is raised
        by the next ``generate`` / ``get_per_token_logps`` (logged, when this
        call comes first: this push repairs it); if it left the sender
        broken, this call reconnects first.

        Args:
            params: the ``nnx.State`` of ``nnx.Param`` (``RLCluster.sync_weights``
                passes ``nnx.state(actor, nnx.Param)``), or any tree the
                mapping names.
            filter_types: the filter the state was taken with (Tunix passes
                ``(nnx.Param,)``, or ``(nnx.LoRAParam,)`` for a LoRA actor).
            weight_version: stamped on the servers when the push ends
                (default ``f"{weight_version_prefix}{n}"``).

        Raises:
            MetadataError: LoRA adapter weights, or a tree the mapping
                cannot name (nothing reached a server).
            SendError, UpdateIncomplete: a blocking push failed.
            RuntimeError: the rollout is closed.
        """
        _refuse_lora(params, filter_types)
        with self._lock:
            self._check_open()
            sender = self._sender_for_a_push()
            self._pushes += 1
            version = weight_version if weight_version is not None else f"{self._prefix}{self._pushes}"
            # RLCluster.sync_weights forbids every host<->device transfer while JAX
            # runs on CPU (rl_cluster.py, sync_weights); a push is a transfer out of
            # the trainer by design (its staging buffers, its copies to the wire).
            with jax.transfer_guard("allow"):
                out = sender.send(params, weight_version=version, pause=self._pause,
                                  wait=not self._async_push)
            if isinstance(out, PendingSend):
                self._pending, self._pending_version = out, version
            else:
                self._weight_version = version

    def _sender_for_a_push(self) -> WeightSender:
        """The sender, ready for the next push (under ``_lock``): the push in
        flight ended (its failure logged: the next push repairs it), the
        sender connected, and reconnected if a failure left it broken."""
        previous, self._pending = self._pending, None
        if previous is not None:
            try:
                self._settle(previous, self._pending_version)
            except Exception as e:  # noqa: BLE001 - logged; this push repairs it
                log.warning("the weight push %r failed (%s); pushing again",
                            self._pending_version, e)
        if self._sender is None:
            self._sender = self._connect()
        if self._sender.broken:
            log.warning("the weight sender is broken (%s): reconnecting", self._sender.broken)
            self._sender.reconnect()
        return self._sender

    def wait_for_push(self) -> None:
        """Wait for the push in flight, if any, within its own deadlines.

        Raises:
            SendError, UpdateIncomplete: it failed (reported once: the
                servers do not hold these weights).
        """
        with self._lock:
            pending, version = self._pending, self._pending_version
            self._pending = None
        if pending is not None:
            self._settle(pending, version)

    def _settle(self, pending: PendingSend, version: str | None) -> None:
        """Wait for ``pending`` within its own deadlines; once it landed,
        ``version`` is what the servers hold."""
        try:
            pending.result(timeout=pending.bound_s + _PUSH_GRACE_S)
        except TimeoutError as e:
            raise SendError(f"the weight push {version!r} did not end within its deadlines "
                            f"({pending.bound_s:g} s)") from e
        self._weight_version = version

    @property
    def weight_version(self) -> str | None:
        """The version of the last push known to have landed (None before any)."""
        return self._weight_version

    @property
    def sender(self) -> WeightSender | None:
        """The weight sender (None until connected)."""
        return self._sender

    # -- Tunix's rollout interface --------------------------------------------
    def generate(self, prompts: Sequence[Any], rollout_config: base_rollout.RolloutConfig | None = None,
                 **kwargs: Any) -> base_rollout.RolloutOutput:
        """Sample completions of ``prompts`` from the servers.

        Waits for a push in flight first, so the samples come from the
        weights last given to ``update_params``.

        Args:
            prompts: strings (tokenized here as Tunix's vLLM rollout does:
                ``encode``, a BOS in front unless already there; by the
                server without a tokenizer), or sequences of token ids.
            rollout_config: ``max_tokens_to_generate``, ``temperature``,
                ``top_p``, ``top_k``, ``seed``, ``max_prompt_length``,
                ``eos_tokens``, ``return_logprobs`` and
                ``rollout_vllm_sampling_kwargs`` (extra request fields) are read.
            **kwargs: ``n`` (samples per prompt, laid out prompt by prompt),
                else more request fields (vLLM's sampling extensions such as
                ``min_p``, ``repetition_penalty``).

        Returns:
            Tunix's ``RolloutOutput``: ``tokens`` (each sample's ids, the
            stop token kept), ``text`` (decoded here, or the server's text
            without a tokenizer), ``left_padded_prompt_tokens`` (to
            ``max_prompt_length``, or the next power of 2 of the longest
            prompt when longer, as Tunix's vLLM sampler), ``logprobs`` (the
            sampled tokens', when ``return_logprobs``) and ``logits`` None.

        Raises:
            ValueError: prompts or settings vLLM would refuse.
            SendError, UpdateIncomplete: the push in flight failed.
            VLLMHTTPError: a server refused the request (its message).
            VLLMTimeout: the batch did not complete within ``timeout_s``.
            VLLMProtocolError: an answer not of vLLM's shape.
        """
        self._check_open()
        self.wait_for_push()
        cfg = rollout_config or self._rollout_config or base_rollout.RolloutConfig()
        if len(prompts) == 0:
            raise ValueError("generate needs at least one prompt")
        n = kwargs.pop("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        ids, field = self._prompt_field(prompts)
        body = self._sampling(cfg, n, kwargs)
        answered = self._complete(field, body, per_prompt=n)
        prompt_ids, tokens, texts, logprobs = self._samples(answered, ids, n, body["max_tokens"],
                                                            cfg.return_logprobs)
        return base_rollout.RolloutOutput(
            text=texts, logits=None, tokens=tokens, logprobs=logprobs,
            left_padded_prompt_tokens=self._left_padded(prompt_ids, cfg, n))

    def _sampling(self, cfg: base_rollout.RolloutConfig, n: int,
                  kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's sampling fields, from the rollout config and extras."""
        extra = {**(cfg.rollout_vllm_sampling_kwargs or {}), **kwargs}
        clash = sorted(set(extra) & _OWN_FIELDS)
        if clash:
            raise ValueError(f"{', '.join(clash)} cannot be passed as request fields: "
                             "VLLMServerRollout sets them itself")
        body: dict[str, Any] = {
            "max_tokens": int(cfg.max_tokens_to_generate),
            "temperature": float(cfg.temperature),
            "n": n,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
        }
        if cfg.top_p is not None:
            body["top_p"] = float(cfg.top_p)
        if cfg.top_k is not None:
            body["top_k"] = int(cfg.top_k)
        seed = _seed(cfg.seed)
        if seed is not None:
            body["seed"] = seed
        stops = list(cfg.eos_tokens) if cfg.eos_tokens else (
            [self.eos_id()] if self._has_eos() else [])
        if stops:
            body["stop_token_ids"] = [int(t) for t in stops]
        if cfg.return_logprobs:
            body["logprobs"] = 0  # the sampled token's own logprob
        body.update(extra)
        return body

    def _samples(self, answered: list[tuple[str, dict[str, Any]]], ids: list[list[int]] | None,
                 n: int, max_tokens: int, want_logprobs: bool
                 ) -> tuple[list[list[int]], list[np.ndarray], list[str], list[np.ndarray] | None]:
        """Each prompt's ids, and each sample's tokens, text and logprobs, every
        field checked (``_completions``) before any of it is used."""
        prompt_ids: list[list[int]] = []
        tokens: list[np.ndarray] = []
        texts: list[str] = []
        logprobs: list[np.ndarray] | None = [] if want_logprobs else None
        for k, (where, choice) in enumerate(answered):
            if k % n == 0:
                sent = None if ids is None else ids[k // n]
                prompt_ids.append(answers.prompt_ids(choice, sent, k, where))
            out_ids = answers.sampled_ids(choice, max_tokens, k, where)
            tokens.append(np.asarray(out_ids, dtype=np.int32))
            if self._tokenizer is not None:
                texts.append(self._tokenizer.decode(out_ids))
            else:
                texts.append(answers.sampled_text(choice, k, where))
            if logprobs is not None:
                logprobs.append(answers.sampled_logprobs(choice, out_ids, k, where))
        return prompt_ids, tokens, texts, logprobs

    def _left_padded(self, prompt_ids: list[list[int]], cfg: base_rollout.RolloutConfig,
                     n: int) -> np.ndarray:
        """The prompts left-padded as Tunix's vLLM sampler pads them, one row a sample."""
        longest = max(len(p) for p in prompt_ids)
        width = int(cfg.max_prompt_length or 0)
        if width < longest:
            width = _next_power_of_2(longest)
        padded = np.full((len(prompt_ids), width), self.pad_id(), dtype=np.int32)
        for r, p in enumerate(prompt_ids):
            if p:
                padded[r, width - len(p):] = p
        return np.repeat(padded, n, axis=0) if n > 1 else padded

    def get_per_token_logps(self, prompt_tokens: Any, completion_tokens: Any,
                            *args: Any, **kwargs: Any) -> Any:
        """The served model's log-probability of each completion token.

        As Tunix's own ``compute_per_token_logps`` reads a batch: pad tokens
        (``pad_id()``) anywhere are not part of a sequence, so row b is
        ``prompt[b][prompt[b] != pad]`` followed by
        ``completion[b][completion[b] != pad]``. Each sequence goes to the
        completions route as the prompt, with ``echo=True``,
        ``max_tokens=0`` and ``prompt_logprobs=0``; vLLM computes prompt
        logprobs from the raw logits (temperature 1, no sampling processors:
        ``vllm/v1/worker/gpu_model_runner.py``, ``_get_prompt_logprobs_dict``),
        as Tunix's vanilla rollout does.

        Args:
            prompt_tokens: ``[B, P]`` left-padded prompt ids.
            completion_tokens: ``[B, C]`` right-padded completion ids.
            *args, **kwargs: accepted and ignored (other rollouts' extras).

        Returns:
            A float32 ``jax.Array`` ``[B, C]``: each completion token's
            logprob, 0.0 at pad positions. A logprob of ``-inf`` comes back
            as vLLM's ``-9999.0``.

        Raises:
            ValueError: shapes that do not match, or a row whose prompt is
                all padding (its first token has no logprob).
            SendError, UpdateIncomplete: the push in flight failed.
            VLLMHTTPError, VLLMTimeout, VLLMProtocolError: as ``generate``.
        """
        self._check_open()
        self.wait_for_push()
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if prompts.ndim != 2 or completions.ndim != 2 or prompts.shape[0] != completions.shape[0]:
            raise ValueError(f"prompt_tokens [B, P] and completion_tokens [B, C] must be 2-D with "
                             f"the same B, got {prompts.shape} and {completions.shape}")
        out = np.zeros(completions.shape, dtype=np.float32)
        sequences, rows = _sequences(prompts, completions, self.pad_id())
        if not sequences:
            return jnp.asarray(out)
        body = {"echo": True, "max_tokens": 0, "prompt_logprobs": 0, "return_token_ids": True}
        answered = self._complete(sequences, body, per_prompt=1)
        for k, ((b, cols, start), seq, (where, choice)) in enumerate(zip(rows, sequences, answered)):
            out[b, cols] = answers.prompt_logprobs(choice, seq, start, k, where)
        return jnp.asarray(out)

    def pad_id(self) -> int:
        """The pad token id (given, else the tokenizer's)."""
        return self._token_id(self._pad_id, "pad_id")

    def eos_id(self) -> int:
        """The end-of-sequence token id (given, else the tokenizer's)."""
        return self._token_id(self._eos_id, "eos_id")

    def _token_id(self, given: int | None, name: str) -> int:
        """``given``, else the tokenizer's method ``name`` (also the keyword to give)."""
        if given is not None:
            return int(given)
        if self._tokenizer is None:
            raise ValueError(f"VLLMServerRollout has no tokenizer: give {name}=")
        return int(getattr(self._tokenizer, name)())

    def _has_eos(self) -> bool:
        return self._eos_id is not None or self._tokenizer is not None

    def model(self) -> None:
        """None: the model lives in the servers, so ``RLCluster`` syncs weights
        through ``update_params`` (and must not offload it: leave
        ``ClusterConfig.offload_to_cpu`` False)."""
        return None

    # -- HTTP ---------------------------------------------------------------------
    def _prompt_field(self, prompts: Sequence[Any]) -> tuple[list[list[int]] | None, list[Any]]:
        """The prompts' token ids (None when the server tokenizes) and the
        ``prompt`` list sent."""
        if all(isinstance(p, str) for p in prompts):
            if self._tokenizer is None:
                return None, list(prompts)
            ids = [self._tokenize(p) for p in prompts]
        elif any(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be all strings or all token-id sequences")
        else:
            ids = [_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {i} is empty: vLLM refuses an empty prompt")
        return ids, ids

    def _tokenize(self, text: str) -> list[int]:
        """``VllmSampler.tokenize`` (tunix/generate/vllm_sampler.py): the ids, a BOS in front."""
        tok = self._tokenizer
        ids = [int(t) for t in tok.encode(text)]
        bos = tok.bos_id()
        return [int(t) for t in tok.dedup_bos_ids(([bos] if bos else []) + ids)]

    def _complete(self, prompts: list[Any], body: dict[str, Any], *,
                  per_prompt: int) -> list[tuple[str, dict[str, Any]]]:
        """Every prompt's choices (``per_prompt`` each, prompt by prompt), each
        with the URL that answered it, from requests split between the
        servers and sent at once, all within ``timeout_s``."""
        deadline = Deadline(self._timeout_s)
        shards = np.array_split(np.arange(len(prompts)), len(self._clients))
        jobs: list[tuple[int, int, VLLMClient]] = []
        for client, shard in zip(self._clients, shards):
            for lo in range(0, len(shard), self._max_prompts):
                part = shard[lo:lo + self._max_prompts]
                jobs.append((int(part[0]), int(part[-1]) + 1, client))
        futures = [self._pool.submit(self._post, client, prompts[a:b], body, deadline,
                                     (b - a) * per_prompt)
                   for a, b, client in jobs]
        done, _ = concurrent.futures.wait(futures, timeout=deadline.left() + 1.0,
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futures:
            if f in done and f.exception() is not None:
                for g in futures:
                    g.cancel()
                raise f.exception()
        if len(done) < len(futures):
            for g in futures:
                g.cancel()
            raise VLLMTimeout(f"POST {ROUTE}: the batch did not complete within "
                              f"{self._timeout_s:g} s", ROUTE)
        return [(client.base_url, c) for (_, _, client), f in zip(jobs, futures)
                for c in f.result()]

    def _post(self, client: VLLMClient, prompts: list[Any], body: dict[str, Any],
              deadline: Deadline, want: int) -> list[dict[str, Any]]:
        left = deadline.left()
        if not left:
            raise VLLMTimeout(f"POST {client.base_url}{ROUTE}: no time left of the "
                              f"{self._timeout_s:g} s for the whole batch", ROUTE)
        request = dict(body, prompt=prompts)
        if self._model_name is not None:
            request["model"] = self._model_name
        answer = client.request("POST", ROUTE, json=request, timeout=left)
        return answers.ordered_choices(answer, want, client.base_url)

    # -- lifetime --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this VLLMServerRollout is closed")

    def close(self) -> None:
        """Let a push in flight end, close the sender (if this rollout
        connected it) and the HTTP clients. Calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, None
        try:
            if pending is not None:
                try:
                    self._settle(pending, self._pending_version)
                except Exception as e:  # noqa: BLE001 - closing anyway
                    log.warning("the last weight push failed: %s", e)
            if self._owns_sender and self._sender is not None:
                self._sender.close()
        finally:
            self._close_http()

    def _close_http(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._clients:
            client.close()

    def __enter__(self) -> VLLMServerRollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VLLMServerRollout({self._urls!r})"


# -- reading vLLM's answers ----------------------------------------------------------

# Older Flax kept a state's leaves as ``VariableState``\ s (a deprecated alias of
# ``Variable`` now, read from the module's dict so as not to warn).
_VARIABLE_TYPES = tuple(t for t in (nnx.Variable, vars(nnx).get("VariableState"))
                        if isinstance(t, type))


def _sequences(prompts: np.ndarray, completions: np.ndarray, pad: int
               ) -> tuple[list[list[int]], list[tuple[int, np.ndarray, int]]]:
    """Each row with a completion token, as Tunix's ``process_ids`` reads it
    (pads anywhere are not part of it): the sequence sent, and (its row, the
    completion's columns, where the completion starts in the sequence)."""
    sequences: list[list[int]] = []
    rows: list[tuple[int, np.ndarray, int]] = []
    for b in range(prompts.shape[0]):
        keep = completions[b] != pad
        if not keep.any():
            continue
        prompt = _ids(prompts[b][prompts[b] != pad], f"prompt_tokens[{b}]")
        if not prompt:
            raise ValueError(f"prompt_tokens[{b}] is all padding: the first completion "
                             "token would have no logprob")
        sequences.append(prompt + _ids(completions[b][keep], f"completion_tokens[{b}]"))
        rows.append((b, np.flatnonzero(keep), len(prompt)))
    return sequences, rows


def _leaves(tree: Any) -> list[Any]:
    """The tree's leaves, NNX variables kept whole (their type tells LoRA)."""
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, _VARIABLE_TYPES))


def _checked(urls: list[str], mapping: Mapping | None, sender: WeightSender | None,
             timeout_s: Any, max_prompts: Any, pause: Any) -> Mapping:
    """The rollout's settings, refused before anything connects; the mapping
    (the sender's, when only a sender is given)."""
    if not urls:
        raise ValueError("VLLMServerRollout needs the vLLM server URL(s) for the "
                         "completions route")
    if sender is not None and mapping is None:
        mapping = sender.mapping
    if not isinstance(mapping, Mapping):
        raise ValueError(f"mapping must be a jax_sender Mapping (e.g. TUNIX_QWEN3), got "
                         f"{mapping!r}")
    if sender is not None and sender.mapping is not mapping:
        raise ValueError("the sender was connected with another mapping than mapping=: "
                         "give the sender alone (its mapping names the push)")
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float))
                                           and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s must be a number of seconds above 0 and at most "
                         f"{MAX_TIMEOUT_S:g}, got {timeout_s!r}")
    if not (isinstance(max_prompts, int) and max_prompts >= 1):
        raise ValueError(f"max_prompts_per_request must be a positive int, got {max_prompts!r}")
    if pause not in (None, "abort", "wait", "keep"):
        raise ValueError(f"pause must be 'abort', 'wait', 'keep' or None, got {pause!r}")
    return mapping

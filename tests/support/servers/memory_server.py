"""An independent vLLM receiver for the CPU tests, written from vLLM 0.33.0's code.

Why a second receiver: the older ``support.servers.memory_link.MemoryServer`` cuts
chunks with the library's own ``plan_chunks`` and parses payloads with the
library's own ``UpdateInfo``, so a wrong rule in the library agrees with
itself and every send test passes. Nothing here imports ``jax_sender`` or
``uniqueid``: every rule below was read from vLLM 0.33.0's source (file and
function cited where the rule is applied), with the few **[newer]** additions
(``update_info.src``) taken from the newer pages of vLLM's NCCL
weight-transfer engine (trainer and worker).

``MemoryServer`` serves vLLM's weight-transfer routes over real HTTP on
loopback (one process standing for all of a deployment's workers, which
hold identical tensors), and its ``/update_weights`` receives like a worker:
from an in-memory wire that a test or a sender's broadcaster feeds with one
``(root, data, taken)`` item per NCCL broadcast.

Deliberate departures from vLLM, each turning a silent hang or a silent
misload into a fast, named HTTP 500 (the session dropped, as vLLM drops it on
any worker error):

* an update whose three lists are empty with no earlier metadata since the
  last init (vLLM 0.33.0 receives nothing and answers 200, leaving the trainer
  blocked in its broadcast);
* a broadcast that does not arrive within ``WIRE_TIMEOUT_S`` (NCCL would wait);
* a broadcast whose root or byte length differs from what the metadata says
  (NCCL would hang or load garbage);
* payload values of the wrong JSON type, which vLLM's dataclasses do not
  check (``"packed": "false"`` is truthy there);
* a worker rank outside ``world_size`` (NCCL's ``ncclInvalidArgument``), or a
  ``rank_offset`` below 1 (a second rank 0: NCCL would wait forever);
* a dtype outside the nine in ``TORCH_DTYPES`` (torch knows more).

A ``world_size`` larger than ``rank_offset + workers`` is only recorded: vLLM
cannot see it either (NCCL init hangs).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import ml_dtypes
import numpy as np

from support.servers.recorder import JSONHandler, answer, serve

# vllm/distributed/weight_transfer/packed_tensor.py: DEFAULT_PACKED_BUFFER_SIZE_BYTES,
# DEFAULT_PACKED_NUM_BUFFERS (the worker-side init info's defaults, nccl_common.py).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
# vllm/distributed/device_communicators/pynccl_wrapper.py: NCCL_UNIQUE_ID_BYTES.
NCCL_UNIQUE_ID_BYTES = 128
# vllm/v1/engine/core.py: EngineCore.__init__ sets ``self._weight_version = "default"``.
INITIAL_WEIGHT_VERSION = "default"
WIRE_TIMEOUT_S = 10.0
HOLD_TIMEOUT_S = 60.0

# torch dtype name (what ``getattr(torch, dtype_name)`` resolves in vLLM) ->
# (numpy dtype, torch's ScalarType name, as torch's error messages print it).
TORCH_DTYPES: dict[str, tuple[np.dtype, str]] = {
    "int8": (np.dtype(np.int8), "Char"),
    "uint8": (np.dtype(np.uint8), "Byte"),
    "int32": (np.dtype(np.int32), "Int"),
    "int64": (np.dtype(np.int64), "Long"),
    "float16": (np.dtype(np.float16), "Half"),
    "float32": (np.dtype(np.float32), "Float"),
    "float64": (np.dtype(np.float64), "Double"),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), "BFloat16"),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), "Float8_e4m3fn"),
}
FLOATING = {"float16", "float32", "float64", "bfloat16", "float8_e4m3fn"}
_FLOATING_NP = {TORCH_DTYPES[k][0] for k in FLOATING}

# vllm/distributed/weight_transfer/nccl_common.py: NCCLWeightTransferInitInfo's fields
# (kw_only; rank_offset and world_size have no default).
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
               "packed", "packed_buffer_size_bytes", "packed_num_buffers")
INIT_REQUIRED = ("rank_offset", "world_size")
# nccl_engine.py: NCCLWeightTransferUpdateInfo (all defaulted); ``src`` is [newer].
DENSE_FIELDS = ("names", "dtype_names", "shapes", "src")
# sparse_nccl_engine.py: SparseNCCLWeightTransferUpdateInfo (all required, positional).
SPARSE_FIELDS = ("names", "dtype_names", "shapes", "num_updates_list")

# vllm/entrypoints/rl/online/api_router.py (plus /version from the serve router):
# path -> the one HTTP method it is routed for.
ROUTES = {
    "/pause": "POST", "/resume": "POST", "/abort_requests": "POST", "/is_paused": "GET",
    "/init_weight_transfer_engine": "POST", "/shutdown_weight_transfer_engine": "POST",
    "/start_weight_update": "POST", "/update_weights": "POST", "/finish_weight_update": "POST",
    "/update_weight_version": "POST", "/weight_info": "GET", "/weight_checker": "POST",
    "/get_world_size": "GET", "/version": "GET",
}
_BAD_JSON = object()


@dataclass
class Call:
    """One request, logged on arrival (before any processing) and completed
    when answered, so the log's order is the order requests arrived in."""

    path: str
    body: Any  # parsed JSON, or None (no body, or not JSON)
    arrived: float  # time.monotonic()
    answered: float | None = None
    status: int | None = None
    query: str = ""


class _Answer(Exception):
    """An HTTP answer other than the route's normal one (raised by FastAPI-level checks)."""

    def __init__(self, status: int, body: dict):
        super().__init__(status, body)
        self.status, self.body = status, body


def error_body(status: int, message: str, err_type: str | None = None,
               param: str | None = None) -> dict:
    """vLLM's ``ErrorResponse`` (vllm/entrypoints/serve/engine/protocol.py: ErrorInfo has
    message, type, param, code; ``model_dump`` keeps ``param`` as null)."""
    if err_type is None:
        err_type = "InternalServerError" if status == 500 else HTTPStatus(status).phrase
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _http_exception(status: int, detail: str) -> _Answer:
    # serve/exception_handling/handlers/http.py: http_exception_handler (type = the phrase).
    return _Answer(status, error_body(status, detail, HTTPStatus(status).phrase))


def _validation(loc: str, msg: str, kind: str, value: Any = None) -> _Answer:
    """FastAPI's RequestValidationError as vLLM answers it: 400, not FastAPI's 422
    (serve/exception_handling/handlers/validation.py: validation_exception_handler)."""
    err = {"type": kind, "loc": loc, "msg": msg, "input": value}
    return _Answer(400, error_body(400, f"1 validation error:\n  {err}", "Bad Request", loc))


def _missing_args(cls: str, names: list[str], kind: str) -> TypeError:
    """The TypeError Python raises for ``cls(**d)`` with required fields missing."""
    quoted = [f"'{n}'" for n in names]
    listed = quoted[0] if len(quoted) == 1 else (
        f"{quoted[0]} and {quoted[1]}" if len(quoted) == 2
        else ", ".join(quoted[:-1]) + f", and {quoted[-1]}")
    plural = "argument" if len(names) == 1 else "arguments"
    return TypeError(f"{cls}.__init__() missing {len(names)} required {kind} {plural}: {listed}")


def _construct(cls: str, engine: str, what: str, payload: dict, fields: tuple[str, ...],
               required: tuple[str, ...], kind: str) -> dict:
    """``self.<what>_cls(**payload)`` as vLLM's base.py parse_init_info / parse_update_info
    run it: a TypeError (unknown or missing key) becomes ``ValueError("Invalid
    <what> for <Engine>: ...")``; Python reports unknown keywords before missing ones."""
    try:
        for key in payload:
            if key not in fields:
                raise TypeError(f"{cls}.__init__() got an unexpected keyword argument '{key}'")
        missing = [k for k in required if k not in payload]
        if missing:
            raise _missing_args(cls, missing, kind)
    except TypeError as e:
        raise ValueError(f"Invalid {what} for {engine}: {e}") from e
    return dict(payload)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need_type(name: str, value: Any, ok: bool, want: str) -> None:
    """Stricter than vLLM (its dataclasses check no types): fail at parse, clearly."""
    if not ok:
        raise TypeError(f"{name} must be {want}, got {value!r}")


def torch_dtype(name: Any) -> tuple[np.dtype, str]:
    """``getattr(torch, dtype_name)`` as nccl_engine.py / sparse_nccl_engine.py resolve
    it, limited to the dtypes this server models."""
    if not isinstance(name, str) or name not in TORCH_DTYPES:
        raise AttributeError(f"module 'torch' has no attribute {name!r} "
                             f"(this memory server models only {sorted(TORCH_DTYPES)})")
    return TORCH_DTYPES[name]


def check_shape(shape: Any) -> tuple[int, ...]:
    """``torch.empty(shape)``: a list of non-negative ints (torch's message)."""
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise TypeError(f"empty(): argument 'size' must be a list of ints, got {shape!r}")
    if any(d < 0 for d in shape):
        raise RuntimeError(f"Trying to create tensor with negative dimension "
                           f"{min(shape)}: {shape}")
    return tuple(shape)


def decode_unique_id(master_address: Any, master_port: Any, uid_b64: Any) -> bytes | None:
    """vllm/distributed/weight_transfer/nccl_common.py: decode_nccl_unique_id, run by
    NCCLWeightTransferInitInfo.__post_init__ (so its ValueErrors are not wrapped)."""
    ctx = "NCCLWeightTransferInitInfo"
    has_uid = bool(uid_b64)
    has_addr, has_port = master_address is not None, master_port is not None
    if has_uid and (has_addr or has_port):
        raise ValueError(f"{ctx}: pass nccl_unique_id_b64 OR master_address/master_port, not both")
    if not has_uid:
        if not (has_addr and has_port):
            raise ValueError(f"{ctx}: need nccl_unique_id_b64, or both master_address and "
                             f"master_port (got master_address={master_address!r}, "
                             f"master_port={master_port!r})")
        return None
    try:  # pybase64.b64decode(validate=True): standard alphabet, padding, no whitespace
        decoded = base64.b64decode(uid_b64, validate=True)
    except (ValueError, TypeError, binascii.Error) as e:
        raise ValueError(f"{ctx}: nccl_unique_id_b64 is not valid standard base64 "
                         f"(URL-safe base64 is not accepted)") from e
    if len(decoded) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"{ctx}: nccl_unique_id_b64 must decode to {NCCL_UNIQUE_ID_BYTES} "
                         f"bytes, got {len(decoded)}")
    return decoded


def cut_chunks(sizes: list[int], buffer_size_bytes: int) -> list[list[int]]:
    """Tensor indices per packed broadcast, by packed_tensor.py:
    packed_nccl_broadcast_consumer's rule: add the tensor, then close the chunk if
    the running total is strictly greater than the buffer size; a tensor is never
    split; what is left at the end is one last chunk (none if nothing is left)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > buffer_size_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


@dataclass
class _Tensor:
    name: str
    dtype_name: str
    dtype: np.dtype
    torch_name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class MemoryServer:
    """vLLM's weight-transfer routes over loopback HTTP, receiving from ``wire``.

    ``workers``: how many workers the deployment has (``/get_world_size``, the
    checksum keys ``tp0..``, and the ranks ``rank_offset + w`` that must fit in
    ``world_size``); they all hold ``store``. ``sparse``: the ``sparse_nccl``
    backend instead of ``nccl``. ``fail`` maps a path to a status answered
    instead (a ``/update_weights`` in an active session first takes the call's
    broadcasts and loads them, like a ``load_weights`` that raises after the
    bytes, then drops the session); ``hold`` maps a path to an event its handler
    waits on (up to 60 s) after logging the arrival, before anything else;
    ``stall`` maps a path to an event its handler waits on after doing its
    work (taking the bytes, say), before answering. ``port``: the loopback
    port to serve on (0: a free one; a server restarted where it was).
    """

    def __init__(self, wire: queue.Queue, *, workers: int = 1, sparse: bool = False,
                 port: int = 0):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.wire, self.workers, self.sparse = wire, workers, sparse
        self.engine_name = "SparseNCCLWeightTransferEngine" if sparse else "NCCLWeightTransferEngine"
        self.fail: dict[str, int] = {}
        self.hold: dict[str, threading.Event] = {}
        self.stall: dict[str, threading.Event] = {}
        self.log: list[Call] = []
        self.store: dict[str, np.ndarray] = {}
        self.active = False
        self.initialized = False
        self.init_infos: list[dict] = []
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.paused = False
        # engine state set at init (nccl_engine.py: NCCLWeightTransferEngine.__init__ /
        # init_transfer_engine)
        self.rank_offset = 1
        self.packed = False
        self.packed_buffer_size_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.packed_num_buffers = DEFAULT_PACKED_NUM_BUFFERS
        self._last: dict[int, list[_Tensor]] = {}  # src -> last metadata (the reuse state)
        # A worker runs one RPC at a time (collective_rpc is queued to each worker
        # process); engine-level routes (/is_paused, /pause, ...) do not wait on it.
        self._rpc = threading.Lock()
        self._state = threading.Lock()  # the log, pause flag, weight version, connections
        self._connections: set[socket.socket] = set()
        self.http, self.url = serve(self._handler(), port)

    def _handler(self) -> type[JSONHandler]:
        """The request handler: logs each call, applies ``hold``, ``fail`` and
        ``stall``, answers like vLLM's router; tracks its connection (``kill``)."""
        server = self

        class Handler(JSONHandler):
            def setup(self) -> None:
                super().setup()
                with server._state:
                    server._connections.add(self.connection)

            def finish(self) -> None:
                with server._state:
                    server._connections.discard(self.connection)
                super().finish()

            def _do(self) -> None:
                raw = self.body()
                split = urlsplit(self.path)
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = _BAD_JSON
                call = Call(split.path, None if body is _BAD_JSON else body, time.monotonic(),
                            query=split.query)
                with server._state:
                    server.log.append(call)
                event = server.hold.get(call.path)
                if event is not None:
                    event.wait(HOLD_TIMEOUT_S)
                try:
                    status, out = server._route(self.command, call, body, parse_qs(split.query))
                except _Answer as a:
                    status, out = a.status, a.body
                except Exception as e:  # a bug here: still answer, like FastAPI's safety net
                    status, out = 500, error_body(500, f"{type(e).__name__}: {e}")
                stall = server.stall.get(call.path)
                if stall is not None:  # done, but the answer never comes (a stuck loader)
                    stall.wait(HOLD_TIMEOUT_S)
                call.status, call.answered = status, time.monotonic()
                answer(self, status, out)

            do_GET = do_POST = do_PUT = do_DELETE = _do

        return Handler

    # ---- the log ---------------------------------------------------------

    def routes(self) -> list[str]:
        """Paths in arrival order."""
        with self._state:
            return [c.path for c in self.log]

    def close(self) -> None:
        """Release held handlers and stop serving. ``serve_forever`` notices a
        shutdown only at its next 0.5 s poll, so the wait happens on a thread:
        a test's teardown does not pay it."""
        for event in [*self.hold.values(), *self.stall.values()]:
            event.set()

        def stop() -> None:
            self.http.shutdown()
            self.http.server_close()

        threading.Thread(target=stop, daemon=True).start()

    def kill(self) -> None:
        """Gone at once, as a SIGKILLed vLLM: the port refuses connections and
        every open connection is reset (``close`` lets kept ones serve on)."""
        for event in [*self.hold.values(), *self.stall.values()]:
            event.set()
        self.http.shutdown()
        self.http.server_close()
        with self._state:
            open_now = list(self._connections)
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    # ---- HTTP layer (api_router.py) ---------------------------------------

    def _route(self, method: str, call: Call, body: Any, query: dict[str, list[str]]) -> tuple[int, Any]:
        path = call.path
        if path not in ROUTES:  # Starlette's own 404/405 (FastAPI's default handler)
            return 404, {"detail": "Not Found"}
        if method != ROUTES[path]:
            return 405, {"detail": "Method Not Allowed"}
        if body is _BAD_JSON:
            raise _validation("body", "JSON decode error", "json_invalid")
        if path in self.fail:
            return self._injected(path, body)
        handler = getattr(self, "_r_" + path.strip("/"))
        return handler(body, query)

    def _injected(self, path: str, body: Any) -> tuple[int, dict]:
        status = self.fail[path]
        if path == "/update_weights" and self.active:
            info = body.get("update_info") if isinstance(body, dict) else None
            if info is not None:
                try:  # the bytes first, as a load_weights that raises after them
                    self._collective(lambda: self._worker_update_weights(info))
                except _Answer:
                    pass
            with self._rpc:  # gpu_worker.py: update_weights drops the session on any error
                self.active = False
        return status, error_body(status, self._rpc_message(f"injected failure of {path}"))

    def _rpc_message(self, message: str) -> str:
        """How a worker's exception reaches the HTTP answer: the executor (with more
        than one worker, v1/executor/multiproc_executor.py: collective_rpc) and then
        the engine core (v1/engine/core.py: _invoke_utility_method) wrap its text;
        the client re-raises a plain Exception, which serve/exception_handling's
        create_error_response turns into 500 InternalServerError."""
        if self.workers > 1:
            message = (f"Worker failed with error '{message}', please check the"
                       " stack trace above for the root cause")
        return f"Call to collective_rpc method failed: {message}"

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as every worker would (one RPC at a time); an exception is 500."""
        with self._rpc:
            try:
                return fn()
            except Exception as e:
                raise _Answer(500, error_body(500, self._rpc_message(str(e)))) from e

    @staticmethod
    def _embedded(body: Any, key: str, required: bool = True) -> Any:
        """``Body(embed=True)``: the value under ``key`` of a JSON object."""
        if body is None or (isinstance(body, dict) and key not in body):
            if required:
                raise _validation(f"body.{key}", "Field required", "missing")
            return None
        if not isinstance(body, dict):
            raise _validation("body", "Input should be a valid dictionary", "dict_type", body)
        return body[key]

    @staticmethod
    def _query_bool(query: dict[str, list[str]], key: str, default: bool) -> bool:
        if key not in query:
            return default
        value = query[key][-1].lower()
        if value in ("1", "true", "t", "yes", "y", "on"):
            return True
        if value in ("0", "false", "f", "no", "n", "off"):
            return False
        raise _validation(f"query.{key}", "Input should be a valid boolean", "bool_parsing", value)

    def _r_pause(self, body: Any, query: dict[str, list[str]]) -> tuple[int, dict]:
        # mode: Annotated[PauseMode, Query()] = "abort"; PauseMode = Literal["abort", "wait", "keep"]
        mode = query.get("mode", ["abort"])[-1]
        if mode not in ("abort", "wait", "keep"):
            raise _validation("query.mode", "Input should be 'abort', 'wait' or 'keep'",
                              "literal_error", mode)
        self._query_bool(query, "clear_cache", True)
        with self._state:
            self.paused = True
        return 200, {"status": "paused"}

    def _r_resume(self, body: Any, query: dict) -> tuple[int, dict]:
        with self._state:
            self.paused = False
        return 200, {"status": "resumed"}

    def _r_abort_requests(self, body: Any, query: dict) -> tuple[int, dict]:
        if body is not None and not isinstance(body, dict):
            raise _http_exception(400, "Request body must be a JSON object")
        ids = (body or {}).get("request_ids") or []
        return 200, {"status": "aborted", "aborted": len(ids)}

    def _r_is_paused(self, body: Any, query: dict) -> tuple[int, dict]:
        with self._state:
            return 200, {"is_paused": self.paused}

    def _r_version(self, body: Any, query: dict) -> tuple[int, dict]:
        return 200, {"version": "0.33.0"}

    def _r_get_world_size(self, body: Any, query: dict) -> tuple[int, dict]:
        # TP * PP (* DP, which is 1 here): every worker this server stands for.
        self._query_bool(query, "include_dp", True)
        return 200, {"world_size": self.workers}

    def _r_weight_info(self, body: Any, query: dict) -> tuple[int, dict]:
        with self._state:
            return 200, {"weight_version": self.weight_version}

    def _r_update_weight_version(self, body: Any, query: dict) -> tuple[int, dict]:
        version = self._embedded(body, "new_version")
        if not isinstance(version, str):
            raise _validation("body.new_version", "Input should be a valid string", "string_type",
                              version)
        with self._state:
            self.weight_version = version
        return 200, {"success": True, "new_version": version}

    def _r_init_weight_transfer_engine(self, body: Any, query: dict) -> tuple[int, dict]:
        info = self._embedded(body, "init_info")  # Annotated[dict[str, Any], Body(embed=True)]
        if not isinstance(info, dict):
            raise _validation("body.init_info", "Input should be a valid dictionary", "dict_type", info)
        self.init_infos.append(info)
        self._collective(lambda: self._worker_init(info))
        return 200, {"message": "Weight transfer initialized"}

    def _r_shutdown_weight_transfer_engine(self, body: Any, query: dict) -> tuple[int, dict]:
        self._collective(self._worker_shutdown)
        return 200, {"message": "Weight transfer shut down"}

    def _r_start_weight_update(self, body: Any, query: dict) -> tuple[int, dict]:
        self._collective(self._worker_start)
        return 200, {"message": "Weight update started"}

    def _r_update_weights(self, body: Any, query: dict) -> tuple[int, dict]:
        # Annotated[WeightTransferUpdatePayload, Body(embed=True)]: dict | list[dict]
        info = self._embedded(body, "update_info")
        if not (isinstance(info, dict) or (isinstance(info, list)
                                           and all(isinstance(i, dict) for i in info))):
            raise _validation("body.update_info", "Input should be a valid dictionary or list",
                              "dict_type", info)
        self._collective(lambda: self._worker_update_weights(info))
        return 200, {"message": "Weights updated"}

    def _r_finish_weight_update(self, body: Any, query: dict) -> tuple[int, dict]:
        version = self._embedded(body, "weight_version", required=False)
        if version is not None and not isinstance(version, str):
            raise _validation("body.weight_version", "Input should be a valid string",
                              "string_type", version)
        self._collective(self._worker_finish)
        # v1/engine/async_llm.py: finish_weight_update sets the version after the RPC.
        if version is not None:
            with self._state:
                self.weight_version = version
        return 200, {"message": "Weight update finished"}

    def _r_weight_checker(self, body: Any, query: dict) -> tuple[int, dict]:
        action = self._embedded(body, "action")
        if action not in ("checksum", "reset", "compare"):
            raise _validation("body.action", "Input should be 'checksum', 'reset' or 'compare'",
                              "literal_error", action)
        baseline = self._embedded(body, "baseline", required=False)
        if baseline is not None and not (isinstance(baseline, dict) and all(
                isinstance(v, str) for v in baseline.values())):
            raise _validation("body.baseline", "Input should be a valid dictionary of strings",
                              "dict_type", baseline)
        if action == "reset":  # collective_rpc("reset_weights") -> weight_checksum.py: zero_weights
            self._collective(self._worker_reset)
            return 200, {"status": "reset"}
        if action == "compare" and baseline is None:
            raise _http_exception(400, "action='compare' requires a 'baseline' object")
        checksums = self._collective(self._worker_checksums)
        if action == "checksum":
            return 200, {"checksums": checksums}
        mismatches = sorted(k for k in checksums.keys() | baseline.keys()
                            if checksums.get(k) != baseline.get(k))
        return 200, {"match": not mismatches, "mismatches": mismatches}

    # ---- the worker (v1/worker/gpu_worker.py) ------------------------------

    def _worker_init(self, payload: dict) -> None:
        """gpu_worker.py: init_weight_transfer_engine -> base.py: parse_init_info ->
        <engine>.init_transfer_engine."""
        info = _construct("NCCLWeightTransferInitInfo", self.engine_name, "init_info", payload,
                          INIT_FIELDS, INIT_REQUIRED, "keyword-only")
        info.setdefault("packed", False)  # the worker-side default (nccl_common.py)
        info.setdefault("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        info.setdefault("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)
        decode_unique_id(info.get("master_address"), info.get("master_port"),
                         info.get("nccl_unique_id_b64"))
        for key in ("rank_offset", "world_size", "packed_buffer_size_bytes", "packed_num_buffers"):
            _need_type(key, info[key], _is_int(info[key]), "an int")
        _need_type("packed", info["packed"], isinstance(info["packed"], bool), "a bool")
        if not self.sparse:
            # nccl_engine.py: init_transfer_engine records the wire params and clears
            # the metadata kept for reuse, before it joins the group.
            self.rank_offset = info["rank_offset"]
            self.packed = info["packed"]
            self.packed_buffer_size_bytes = info["packed_buffer_size_bytes"]
            self.packed_num_buffers = info["packed_num_buffers"]
            self._last.clear()
        # nccl_common.py: worker_init_process_group, rank = rank_offset + worker index;
        # ncclCommInitRank refuses a rank outside [0, world_size).
        if info["rank_offset"] < 1:  # NCCL would wait for a second rank 0 forever
            raise RuntimeError(f"rank_offset must be >= 1 (the trainer is rank 0), "
                               f"got {info['rank_offset']}")
        if info["rank_offset"] + self.workers - 1 >= info["world_size"]:
            raise RuntimeError("NCCL error: invalid argument (run with NCCL_DEBUG=WARN for details)")
        self.rank_offset = info["rank_offset"]
        self.initialized = True

    def _worker_shutdown(self) -> None:
        """gpu_worker.py: shutdown_weight_transfer_engine; <engine>.shutdown drops the group
        (the next init clears the reuse metadata; forgotten here already)."""
        if self.active:
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        self.initialized = False
        self._last.clear()

    def _worker_start(self) -> None:
        """gpu_worker.py: _start_weight_update (the engine is configured at launch, so no
        init is needed to start)."""
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        self.active = True

    def _worker_finish(self) -> None:
        """gpu_worker.py: finish_weight_update."""
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.active = False

    def _worker_update_weights(self, update_info: dict | list[dict]) -> None:
        """gpu_worker.py: update_weights: refused outside a session; any error in the
        engine drops the session."""
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            if isinstance(update_info, list):
                # indexed by global worker rank (dp_index * world_size + rank); one
                # wire feeds every worker here, so they must all be given the same.
                local = [update_info[w] for w in range(self.workers)]
                if any(x != local[0] for x in local):
                    raise ValueError("per-worker update_info entries differ; this memory server "
                                     "feeds every worker from one wire")
                update_info = local[0]
            # base.py: WeightTransferEngine.update_weights = parse_update_info + receive_weights
            if self.sparse:
                self._receive_sparse(update_info)
            else:
                self._receive_dense(update_info)
        except BaseException:
            self.active = False
            raise

    def _parse_dense(self, payload: dict) -> tuple[list[_Tensor] | None, list, int]:
        """base.py: parse_update_info + nccl_engine.py: NCCLWeightTransferUpdateInfo.__post_init__.
        Dtypes resolve later, one tensor at a time, as receive_weights resolves them."""
        info = _construct("NCCLWeightTransferUpdateInfo", self.engine_name, "update_info", payload,
                          DENSE_FIELDS, (), "positional")
        names, dtype_names = info.get("names", []), info.get("dtype_names", [])
        shapes, src = info.get("shapes", []), info.get("src", 0)
        for key, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
            _need_type(key, value, isinstance(value, list), "a list")
        if len(dtype_names) != len(names):
            raise ValueError(f"`dtype_names` should be of the same size as `names`: "
                             f"got {len(dtype_names)} and {len(names)}")
        if len(shapes) != len(names):
            raise ValueError(f"`shapes` should be of the same size as `names`: "
                             f"got {len(shapes)} and {len(names)}")
        _need_type("src", src, _is_int(src), "an int")
        for n in names:
            _need_type("names entries", n, isinstance(n, str), "strings")
        return names, list(zip(names, dtype_names, shapes)), src

    def _receive_dense(self, payload: dict) -> None:
        """nccl_engine.py: NCCLWeightTransferEngine.receive_weights."""
        names, rows, src = self._parse_dense(payload)
        if not self.initialized:
            raise RuntimeError("NCCL weight transfer not initialized. "
                               "Call init_transfer_engine() first.")
        if not 0 <= src < self.rank_offset:  # [newer] receive_weights
            raise ValueError(f"NCCL update src must be a sender rank in [0, {self.rank_offset}), "
                             f"got {src!r}.")
        # Empty lists reuse the previous call's metadata (per src [newer]); the
        # metadata is kept before any broadcast, so a failed call still sets it.
        if names:
            self._last[src] = rows
        elif src in self._last:
            rows = self._last[src]
        else:
            raise RuntimeError(
                "update_info lists no tensors and there is no earlier update since "
                "init_weight_transfer_engine to reuse: vLLM would receive nothing while the "
                "trainer broadcasts (a hang); refused here")
        if self.packed:
            self._receive_packed(rows, src)
        else:
            # one broadcast per tensor, its own dtype and shape; loaded as it lands
            for name, dtype_name, shape in rows:
                t = self._tensor(name, dtype_name, shape)
                data = self._take(t.nbytes, src)
                self.store[name] = np.frombuffer(data, t.dtype).reshape(t.shape).copy()

    def _tensor(self, name: str, dtype_name: Any, shape: Any) -> _Tensor:
        np_dtype, torch_name = torch_dtype(dtype_name)
        return _Tensor(name, dtype_name, np_dtype, torch_name, check_shape(shape))

    def _receive_packed(self, rows: list, src: int) -> None:
        """packed_tensor.py: packed_nccl_broadcast_consumer: metadata consumed lazily; a
        chunk is received once the tensor that takes its total strictly past the
        buffer size is added (or at the end), then unpack_tensor views every tensor
        at its offset (torch refuses a misaligned ``view(dtype)``) and load_weights
        gets the chunk. A bad dtype fails after the chunks before it were received,
        as the lazy iterator fails there. ``cut_chunks`` is the same rule, eagerly."""
        pending: list[_Tensor] = []
        total = 0
        for name, dtype_name, shape in rows:
            t = self._tensor(name, dtype_name, shape)
            pending.append(t)
            total += t.nbytes
            if total > self.packed_buffer_size_bytes:
                self._receive_chunk(pending, total, src)
                pending, total = [], 0
        if pending:
            self._receive_chunk(pending, total, src)

    def _receive_chunk(self, tensors: list[_Tensor], total: int, src: int) -> None:
        data = self._take(total, src)
        views = []
        offset = 0
        for t in tensors:  # unpack_tensor: split, then .view(dtype) of each piece
            ratio = t.dtype.itemsize
            if ratio > 1 and offset % ratio:
                raise RuntimeError(
                    f"self.storage_offset() must be divisible by {ratio} to view Byte as "
                    f"{t.torch_name} (different element sizes), but got {offset}")
            views.append((t, offset))
            offset += t.nbytes
        for t, off in views:  # post_unpack_func = model.load_weights
            count = math.prod(t.shape)
            self.store[t.name] = np.frombuffer(data, t.dtype, count=count, offset=off) \
                .reshape(t.shape).copy()

    def _receive_sparse(self, payload: dict) -> None:
        """sparse_nccl_engine.py: SparseNCCLWeightTransferEngine.receive_weights (per tensor
        two broadcasts from rank 0: int32 indices, then values, both ``num_updates``
        long), then checkpoint_weight_patch.py: load_checkpoint_weight_patches
        (validate every patch, then apply them in order)."""
        info = _construct("SparseNCCLWeightTransferUpdateInfo", self.engine_name, "update_info",
                          payload, SPARSE_FIELDS, SPARSE_FIELDS, "positional")
        names, dtype_names = info["names"], info["dtype_names"]
        shapes, counts = info["shapes"], info["num_updates_list"]
        for key, value in info.items():
            _need_type(key, value, isinstance(value, list), "a list")
        # SparseNCCLWeightTransferUpdateInfo.__post_init__
        if len(dtype_names) != len(names):
            raise ValueError(f"`dtype_names` should be of the same size as `names`: "
                             f"got {len(dtype_names)} and {len(names)}")
        if len(shapes) != len(names):
            raise ValueError(f"`shapes` should be of the same size as `names`: "
                             f"got {len(shapes)} and {len(names)}")
        if len(counts) == 0:
            raise ValueError("`num_updates_list` cannot be empty for sparse updates")
        if len(counts) != len(names):
            raise ValueError(f"`num_updates_list` should be of the same size as `names`: "
                             f"got {len(counts)} and {len(names)}")
        for n in counts:
            _need_type("num_updates_list entries", n, _is_int(n), "ints")
        if any(n < 0 for n in counts):
            raise ValueError("Sparse `num_updates_list` entries must be non-negative")
        if not self.initialized:
            raise RuntimeError("NCCL weight transfer not initialized. "
                               "Call init_transfer_engine() first.")
        patches = []
        for name, dtype_name, shape, n in zip(names, dtype_names, shapes, counts):
            np_dtype, _ = torch_dtype(dtype_name)
            indices = np.frombuffer(self._take(4 * n, 0), np.int32)
            values = np.frombuffer(self._take(n * np_dtype.itemsize, 0), np_dtype)
            patches.append((name, dtype_name, shape, indices, values))
        # load_checkpoint_weight_patches: _validate_patch_structure, then the NaN /
        # range / duplicate checks, all before anything is loaded
        for name, dtype_name, shape, _, _ in patches:
            if not name:
                raise ValueError("Checkpoint weight name must be non-empty")
            if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
                raise TypeError(f"{name}: shape must be a list of ints, got {shape!r}")
            if any(d < 0 for d in shape):
                raise ValueError(f"{name}: shape dimensions must be non-negative")
            if dtype_name not in FLOATING:
                raise TypeError(f"{name}: sparse checkpoint patches require a floating dtype "
                                "because NaN is the unchanged-value sentinel")
        for _, _, shape, indices, values in patches:
            numel = math.prod(shape)
            bad = bool(np.isnan(values.astype(np.float32)).any())
            if indices.size:
                bad = bad or bool(((indices < 0) | (indices >= numel)).any())
                bad = bad or np.unique(indices).size != indices.size
            if bad:
                raise ValueError("Sparse checkpoint patches contain NaN values, out-of-range "
                                 "indices, or duplicate indices")
        for name, dtype_name, shape, indices, values in patches:
            held = self.store.get(name)
            if held is None:
                held = np.zeros(shape, TORCH_DTYPES[dtype_name][0])
            elif held.shape != tuple(shape) or held.dtype not in _FLOATING_NP:
                # _load_nan_masked_weights: copy_non_nan_
                raise NotImplementedError("Sparse checkpoint patches require a same-shaped "
                                          "floating-point final copy")
            out = held.copy()
            out.reshape(-1)[indices.astype(np.int64)] = values.astype(out.dtype)
            self.store[name] = out

    def _take(self, nbytes: int, src: int) -> bytes:
        """One NCCL broadcast's receive: the next wire item, marked taken; its root
        must be the update's ``src`` and its length what the metadata says."""
        try:
            root, data, taken = self.wire.get(timeout=WIRE_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no broadcast arrived within {WIRE_TIMEOUT_S:g} s "
                               f"(expected {nbytes} bytes from root {src})") from None
        taken.set()
        data = bytes(data) if not isinstance(data, bytes) else data
        if root != src:
            raise RuntimeError(f"a broadcast from root {root}, expected root {src}")
        if len(data) != nbytes:
            raise RuntimeError(f"a broadcast of {len(data)} bytes, expected {nbytes} "
                               f"(the metadata and the sender disagree)")
        return data

    def _worker_checksums(self) -> dict[str, str]:
        """gpu_worker.py: compute_weight_checksums (prefix dp:pp:pcp:tp) with
        weight_checksum.py: compute_tensor_digests (sha256 of the C-order bytes)."""
        digests = {name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
                   for name, a in self.store.items()}
        return {f"dp0:pp0:pcp0:tp{w}:{name}": d
                for w in range(self.workers) for name, d in digests.items()}

    def _worker_reset(self) -> None:
        """weight_checksum.py: zero_weights."""
        for name, a in list(self.store.items()):
            self.store[name] = np.zeros_like(a)

"""A client for one vLLM server's weight-transfer routes.

One client per deployment (base URL). Bodies are exactly what vLLM's router
reads: each parameter embedded under its own name. Errors come back as
``VLLMHTTPError`` with vLLM's own message and status. Timeouts: a short
connect timeout, and read timeouts long enough for the call (an
``update_weights`` returns only after every tensor arrived).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx

from nccl_cffi.threads import run_in_thread

from .errors import RendezvousError

T = TypeVar("T")

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_TRANSFER_TIMEOUT = 1800.0


class VLLMHTTPError(RendezvousError):
    """A route answered with an error status; ``message`` is vLLM's text."""

    def __init__(self, route: str, status: int, message: str, body: Any = None):
        self.route, self.status, self.message, self.body = route, status, message, body
        hint = ""
        if status == 404:
            hint = (" (404: the server runs without VLLM_SERVER_DEV_MODE=1 or without "
                    "--weight-transfer-config '{\"backend\":\"nccl\"}')")
        super().__init__(f"{route} -> HTTP {status}: {message}{hint}")

    def __reduce__(self):
        return type(self), (self.route, self.status, self.message, self.body)


class VLLMConnectionError(RendezvousError, ConnectionError):
    """The server could not be reached or did not answer in time."""


def _error_message(resp: httpx.Response) -> tuple[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase, resp.text
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"]), body
        if err is not None:
            return str(err), body
    return str(body), body


def in_background(fn: Callable[..., T], *args: Any, name: str = "vllm-http") -> Future[T]:
    """Run ``fn`` on a kept daemon thread and return its future.

    Daemon, unlike an executor's worker: an HTTP call whose server is stuck in
    an NCCL call must not keep the interpreter from exiting. Kept: starting a
    thread per call costs the caller a wait for it (see ``nccl_cffi.threads``).
    """
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # delivered to the waiter
            fut.set_exception(e)

    run_in_thread(run, name)
    return fut


class VLLMClient:
    """vLLM's RL control plane at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 read_timeout: float = DEFAULT_READ_TIMEOUT,
                 transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
                 api_key: str | None = None, headers: dict[str, str] | None = None):
        self.base_url = base_url.rstrip("/")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.transfer_timeout = transfer_timeout
        hdrs = dict(headers or {})
        if api_key:
            hdrs["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=self.base_url, headers=hdrs,
                                  timeout=self._timeout(read_timeout))

    def _timeout(self, read: float | None) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect_timeout, read=read, write=60.0, pool=60.0)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VLLMClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VLLMClient({self.base_url!r})"

    def request(self, method: str, route: str, *, json: Any = None,
                params: dict[str, Any] | None = None, read_timeout: float | None = None) -> Any:
        """One call; returns the decoded JSON answer or raises ``VLLMHTTPError``."""
        timeout = self._timeout(read_timeout if read_timeout is not None else self.read_timeout)
        try:
            resp = self._http.request(method, route, json=json, params=params, timeout=timeout)
        except httpx.TimeoutException as e:
            raise VLLMConnectionError(
                f"{method} {self.base_url}{route}: no answer within the timeout "
                f"({type(e).__name__}); the server may be stuck in NCCL") from e
        except httpx.TransportError as e:
            raise VLLMConnectionError(f"{method} {self.base_url}{route}: {e}") from e
        if resp.status_code >= 400:
            message, body = _error_message(resp)
            raise VLLMHTTPError(route, resp.status_code, message, body)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    # -- routes (PROTOCOL.md section 3) ---------------------------------
    def get_world_size(self, include_dp: bool = True) -> int:
        ans = self.request("GET", "/get_world_size",
                           params=None if include_dp else {"include_dp": "false"})
        return int(ans["world_size"])

    def init_weight_transfer_engine(self, init_info: dict[str, Any],
                                    read_timeout: float | None = None) -> Any:
        return self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info},
                            read_timeout=read_timeout or self.transfer_timeout)

    def start_weight_update(self) -> Any:
        return self.request("POST", "/start_weight_update", read_timeout=self.transfer_timeout)

    def update_weights(self, update_info: dict[str, Any],
                       read_timeout: float | None = None) -> Any:
        return self.request("POST", "/update_weights", json={"update_info": update_info},
                            read_timeout=read_timeout or self.transfer_timeout)

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        body = None if weight_version is None else {"weight_version": weight_version}
        return self.request("POST", "/finish_weight_update", json=body,
                            read_timeout=self.transfer_timeout)

    def shutdown_weight_transfer_engine(self) -> Any:
        return self.request("POST", "/shutdown_weight_transfer_engine")

    def pause(self, mode: str = "abort") -> Any:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be abort, wait or keep, got {mode!r}")
        return self.request("POST", "/pause", params={"mode": mode},
                            read_timeout=self.transfer_timeout)

    def resume(self) -> Any:
        return self.request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self.request("GET", "/is_paused")["is_paused"])

    def weight_info(self) -> dict[str, Any]:
        return self.request("GET", "/weight_info")

    def weight_checker(self, action: str, baseline: dict[str, str] | None = None) -> Any:
        if action not in ("checksum", "reset", "compare"):
            raise ValueError(f"action must be checksum, reset or compare, got {action!r}")
        body: dict[str, Any] = {"action": action}
        if baseline is not None:
            body["baseline"] = baseline
        return self.request("POST", "/weight_checker", json=body,
                            read_timeout=self.transfer_timeout)

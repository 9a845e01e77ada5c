"""``jax-vllm-nccl doctor`` and ``jax-vllm-nccl mint``.

``doctor`` answers the questions asked first when a push hangs or init
fails, and checks each one rather than guessing: is there a GPU and a
driver, which libnccl this process loads (and does it match the NCCL the
server's vLLM release loads), does the server expose the RL routes, how
many workers would join, and does its engine answer (one stuck inside NCCL
by a trainer that left does not); every HTTP call has a deadline. It exits
non-zero when any check fails and says what was left unchecked.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from .errors import ServerStuck
from .http.client import VLLMClient, VLLMConnectionError, VLLMHTTPError, VLLMProtocolError
from .rendezvous import engine_answers

# The NCCL that a stock install of each vLLM release loads (through the torch
# it pins). NCCL refuses ranks of different versions at init.
VLLM_NCCL = {"0.33.0": "2.30.7"}
# The deadline of each of doctor's HTTP calls: a healthy server answers
# every one at once, an engine stuck inside NCCL never does.
CALL_TIMEOUT = 5.0


def _package_version() -> str:
    try:
        return version("jax-vllm-nccl")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _pip_line(nccl: str) -> str:
    return f"pip install 'nvidia-nccl-cu13=={nccl}'"


class _Report:
    def __init__(self) -> None:
        self.problems = 0
        self.unchecked: list[str] = []

    def ok(self, line: str) -> None:
        print(f"ok       {line}")

    def bad(self, line: str) -> None:
        self.problems += 1
        print(f"PROBLEM  {line}")

    def skip(self, what: str, why: str) -> None:
        self.unchecked.append(what)
        print(f"unknown  {what}: {why}")


def _check_gpu(r: _Report) -> None:
    from nccl_cffi import CudaError, cuda
    try:
        n = cuda.device_count_or_raise()
    except CudaError as e:
        r.bad(f"GPU: {e}")
        return
    r.ok(f"GPU: {n} visible CUDA device(s)")


def _check_nccl(r: _Report, path: str | None) -> tuple[int, int, int] | None:
    import nccl_cffi
    try:
        nccl_cffi.load_library(path)
    except nccl_cffi.NcclLibraryNotFound as e:
        r.bad(f"libnccl: {e}")
        return None
    info = nccl_cffi.library_info()
    r.ok(f"libnccl: {info}")
    return info.version


def _check_workers(r: _Report, url: str, client: VLLMClient) -> bool:
    """``/get_world_size``, which vLLM's API process answers from its config:
    whether the server answers at all, and how many workers would join."""
    try:
        workers = client.get_world_size()
    except (VLLMHTTPError, VLLMProtocolError) as e:
        r.bad(f"server {url}: {e}")
        return False
    except VLLMConnectionError as e:
        r.bad(f"server {url}: unreachable ({e}); check the URL and that the server is up")
        return False
    if workers < 1:
        r.bad(f"server {url}: reports {workers} workers, so no worker would join the group")
    else:
        r.ok(f"server {url}: {workers} worker(s) -> world_size {workers + 1}")
    return True


def _check_engine(r: _Report, client: VLLMClient) -> None:
    """The engine core answers (``engine_answers``, as ``connect`` asks it)."""
    try:
        paused = engine_answers(client, CALL_TIMEOUT)
    except ServerStuck as e:
        r.bad(f"server {e}")
    except (VLLMHTTPError, VLLMConnectionError, VLLMProtocolError) as e:
        r.bad(f"RL routes: {e}")
    else:
        r.ok(f"RL routes answer (is_paused={paused}); /init_weight_transfer_engine also "
             "needs --weight-transfer-config '{\"backend\":\"nccl\"}' at launch")


def _check_server(r: _Report, url: str, nccl: tuple[int, int, int] | None) -> None:
    try:
        client = VLLMClient(url, connect_timeout=CALL_TIMEOUT, timeout=CALL_TIMEOUT)
    except ValueError as e:  # a URL that cannot work: one sentence, no password
        r.bad(f"server: {e}")
        r.unchecked.append("server")
        return
    url = client.base_url
    with client:
        if not _check_workers(r, url, client):
            return
        _check_engine(r, client)
        served, why = None, "GET /version gave no version"
        try:
            served = client.request("GET", "/version").get("version")
        except (VLLMHTTPError, VLLMConnectionError, VLLMProtocolError) as e:
            why = f"GET /version failed ({e})"
    _check_match(r, served, why, nccl)


def _check_match(r: _Report, served: object, why: str,
                 nccl: tuple[int, int, int] | None) -> None:
    """Whether this trainer's libnccl is the one the server's vLLM release loads."""
    if served is None:
        r.skip("NCCL match", f"{why}; compare "
               "by hand: on the server, python -c \"import torch; "
               "print(torch.cuda.nccl.version())\"")
        return
    want = VLLM_NCCL.get(str(served))
    if want is None:
        r.skip("NCCL match", f"vLLM {served} is not a release this version knows; on the "
               "server run python -c \"import torch; print(torch.cuda.nccl.version())\", "
               f"then {_pip_line('X.Y.Z')} here (or set NCCL_LIBRARY)")
        return
    if nccl is None:
        r.skip("NCCL match", f"vLLM {served} loads NCCL {want}, but no libnccl loads here")
        return
    have = ".".join(map(str, nccl))
    if have != want:
        r.bad(f"NCCL match: the server's vLLM {served} loads NCCL {want}, this trainer "
              f"loads {have}; NCCL refuses mismatched ranks at init. Fix: {_pip_line(want)} "
              "(or point NCCL_LIBRARY at a libnccl.so.2 of that version)")
    else:
        r.ok(f"NCCL match: vLLM {served} loads NCCL {want}, as this trainer does")


def _doctor(args: argparse.Namespace) -> int:
    r = _Report()
    _check_gpu(r)
    nccl = _check_nccl(r, args.nccl)
    if args.url:
        _check_server(r, args.url, nccl)
    else:
        r.skip("server", "no --url given")
    left = f"; not checked: {', '.join(r.unchecked)}" if r.unchecked else ""
    if r.problems:
        print(f"{r.problems} problem(s): connect would fail; fix the PROBLEM lines first{left}")
        return 1
    print(f"every check passed{left}")
    return 0


def _mint(_: argparse.Namespace) -> int:
    from nccl_cffi import NcclError

    from .codec import UniqueId
    try:
        print(UniqueId.mint().to_b64())
    except NcclError as e:
        print(f"jax-vllm-nccl mint: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jax-vllm-nccl",
                                 description="JAX -> vLLM weight transfer over NCCL")
    ap.add_argument("--version", action="version",
                    version=f"jax-vllm-nccl {_package_version()}")
    sub = ap.add_subparsers(dest="cmd")
    d = sub.add_parser("doctor", help="check the GPU, the libnccl and a vLLM server",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    d.add_argument("--url", help="vLLM server base URL, e.g. http://127.0.0.1:8000")
    d.add_argument("--nccl", help="explicit path to the libnccl.so.2 to use")
    d.set_defaults(fn=_doctor)
    m = sub.add_parser("mint", help="print a fresh unique id, base64 as vLLM expects "
                       "(a credential: do not log it)")
    m.set_defaults(fn=_mint)
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help()
        return 0
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

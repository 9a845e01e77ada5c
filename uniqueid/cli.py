"""``jax-vllm-nccl doctor`` and ``jax-vllm-nccl mint``.

``doctor`` answers the questions asked first when a push hangs: which libnccl
this process loads (and would the server's match), is the server exposing the
RL routes, and how many workers would join.
"""

from __future__ import annotations

import argparse
import sys

from .client import VLLMClient, VLLMConnectionError, VLLMHTTPError
from .codec import UniqueId


def _doctor(args: argparse.Namespace) -> int:
    import nccl_cffi
    ok = True
    try:
        nccl_cffi.load_library(args.nccl)
        info = nccl_cffi.library_info()
        print(f"libnccl: {info}")
        for line in info.tried:
            print(f"  tried {line}")
        print("  the vLLM server must load the same NCCL version "
              "(set VLLM_NCCL_SO_PATH there, or NCCL_LIBRARY here)")
    except OSError as e:
        print(f"libnccl: NOT FOUND\n{e}")
        ok = False
    if args.url:
        client = VLLMClient(args.url, connect_timeout=5, read_timeout=10)
        try:
            ws = client.get_world_size()
            print(f"server {args.url}: reachable, {ws} worker(s) -> world_size {ws + 1}")
            print(f"  weight version: {client.weight_info().get('weight_version')}")
            paused = client.is_paused()
            print(f"  RL routes answer (is_paused={paused}); /init_weight_transfer_engine "
                  "needs --weight-transfer-config '{\"backend\":\"nccl\"}'")
        except VLLMHTTPError as e:
            print(f"server {args.url}: {e}")
            ok = False
        except VLLMConnectionError as e:
            print(f"server {args.url}: unreachable ({e})")
            ok = False
    print("connect would " + ("likely succeed" if ok else "fail: fix the above first"))
    return 0 if ok else 1


def _mint(_: argparse.Namespace) -> int:
    print(UniqueId.mint().to_b64())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jax-vllm-nccl",
                                 description="JAX -> vLLM weight transfer over NCCL")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="which libnccl, and does a vLLM server answer")
    d.add_argument("--url", help="vLLM server base URL, e.g. http://127.0.0.1:8000")
    d.add_argument("--nccl", help="explicit path to libnccl.so.2")
    d.set_defaults(fn=_doctor)
    m = sub.add_parser("mint", help="print a fresh unique id, base64 as vLLM expects")
    m.set_defaults(fn=_mint)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

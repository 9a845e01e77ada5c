"""How the benches start their child processes and hear back from them.

Every measurement runs in a child process of its own, on the one GPU it is
given (``CUDA_VISIBLE_DEVICES``), so no process ever holds two GPUs' XLA
pools and the ranks of one collective start together. A child runs a
*role*, a function named on its command line
(``python benches/bench.py role_raw 0 2 5``: the role, then its string
arguments), and answers with ``RESULT <json>`` lines on its stdout; the
rest of what it prints is its log, shown when it fails.

NCCL unique ids reach a rank in its environment (``JAX_SENDER_BENCH_IDS``),
never on its command line: a failing rank's error shows its arguments, and
an id is a credential (whoever holds it may join the group).

This module imports no other bench module, so a test can load it by path.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from jax_sender.testing.harness import VLLM_TREE, gpu_count, gpu_env, run_all

IDS = "JAX_SENDER_BENCH_IDS"
# The script whose command line names the bench's roles (see ``run_role``).
BENCH = pathlib.Path(__file__).resolve().with_name("bench.py")
ROLE_PREFIX = "role_"
RESULT = "RESULT "


def emit(obj: Any) -> None:
    """Hand ``obj`` (JSON) to the parent: one ``RESULT`` line on stdout."""
    print(RESULT + json.dumps(obj), flush=True)


def given_ids() -> Any:
    """The unique ids this rank was given by ``ranks`` (in its environment)."""
    return json.loads(os.environ[IDS])


def results(out: str, err: str = "") -> list[Any]:
    """What a child emitted, in order.

    Raises:
        RuntimeError: it emitted nothing (the end of its output in the message).
    """
    found = [json.loads(line[len(RESULT):]) for line in out.splitlines()
             if line.startswith(RESULT)]
    if not found:
        raise RuntimeError(f"no result:\n{out[-2000:]}\n{err[-4000:]}")
    return found


def vllm_env() -> dict[str, str]:
    """The environment entries a child needs to import vLLM's tree
    (``.vllm/``, or ``JAX_SENDER_VLLM_TREE``) and its ``shim``."""
    path = [str(VLLM_TREE), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}


def ranks(role: str, n: int, *args: str, ids: Any = None, timeout: float = 300,
          script: str | pathlib.Path = BENCH, env: Mapping[str, str] | None = None) -> list[list[Any]]:
    """Run ``script``'s ``role`` as ranks 0..n-1, together.

    Args:
        role: the role's name; each rank gets its rank as first argument, then ``args``.
        n: how many ranks; rank r runs on GPU r.
        ids: what ``given_ids()`` returns in each rank (JSON), e.g. unique ids.
        timeout: seconds for all of them.
        script: the file whose command line dispatches ``role``.
        env: entries added to each rank's environment.

    Returns:
        Each rank's results (``results``), by rank.
    """
    procs = [subprocess.Popen([sys.executable, str(script), role, str(r), *args],
                              env=dict(gpu_env(str(r)), **(env or {}), **{IDS: json.dumps(ids)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    return [results(out) for out in run_all(procs, timeout, expect=RESULT)]


def one(role: str, *args: str, timeout: float = 580, script: str | pathlib.Path = BENCH,
        env: Mapping[str, str] | None = None) -> list[Any]:
    """Run ``script``'s ``role`` alone on GPU 0 with ``args``; its results.
    Its output is printed to stderr when it fails."""
    p = subprocess.run([sys.executable, str(script), role, *args],
                       env=dict(gpu_env("0"), **(env or {})), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-5000:], file=sys.stderr)
    return results(p.stdout, p.stderr)


def mint_uid() -> str:
    """A fresh NCCL unique id, base64, for ``ranks(..., ids=...)``."""
    from uniqueid import UniqueId
    return UniqueId.mint().to_b64()


def need_gpus(n: int) -> None:
    """Exit with one sentence where there are fewer than ``n`` GPUs."""
    found = gpu_count()
    if found < n:
        sys.exit(f"this benchmark needs {n} NVIDIA GPUs and found {found}: run it on a "
                 "machine with them (cuda13 extra installed); nothing was measured")


def roles_of(*modules: ModuleType) -> dict[str, Callable[..., None]]:
    """The roles (``role_*`` functions) defined in ``modules``, by name."""
    return {name: fn for m in modules for name, fn in vars(m).items()
            if name.startswith(ROLE_PREFIX) and callable(fn)}


def run_role(argv: Sequence[str], roles: Mapping[str, Callable[..., None]]) -> bool:
    """Run the role ``argv[1]`` names with the rest of ``argv``, if it names
    one; whether it did (else the script does its own work).

    Raises:
        SystemExit: ``argv[1]`` looks like a role but is none of ``roles``.
    """
    if len(argv) < 2 or not argv[1].startswith(ROLE_PREFIX):
        return False
    if argv[1] not in roles:
        sys.exit(f"no role {argv[1]!r} here (known: {', '.join(sorted(roles))})")
    roles[argv[1]](*argv[2:])
    return True

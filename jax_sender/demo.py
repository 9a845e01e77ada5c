"""The demo: push a small Flax Qwen3-style decoder into the reference receiver.

    python -m jax_sender.demo [--receivers N] [--unpacked]

Starts the reference receiver on GPUs 1..N (one process each), builds the
model with random weights on GPU 0, pushes it, checks every tensor bit for
bit against the workers' SHA-256 checksums, pushes a changed second version
(metadata reused), checks again, and prints a report.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time


def visible_gpus() -> list[str]:
    """Physical ids of the GPUs this process may use, counted in a clean child."""
    code = "from nccl_cffi.cuda import device_count; print(device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    n = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    listed = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    return listed[:n] if listed else [str(i) for i in range(n)]


def expected_checksums(params, mapping, ranks: int) -> dict[str, str]:
    import numpy as np

    from jax_sender.naming import named_arrays
    sums = {}
    for name, path, arr in named_arrays(params, mapping):
        digest = hashlib.sha256(np.asarray(mapping.transform(path, arr)).tobytes()).hexdigest()
        for r in range(ranks):
            sums[f"dp0:pp0:pcp0:tp{r}:{name}"] = digest
    return sums


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--unpacked", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    gpus = visible_gpus()
    if len(gpus) < 2:
        print(f"The demo needs a machine with at least 2 GPUs (found {len(gpus)}): NCCL "
              "cannot put the trainer and a receiver on one GPU. Nothing was run.")
        return 2
    receivers = gpus[1:1 + args.receivers]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]  # before JAX starts: the sender's GPU only
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    import jax

    from jax_sender import LLAMA, WeightSender
    from jax_sender.harness import ReferenceServer
    from jax_sender.models.llama import Config, init_params

    cfg = Config(layers=args.layers)
    params = init_params(cfg)
    rows = []
    with ReferenceServer(receivers) as url:
        t0 = time.perf_counter()
        sender = WeightSender.connect(url, mapping=LLAMA, packed=not args.unpacked)
        connect_s = time.perf_counter() - t0
        client = sender.clients[0]
        with sender:
            for version, tree in (("v1", params),
                                  ("v2", jax.tree_util.tree_map(lambda x: x * 2 + 1, params))):
                stats = sender.send(tree, weight_version=version)
                want = expected_checksums(tree, LLAMA, len(receivers))
                ans = client.weight_checker("compare", baseline=want)
                served = client.weight_info()["weight_version"]
                rows.append((version, stats, ans["match"], len(want), served))
                if not ans["match"]:
                    print(f"MISMATCH in {version}: {ans['mismatches'][:5]}")
    print(f"\nconnect (init + warm-up, {len(receivers)} receiver(s) on GPU "
          f"{','.join(receivers)}): {connect_s:.2f}s")
    print(f"{'version':8} {'mode':9} {'tensors':>7} {'MB':>8} {'chunks':>6} {'reuse':>5} "
          f"{'transfer s':>10} {'GB/s':>7} {'bit-exact':>9} served")
    for version, s, ok, n, served in rows:
        print(f"{version:8} {'packed' if s.packed else 'unpacked':9} {s.tensors:>7} "
              f"{s.bytes / 1e6:>8.1f} {s.chunks:>6} {str(s.reused_metadata):>5} "
              f"{s.transfer_s:>10.3f} {s.transfer_gbps:>7.1f} {f'{n}/{n}' if ok else 'NO':>9} "
              f"{served}")
    ok = all(r[2] for r in rows)
    print("demo " + ("PASSED: every tensor arrived bit for bit" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

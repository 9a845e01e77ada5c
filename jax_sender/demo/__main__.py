"""The demo: push a Flax Qwen3-style decoder into the reference receiver.

    python -m jax_sender.demo [--receivers N] [--unpacked] [--layers L]

With two or more GPUs the trainer takes the first and the receivers the
next N, over NVLink. With one GPU the trainer and one receiver share it,
each its own NCCL host talking over loopback sockets: correct, not fast.
It measures a raw NCCL broadcast between the same two GPUs first (the
ceiling of any push there), builds the model with random weights, pushes
it, checks every tensor bit for bit with ``WeightSender.verify`` (vLLM's
``/weight_checker`` SHA-256s), pushes a changed second version (metadata
reused), checks again, and prints a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

RAW_BYTES = 256 << 20
RAW_REPS = 10


def visible_gpus() -> list[str]:
    """Physical ids of the GPUs this process may use, counted in a clean child."""
    code = "from nccl_cffi.cuda import device_count; print(device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    n = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    listed = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    return listed[:n] if listed else [str(i) for i in range(n)]


def raw_broadcast(rank: int, uid_b64: str) -> float:
    """GB/s of ``RAW_REPS`` back-to-back broadcasts of 256 MiB between two ranks."""
    import jax.numpy as jnp

    from nccl_cffi import cuda
    from uniqueid import UniqueId, handshake
    comm = handshake(2, UniqueId.from_b64(uid_b64), rank, 0, timeout=120)
    buf = jnp.zeros((RAW_BYTES,), jnp.uint8).block_until_ready()
    stream = cuda.Stream(0)
    try:
        comm.broadcast(buf, root=0, stream=stream)  # connections, first touch
        comm.wait(stream, 120)
        t = time.perf_counter()
        for _ in range(RAW_REPS):
            comm.broadcast(buf, root=0, stream=stream)
        comm.wait(stream, 120)
        return RAW_REPS * RAW_BYTES / (time.perf_counter() - t) / 1e9
    finally:
        stream.close()
        comm.destroy()


def _measure_raw(peer_env: dict[str, str]) -> float:
    """This process is rank 0; a child on the receiver's GPU is rank 1. The
    id travels in the child's environment, never on a command line."""
    from uniqueid import UniqueId
    uid = UniqueId.mint().to_b64()
    peer = subprocess.Popen([sys.executable, "-m", "jax_sender.demo", "--raw-peer"],
                            env=dict(peer_env, JAX_SENDER_DEMO_UID=uid),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        gbps = raw_broadcast(0, uid)
        peer.wait(60)
    finally:
        if peer.poll() is None:
            peer.kill()
    return gbps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--receivers", type=int, default=1,
                    help="receiving GPUs (workers), after the trainer's; one with a single GPU")
    ap.add_argument("--unpacked", action="store_true",
                    help="one broadcast per tensor instead of packed 1 GiB chunks")
    ap.add_argument("--layers", type=int, default=10,
                    help="decoder layers; 10 make 1.2 GB of bf16 parameters")
    ap.add_argument("--raw-peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_peer:
        raw_broadcast(1, os.environ["JAX_SENDER_DEMO_UID"])
        return 0
    try:
        import flax  # noqa: F401
        import jax  # noqa: F401
    except ImportError as e:
        print(f"The demo needs JAX with CUDA and Flax ({e.name} is missing): "
              "pip install 'jax-vllm-nccl[cuda13]'. Nothing was run.")
        return 2
    gpus = visible_gpus()
    if not gpus:
        print("The demo needs an NVIDIA GPU and its driver (found none). Nothing was run.")
        return 2
    from jax_sender.testing.harness import SHARE_GPUS, gpu_env
    one_gpu = len(gpus) == 1
    if one_gpu:  # trainer and receiver on one GPU, each its own NCCL host
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
        os.environ[SHARE_GPUS] = "1"
        receivers = ["1"]
        os.environ.update(gpu_env("0"))
        link = "one GPU: loopback sockets, not NVLink; for figures use two"
    else:
        receivers = gpus[1:1 + args.receivers]
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]  # before JAX starts: the sender's GPU
        link = f"GPU {gpus[0]} -> GPU {','.join(receivers)}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    return _run(args, receivers, link, gpu_env(receivers[0]))


def _run(args: argparse.Namespace, receivers: list[str], link: str,
         peer_env: dict[str, str]) -> int:
    import jax

    from jax_sender import LLAMA, SendConfig, WeightSender
    from jax_sender.demo.model import Config, init_params
    from jax_sender.testing.harness import ReferenceServer

    raw = _measure_raw(peer_env)
    cfg = Config(vocab=32000, hidden=2048, intermediate=5632, layers=args.layers, heads=16,
                 kv_heads=4, head_dim=128)
    params = init_params(cfg)
    rows = []
    with ReferenceServer(receivers) as url:
        t0 = time.perf_counter()
        sender = WeightSender.connect(url, mapping=LLAMA,
                                      config=SendConfig(packed=not args.unpacked))
        connect_s = time.perf_counter() - t0
        with sender:
            for version, tree in (("v1", params),
                                  ("v2", jax.tree_util.tree_map(lambda x: x * 2 + 1, params))):
                stats = sender.send(tree, weight_version=version)
                check = sender.verify(tree)
                rows.append((version, stats, check))
                if not check.ok:
                    print(f"MISMATCH in {version}: {check.mismatched[:5]}")
    print(f"\n{link}; raw NCCL broadcast {raw:.1f} GB/s; connect (init + warm-up, "
          f"{len(receivers)} receiver(s)) {connect_s:.2f}s")
    print(f"{'version':8} {'mode':9} {'tensors':>7} {'GB':>6} {'chunks':>6} {'reuse':>5} "
          f"{'push s':>7} {'GB/s':>6} {'x raw':>5} {'bit-exact':>9}")
    for version, s, check in rows:
        n = len(check.matched) + len(check.mismatched)
        gbps = s.bytes / s.transfer_s / 1e9
        print(f"{version:8} {'packed' if s.packed else 'unpacked':9} {s.tensors:>7} "
              f"{s.bytes / 1e9:>6.2f} {s.chunks:>6} {str(s.reused_metadata):>5} "
              f"{s.total_s:>7.3f} {gbps:>6.1f} {gbps / raw:>5.2f} "
              f"{f'{len(check.matched)}/{n}' if check.ok else 'NO':>9}")
    ok = all(check.ok and not check.unchecked for _, _, check in rows)
    print("The first push includes compiling the Flax-to-torch transposes.")
    print("demo " + ("PASSED: every tensor arrived bit for bit" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Weight-push throughput next to its baseline, measured in the same run.

    python benches/bench.py [--reps 5] [--receivers 1] [--vllm]

Rows: raw ``ncclBroadcast`` of one pre-allocated 1 GiB buffer through this
project's binding (the baseline); packed and unpacked ``send`` of the
``qwen3-8b`` workload (bf16, 399 tensors, ~16.4 GB) into the reference
receiver and, with ``--vllm``, into vLLM 0.33.0's own consumer
(``.vllm/server.py --nccl``). Send time is from ``send()`` entering the
transfer to every worker answering ``/update_weights``, i.e. holding every
tensor. Each row: median and best of ``--reps`` runs after one warm-up.
Writes ``results/bench.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GiB = 1 << 30


def qwen3_8b():
    """(name, shape) of a Qwen3-8B-shaped decoder, in checkpoint (torch) layout."""
    h, i, v, hd, nq, nkv = 4096, 12288, 151936, 128, 32, 8
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(36):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (nq * hd, h)),
                (p + "self_attn.k_proj.weight", (nkv * hd, h)),
                (p + "self_attn.v_proj.weight", (nkv * hd, h)),
                (p + "self_attn.o_proj.weight", (h, nq * hd)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _env(gpu: str) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")


# -- child roles ---------------------------------------------------------------

def role_raw(rank: str, nranks: str, uid: str, reps: str) -> None:
    import jax.numpy as jnp

    from nccl_cffi import Communicator, cuda
    from uniqueid import UniqueId, warm_up
    comm = Communicator.init_rank(int(nranks), UniqueId.from_b64(uid).raw, int(rank), 0,
                                  timeout=120)
    warm_up(comm, 60)
    buf = jnp.zeros((GiB,), jnp.uint8).block_until_ready()
    stream = cuda.Stream(0)
    times = []
    for k in range(int(reps) + 2):  # 10 back-to-back broadcasts per rep: algbw, not latency
        t = time.perf_counter()
        for _ in range(10):
            comm.broadcast(buf, root=0, stream=stream)
        comm.wait(stream, 60)
        times.append((time.perf_counter() - t) / 10)
    if rank == "0":
        print("RESULT " + json.dumps(times[2:]))
    comm.destroy()


def role_send(url: str, mode: str, reps: str) -> None:
    import jax
    import jax.numpy as jnp

    from jax_sender import WeightSender
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    pairs = [(n, jax.random.normal(k, s, jnp.bfloat16)) for (n, s), k in zip(qwen3_8b(), keys)]
    jax.block_until_ready([a for _, a in pairs])
    dev = jax.devices()[0]
    base = dev.memory_stats()["bytes_in_use"]
    sender = WeightSender.connect(url, packed=mode == "packed")
    stats = [sender.send(pairs) for _ in range(int(reps) + 1)][1:]
    extra = dev.memory_stats()["peak_bytes_in_use"] - base
    print("RESULT " + json.dumps({"transfer": [s.transfer_s for s in stats],
                                  "total": [s.total_s for s in stats], "bytes": stats[0].bytes,
                                  "chunks": stats[0].chunks, "extra_peak": extra}))
    sender.close()


# -- orchestration -------------------------------------------------------------

def _result(proc: subprocess.CompletedProcess):
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def raw(nranks: int, reps: int) -> list[float]:
    from uniqueid import UniqueId
    uid = UniqueId.mint().to_b64()
    procs = [subprocess.Popen([sys.executable, __file__, "role_raw", str(r), str(nranks), uid,
                               str(reps)], env=_env(str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(nranks)]
    outs = [p.communicate(timeout=300) for p in procs]
    return _result(subprocess.CompletedProcess([], 0, outs[0][0], outs[0][1]))


def send(url: str, mode: str, reps: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "role_send", url, mode, str(reps)],
                       env=_env("0"), capture_output=True, text=True, timeout=500)
    return _result(p)


class VLLMServer:
    def __init__(self, gpu: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / ".vllm" / "server.py"), "--nccl", "--port",
             str(self.port), "--log", "/tmp/bench_vllm.jsonl"], env=_env(gpu),
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> str:
        import httpx
        url = f"http://127.0.0.1:{self.port}"
        for _ in range(180):
            try:
                httpx.get(url + "/get_world_size", timeout=2)
                return url
            except httpx.HTTPError:
                time.sleep(1)
        raise TimeoutError("vLLM server did not start")

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, 9)
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--modes", default="packed,unpacked")
    args = ap.parse_args()
    from jax_sender.harness import ReferenceServer

    rows = []
    t = raw(2, max(args.reps, 5))
    raw_gbps = GiB / statistics.median(t) / 1e9
    rows.append(("raw ncclBroadcast 1 GiB, 2 ranks", GiB, t, None))
    targets = [("reference receiver", lambda: ReferenceServer(["1"]))]
    if args.vllm:
        targets.append(("vLLM 0.33.0 consumer", lambda: VLLMServer("1")))
    for label, make in targets:
        for mode in args.modes.split(","):
            with make() as url:
                r = send(url, mode, args.reps)
            rows.append((f"{mode} send qwen3-8b -> {label}", r["bytes"], r["transfer"], r))
    lines = ["| figure | median s | best s | median GB/s | x raw | notes |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, nbytes, times, r in rows:
        med, best = statistics.median(times), min(times)
        gbps = nbytes / med / 1e9
        note = "" if r is None else (f"{r['chunks']} chunks/broadcasts; send() total median "
                                     f"{statistics.median(r['total']):.3f}s; sender peak extra "
                                     f"{r['extra_peak'] / GiB:.2f} GiB")
        lines.append(f"| {name} | {med:.4f} | {best:.4f} | {gbps:.1f} | "
                     f"{gbps / raw_gbps:.2f} | {note} |")
    table = "\n".join(lines)
    print(table)
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    (out / "bench.md").write_text(table + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("role_"):
        globals()[sys.argv[1]](*sys.argv[2:])
    else:
        main()

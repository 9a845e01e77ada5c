"""The sender's own host cost per push, on CPU, with no GPU and no vLLM.

    PYTHONPATH=.:tests python benches/host_cost.py [--sends 500] [--tensors 1]

(From the repository's root. ``tests``: the in-memory link is the test
suite's ``support.servers.memory_link``; ``.`` first, or ``tests/jax_sender/``
would stand in for the package.) A 4 KiB push (the bench's fixed-cost row)
through ``WeightSender.send`` over that in-memory link: real HTTP
on loopback with vLLM's session rules, the broadcast handed over in memory.
Its HTTP calls are timed where they are made (start and finish on the
caller's thread, the update inside its own thread: ``SendStats.update_s``);
the rest of ``send()`` is the sender's own: validation, the handoffs to and
from the update's and the NCCL calls' threads, the waits.
That rest is what a sender adds to vLLM's three calls on any machine, and
what this script measures; "prepare" is its part before the first HTTP
call (validation, the kept description). ``--tensors 20000 --sends 10``
pushes 20,000 such tensors instead of one; ``--model llama`` and ``--model
tunix-qwen3`` push a tree of Qwen3-0.6B's layout (311 tensors) through
``LLAMA`` or ``TUNIX_QWEN3``, to compare mappings per tensor.
"""

from __future__ import annotations

import argparse
import statistics
import time

# Qwen3-0.6B's layout (28 layers; 310 tensors with q/k norms), every width 8
# here: the host's cost per tensor is what is measured, not the bytes.
LAYERS, WIDTH = 28, 8


def flax_tree() -> dict:
    """The demo decoder's Flax layout, for ``LLAMA``."""
    import jax.numpy as jnp
    w = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    layer = {"self_attn": {p: {"kernel": w(WIDTH, WIDTH)} for p in
                           ("q_proj", "k_proj", "v_proj", "o_proj")}
             | {n: {"scale": w(WIDTH)} for n in ("q_norm", "k_norm")},
             "mlp": {p: {"kernel": w(WIDTH, WIDTH)} for p in ("gate_proj", "up_proj", "down_proj")},
             "input_layernorm": {"scale": w(WIDTH)},
             "post_attention_layernorm": {"scale": w(WIDTH)}}
    return {"embed_tokens": {"embedding": w(WIDTH, WIDTH)}, "norm": {"scale": w(WIDTH)},
            "lm_head": {"kernel": w(WIDTH, WIDTH)},
            **{f"layers_{i}": layer for i in range(LAYERS)}}


def tunix_tree() -> dict:
    """Tunix's NNX layout of the same model, for ``TUNIX_QWEN3``."""
    import jax.numpy as jnp
    w = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    heads, head_dim = 2, WIDTH // 2
    attn = {"q_proj": {"w": w(WIDTH, heads, head_dim)}, "k_proj": {"w": w(WIDTH, heads, head_dim)},
            "v_proj": {"w": w(WIDTH, heads, head_dim)}, "o_proj": {"w": w(heads, head_dim, WIDTH)},
            "q_norm": {"w": w(head_dim)}, "k_norm": {"w": w(head_dim)}}
    layer = {"attn": attn,
             "mlp": {p: {"kernel": w(WIDTH, WIDTH)} for p in ("gate_proj", "up_proj", "down_proj")},
             "input_layernorm": {"w": w(WIDTH)}, "post_attention_layernorm": {"w": w(WIDTH)}}
    return {"embedder": {"input_embedding": w(WIDTH, WIDTH)}, "final_norm": {"w": w(WIDTH)},
            "lm_head": {"w": w(WIDTH, WIDTH)}, "layers": {str(i): layer for i in range(LAYERS)}}


def workload(name: str, tensors: int):
    """The pushed tree and its mapping."""
    import jax.numpy as jnp

    from jax_sender import LLAMA, TUNIX_QWEN3, Mapping
    if name == "llama":
        return flax_tree(), LLAMA
    if name == "tunix-qwen3":
        return tunix_tree(), TUNIX_QWEN3
    return [(f"w{i}", jnp.full((1024,), i, jnp.float32)) for i in range(tensors)], Mapping()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sends", type=int, default=500)
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--model", choices=("pairs", "llama", "tunix-qwen3"), default="pairs",
                    help="pairs: --tensors 4 KiB tensors; llama / tunix-qwen3: a tree of "
                         "Qwen3-0.6B's layout through LLAMA or TUNIX_QWEN3 (transforms jitted)")
    args = ap.parse_args()
    import jax

    from support.servers.memory_link import memory_sender

    jax.config.update("jax_platforms", "cpu")
    params, mapping = workload(args.model, args.tensors)
    sender, _, _ = memory_sender(mapping=mapping)
    for _ in range(50 if args.tensors == 1 else 2):  # warm-up: compiles, pools, connections
        sender.send(params)
    walls, stats = [], []
    for _ in range(args.sends):
        t = time.perf_counter()
        stats.append(sender.send(params))
        walls.append(time.perf_counter() - t)
    sender.close()
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f}"  # noqa: E731
    http = [s.start_s + s.update_s + s.finish_s for s in stats]
    what = (f"{args.tensors} 4 KiB tensor(s)" if args.model == "pairs" else
            f"a {stats[0].tensors}-tensor tree through {args.model}")
    print(f"Medians of {args.sends} pushes of {what}, ms.\n")
    print("| send() | start | update | finish | the sender's own | of which prepare |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {ms(walls)} | {ms([s.start_s for s in stats])} | "
          f"{ms([s.update_s for s in stats])} | {ms([s.finish_s for s in stats])} | "
          f"{ms([w - h for w, h in zip(walls, http)])} | {ms([s.prepare_s for s in stats])} |")


if __name__ == "__main__":
    main()

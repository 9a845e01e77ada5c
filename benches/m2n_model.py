"""A model on paper: how long one push takes through a broadcast and through
NCCL M2N, against the number of trainer GPUs (T) and the server's
tensor-parallel size (TP), from link bandwidths alone.

``python benches/m2n_model.py`` prints the tables of docs/benchmarks.md.

Assumptions, each stated so it can be argued with:

* bf16 weights; the trainer's T GPUs hold 1/T of every parameter (FSDP);
  one vLLM replica of TP workers; trainer and server on different nodes,
  each GPU behind its own NIC of ``NIC`` bytes/s (400 Gb/s InfiniBand,
  what a link achieves), both directions at once.
* Broadcast (``WeightSender``): every byte leaves one trainer GPU (the
  parameter's broadcaster) and enters every worker whole: ``S / NIC``.
  The gathers to the broadcaster run over NVLink inside the trainer's
  node (``NVLINK``, the raw broadcast measured on 2 x H200), partly hidden.
* M2N (``M2NSender``): each trainer GPU sends its 1/T of each parameter.
  vLLM 0.33.0 resolves a parameter "direct" only where its checkpoint name
  is a live parameter with a plain tensor-parallel loader (``o_proj``,
  ``down_proj``, norms); fused ones (``qkv_proj``, ``gate_up_proj``, MoE
  ``w13``/``w2``) and embeddings take the "fallback": every worker receives
  the whole tensor. So a worker takes ``D / TP + F`` bytes (D direct, F
  fallback), and the trainer's NICs together send ``D + F x TP``.
* The physical limit of any scheme: every worker must take its shard
  (``S / TP``), and the trainer's NICs must send everything once (``S / T``
  each).
"""

from __future__ import annotations

NIC = 50e9  # bytes/s, one 400 Gb/s NIC per GPU
NVLINK = 360e9  # bytes/s, the raw broadcast measured between two H200s
BF16 = 2


def llama(layers: int, hidden: int, inter: int, kv: int, vocab: int) -> tuple[float, float]:
    """(direct, fallback) bytes of a Llama-shaped dense model under vLLM 0.33.0's resolution."""
    direct = layers * (hidden * hidden + inter * hidden + 2 * hidden)  # o_proj, down_proj, norms
    fallback = layers * (hidden * hidden + 2 * kv * hidden + 2 * inter * hidden)  # qkv, gate_up
    fallback += 2 * vocab * hidden  # embed_tokens, lm_head (vocab-parallel loaders)
    return direct * BF16, fallback * BF16


def moe(layers: int, hidden: int, experts: int, expert_inter: int, attention: int,
        vocab: int) -> tuple[float, float]:
    """(direct, fallback) of a MoE model: experts (w13, w2) and attention fused, fallback."""
    per_layer = experts * 3 * hidden * expert_inter + attention + 2 * hidden
    direct = layers * 2 * hidden  # norms
    return direct * BF16, (layers * per_layer - direct + 2 * vocab * hidden) * BF16


MODELS = {
    "Llama-3.1-8B": llama(32, 4096, 14336, 1024, 128256),
    "Llama-3.1-70B": llama(80, 8192, 28672, 1024, 128256),
    "1T MoE (61 layers, 384 experts)": moe(61, 7168, 384, 2048, 7168 * 7168 * 4, 163840),
}
SHAPES = {"Llama-3.1-8B": [(8, 1), (8, 2), (32, 2)],
          "Llama-3.1-70B": [(16, 4), (64, 8), (128, 8)],
          "1T MoE (61 layers, 384 experts)": [(256, 16), (512, 32)]}


def times(direct: float, fallback: float, t: int, tp: int) -> dict[str, float]:
    """Seconds of one push each way, and the limit."""
    total = direct + fallback
    gather = total / NVLINK / 2  # the trainer's gathers, half hidden behind the sends
    return {
        "broadcast": total / NIC + gather,
        "m2n": max((direct + fallback * tp) / (t * NIC), (direct / tp + fallback) / NIC),
        "all direct": max(total / (t * NIC), total / (tp * NIC)),
    }


def table() -> str:
    rows = ["| model (bf16) | GB | direct share | T | TP | broadcast s | M2N s (vLLM 0.33.0) "
            "| M2N / broadcast | limit s (all direct) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, (direct, fallback) in MODELS.items():
        total = direct + fallback
        for t, tp in SHAPES[name]:
            s = times(direct, fallback, t, tp)
            rows.append(f"| {name} | {total / 1e9:.0f} | {direct / total:.0%} | {t} | {tp} | "
                        f"{s['broadcast']:.2f} | {s['m2n']:.2f} | {s['m2n'] / s['broadcast']:.2f} | "
                        f"{s['all direct']:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())

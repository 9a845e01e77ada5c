"""Tiny Tunix models (Llama3, Qwen2, Qwen3) and the Tunix pieces around them, for the Tunix tests.

Each model is loaded by Tunix's own loader (``create_model_from_safe_tensors``)
from a random Hugging Face checkpoint, so what lands on a server can be held
against the checkpoint itself. ``hugging_face`` writes Tunix's tree out as
Hugging Face tensors by hand, not through the library's mapping: the GPU
tests compare vLLM's checksums with it after a training step, where there
is no checkpoint to compare with. Everything here needs ``google-tunix``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# embed, heads, kv heads, head_dim, ffn, vocab, layers, experts: heads * head_dim = 32 != embed
D, N, K, H, F, V, LAYERS, EXPERTS = 12, 4, 2, 8, 20, 32, 2, 3
PAD, EOS, BOS = 0, 1, 2


class ToyTokenizer:
    """What Tunix's ``TokenizerAdapter`` takes from a tokenizer of its own kind:
    one token per character, ids 3..V-1."""

    def encode(self, text):
        return [3 + ord(c) % (V - 3) for c in text]

    def decode(self, ids):
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return BOS

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


def hf_checkpoint(seed: int = 0, *, family: str = "qwen3", tied: bool = False,
                  dtype: Any = np.float32, moe: bool = False) -> dict[str, np.ndarray]:
    """A random Hugging Face checkpoint of ``family`` (``llama3``, ``qwen2``,
    ``qwen3``), as {name: array}; Qwen3 with ``moe`` has ``EXPERTS`` experts."""
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tied:
        shapes["lm_head.weight"] = (V, D)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        })
        if family == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (N * H,), p + "self_attn.k_proj.bias": (K * H,),
                           p + "self_attn.v_proj.bias": (K * H,)})
        if family == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (H,), p + "self_attn.k_norm.weight": (H,)})
        if moe:
            shapes[p + "mlp.gate.weight"] = (EXPERTS, D)
            for e in range(EXPERTS):
                shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (F, D),
                               p + f"mlp.experts.{e}.up_proj.weight": (F, D),
                               p + f"mlp.experts.{e}.down_proj.weight": (D, F)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                           p + "mlp.down_proj.weight": (D, F)})
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32).astype(dtype)
            for name, shape in sorted(shapes.items())}


def tunix_model(folder, checkpoint: dict[str, np.ndarray], *, family: str = "qwen3",
                tied: bool = False, mode: str = "optimized", moe: bool = False):
    """Tunix's model of ``family``, loaded by Tunix's own loader from
    ``checkpoint`` (written to ``folder`` as ``model.safetensors``)."""
    import safetensors.numpy
    os.makedirs(folder, exist_ok=True)
    safetensors.numpy.save_file(checkpoint, os.path.join(folder, "model.safetensors"))
    common = dict(num_layers=LAYERS, vocab_size=V, embed_dim=D, hidden_dim=F, num_heads=N,
                  head_dim=H, num_kv_heads=K, rope_theta=10_000, norm_eps=1e-6)
    if family == "llama3":
        from tunix.models.llama3 import model, params
        config = model.ModelConfig(**common, weight_tying=tied)
    elif family == "qwen2":
        from tunix.models.qwen2 import model, params
        config = model.ModelConfig(**common, use_tied_embedding=tied)
    else:
        from tunix.models.qwen3 import model, params
        extra = dict(num_experts=EXPERTS, num_experts_per_tok=2) if moe else {}
        config = model.ModelConfig(**common, use_tied_embedding=tied, **extra)
    return params.create_model_from_safe_tensors(str(folder), config, mode=mode)


def qwen3_state(seed: int, layers: int = 2, embed: int = 64, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 24, ffn: int = 96, vocab: int = 160):
    """Tunix's Qwen3 ``nnx.state(model, nnx.Param)`` as a pure dict (every leaf
    path ends in ``value``); ``heads * head_dim != embed``, so a swapped
    reshape cannot pass."""
    import jax.numpy as jnp
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16 * layers + 8))
    w = lambda *s: {"value": jax.random.normal(next(keys), s, jnp.bfloat16)}  # noqa: E731
    layer = lambda: {  # noqa: E731
        "attn": {"q_proj": {"w": w(embed, heads, head_dim)},
                 "k_proj": {"w": w(embed, kv_heads, head_dim)},
                 "v_proj": {"w": w(embed, kv_heads, head_dim)},
                 "o_proj": {"w": w(heads, head_dim, embed)},
                 "q_norm": {"w": w(head_dim)}, "k_norm": {"w": w(head_dim)}},
        "mlp": {"gate_proj": {"kernel": w(embed, ffn)}, "up_proj": {"kernel": w(embed, ffn)},
                "down_proj": {"kernel": w(ffn, embed)}},
        "input_layernorm": {"w": w(embed)}, "post_attention_layernorm": {"w": w(embed)}}
    return {"embedder": {"input_embedding": w(vocab, embed)}, "final_norm": {"w": w(embed)},
            "lm_head": {"w": w(embed, vocab)}, "layers": {str(i): layer() for i in range(layers)}}


def hugging_face(tree: Any) -> dict[str, np.ndarray]:
    """The Hugging Face tensors vLLM's Qwen3 loads, written out by hand from
    Tunix's layout (``nnx.state(model, nnx.Param)``, or its pure dict, or a
    dict whose leaves are ``{"value": array}``), not through the library's
    mapping."""
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()

    def v(leaf):
        return np.asarray(leaf["value"] if isinstance(leaf, dict) else leaf)

    out = {"model.embed_tokens.weight": v(tree["embedder"]["input_embedding"]),
           "model.norm.weight": v(tree["final_norm"]["w"])}
    if "lm_head" in tree:
        out["lm_head.weight"] = v(tree["lm_head"]["w"]).T
    for i, layer in tree["layers"].items():
        p, attn, mlp = f"model.layers.{i}.", layer["attn"], layer["mlp"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            x = v(attn[proj]["w"])
            out[f"{p}self_attn.{proj}.weight"] = x.reshape(x.shape[0], -1).T
        o = v(attn["o_proj"]["w"])
        out[f"{p}self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        for norm in ("q_norm", "k_norm"):
            out[f"{p}self_attn.{norm}.weight"] = v(attn[norm]["w"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{proj}.weight"] = v(mlp[proj]["kernel"]).T
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = v(layer[norm]["w"])
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def auto_mesh() -> jax.sharding.Mesh:
    """A one-device mesh with Auto axes, as ``tunix.utils.mesh`` makes them."""
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def build_cluster(actor, engine, mesh=None, **rollout):
    """Tunix's RLCluster with ``engine`` as its rollout engine (a functools.partial)."""
    import optax
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.rollout import base_rollout
    mesh = mesh or auto_mesh()
    config = rlc.ClusterConfig(
        role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
        rollout_engine=engine,
        training_config=rlc.RLTrainingConfig(actor_optimizer=optax.sgd(1e-3),
                                             eval_every_n_steps=10, max_steps=1),
        rollout_config=base_rollout.RolloutConfig(**rollout))
    return rlc.RLCluster(actor=actor, tokenizer=ToyTokenizer(), cluster_config=config)


def token_sum(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """A GRPO reward that differs between samples: the sum of the completion's ids
    (``ToyTokenizer.decode`` writes them out)."""
    return [float(sum(int(t) for t in c.split())) for c in completions]


def grpo_step(cluster, prompts: Sequence[str] = ("ab", "xyz"),
              reward: Callable[..., list[float]] = token_sum) -> None:
    """One step of Tunix's own GRPO learner on ``cluster``: samples from its
    rollout, rewards, one optimizer update of the actor, then the learner's
    ``sync_weights`` (which calls the rollout's ``update_params``)."""
    from tunix.rl.grpo import grpo_learner
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0))
    # one batch, its fields arrays as Tunix's data pipelines yield them (the
    # learner repeats each leaf per generation)
    learner.train([{"prompts": np.array(prompts)}])

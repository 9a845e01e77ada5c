"""A Llama / Qwen3-style decoder in Flax (linen), laid out like Flax ports of
those checkpoints, so ``naming.LLAMA`` names and transposes its parameters.

Grouped-query attention with Qwen3's per-head q/k RMSNorm, SwiGLU MLP, tied
nothing. Rotary embeddings are left out: the demo needs real parameter
shapes and a forward pass that runs, not a language model.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Config:
    vocab: int = 32000
    hidden: int = 512
    intermediate: int = 1408
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    qk_norm: bool = True
    dtype: jnp.dtype = jnp.bfloat16


QWEN3_8B = Config(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32,
                  kv_heads=8, head_dim=128)


class RMSNorm(nn.Module):
    dim: int
    dtype: jnp.dtype
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (self.dim,), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
        return (x32 * scale).astype(x.dtype)


def _dense(features: int, name: str, dtype) -> nn.Dense:
    return nn.Dense(features, use_bias=False, name=name, dtype=dtype, param_dtype=dtype)


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, _ = x.shape
        q = _dense(c.heads * c.head_dim, "q_proj", c.dtype)(x).reshape(b, t, c.heads, c.head_dim)
        k = _dense(c.kv_heads * c.head_dim, "k_proj", c.dtype)(x).reshape(b, t, c.kv_heads, c.head_dim)
        v = _dense(c.kv_heads * c.head_dim, "v_proj", c.dtype)(x).reshape(b, t, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.head_dim, c.dtype, name="q_norm")(q)
            k = RMSNorm(c.head_dim, c.dtype, name="k_norm")(k)
        rep = c.heads // c.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c.head_dim).astype(c.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return _dense(c.hidden, "o_proj", c.dtype)(out.reshape(b, t, -1))


class MLP(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        gate = _dense(c.intermediate, "gate_proj", c.dtype)(x)
        up = _dense(c.intermediate, "up_proj", c.dtype)(x)
        return _dense(c.hidden, "down_proj", c.dtype)(nn.silu(gate) * up)


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        x = x + Attention(c, name="self_attn")(RMSNorm(c.hidden, c.dtype, name="input_layernorm")(x))
        return x + MLP(c, name="mlp")(RMSNorm(c.hidden, c.dtype, name="post_attention_layernorm")(x))


class Decoder(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(c.vocab, c.hidden, dtype=c.dtype, param_dtype=c.dtype,
                     name="embed_tokens")(tokens)
        for i in range(c.layers):
            x = Block(c, name=f"layers_{i}")(x)
        x = RMSNorm(c.hidden, c.dtype, name="norm")(x)
        return _dense(c.vocab, "lm_head", c.dtype)(x)


def init_params(cfg: Config, seed: int = 0) -> dict:
    """Random parameters (``{"params": ...}`` stripped), on JAX's default device."""
    tokens = jnp.zeros((1, 4), jnp.int32)
    return Decoder(cfg).init(jax.random.PRNGKey(seed), tokens)["params"]

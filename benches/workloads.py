"""What the benches push: each workload's tensors, and one measured job.

A workload is a list of (checkpoint name, shape), all bfloat16; every
process builds its tensors from the name alone (the same random keys
everywhere), so a job travels between processes as a few fields of JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

GiB, MiB = 1 << 30, 1 << 20
BF16_BYTES = 2

Spec = list[tuple[str, tuple[int, ...]]]

# A floor's mode (see ``floor.py``), and the mode of the pushes it bounds.
FLOORS = {"prepacked": "packed", "preplaced": "unpacked"}


def layer(n: int) -> Spec:
    """Layer ``n`` of Qwen3-8B: attention, its norms, the MLP."""
    h, i, hd, nq, nkv = 4096, 12288, 128, 32, 8
    p = f"model.layers.{n}."
    return [(p + "self_attn.q_proj.weight", (nq * hd, h)),
            (p + "self_attn.k_proj.weight", (nkv * hd, h)),
            (p + "self_attn.v_proj.weight", (nkv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, nq * hd)),
            (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
            (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]


def workload(name: str) -> Spec:
    """The tensors of workload ``name``.

    Args:
        name: ``qwen3-8b`` (~16.4 GB), ``many-small`` (20,000 x 32 KiB),
            ``large`` (~70 GB), ``tiny`` (one 4 KiB tensor), ``layers4``
            (four qwen3-8b layers, ~1.6 GB).

    Returns:
        (checkpoint name, shape) per tensor, in checkpoint order.
    """
    if name == "qwen3-8b":
        v, h = 151936, 4096
        body = [t for n in range(36) for t in layer(n)]
        return ([("model.embed_tokens.weight", (v, h))] + body
                + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))])
    if name == "many-small":
        return [(f"model.experts.{i}.w", (16384,)) for i in range(20000)]
    if name == "tiny":  # one 4 KiB tensor: a push's fixed cost
        return [("model.norm.weight", (2048,))]
    if name == "layers4":  # ~1.6 GB: four qwen3-8b layers, for the slow link
        return [t for n in range(4) for t in layer(n)]
    if name == "large":
        per_layer = sum(math.prod(s) * BF16_BYTES for _, s in layer(0))
        return [t for n in range(round(70e9 / per_layer)) for t in layer(n)]
    raise ValueError(name)


def tensor_bytes(name: str) -> list[int]:
    """Each tensor's size in bytes, for workload ``name``."""
    return [math.prod(s) * BF16_BYTES for _, s in workload(name)]


@dataclass(frozen=True, kw_only=True)
class Job:
    """One measured job: a workload pushed ``reps`` times (after one warm-up)
    in ``mode`` (``packed``, ``unpacked``, or a floor of ``FLOORS``), through
    ``nbuf`` staging buffers of ``buffer`` bytes. Its JSON is the first keys
    of the job's row."""

    workload: str
    mode: str
    buffer: int = GiB
    nbuf: int = 2
    reps: int

    @property
    def floor(self) -> bool:
        """Whether this job pushes a floor (no sender work), not a real send."""
        return self.mode in FLOORS

    @property
    def packed(self) -> bool:
        """Whether its pushes are packed (a floor: those it bounds)."""
        return FLOORS.get(self.mode, self.mode) == "packed"

    @property
    def default_geometry(self) -> bool:
        """vLLM's default buffers: 1 GiB x 2."""
        return (self.buffer, self.nbuf) == (GiB, 2)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Job:
        """A job from its JSON (extra keys refused)."""
        known = {f.name for f in fields(cls)}
        if set(obj) - known:
            raise ValueError(f"a job has no field {sorted(set(obj) - known)}")
        return cls(**obj)

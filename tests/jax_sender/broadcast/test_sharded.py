"""Sharded parameters: described at full size, gathered one at a time (no GPU).

Runs in a child process with four virtual CPU devices, since JAX fixes its
device count when it starts.
"""

import os
import subprocess
import sys
import textwrap

from support import ROOT

CHILD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_sender import Mapping, describe
    from jax_sender._src.core.tensors.describe import Placement
    devs = jax.devices()
    assert len(devs) == 4, devs
    mesh = Mesh(np.array(devs).reshape(2, 2), ("fsdp", "tp"))
    full = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    sharded = jax.device_put(full, NamedSharding(mesh, P("fsdp", "tp")))
    elsewhere = jax.device_put(full[0], devs[3])
    assert len(sharded.addressable_shards) == 4
    params = {"w": sharded, "b": elsewhere}
    metas, sources = describe(params, Mapping())
    assert [(m.name, m.shape) for m in metas] == [("b", (6,)), ("w", (8, 6))], metas
    for mapping, expect in [(Mapping(), full), (Mapping(transform=lambda p, a: a.T), full.T)]:
        s = Placement(mapping=mapping, device=devs[0], wait_timeout_s=lambda n: 60.0)
        out = s.materialize(("w",), sharded)
        assert out.sharding.device_set == {devs[0]}, out.sharding
        assert np.array_equal(np.asarray(out), np.asarray(expect))
        moved = s.materialize(("b",), elsewhere)
        assert moved.sharding.device_set == {devs[0]}
    print("OK")
""")


def test_sharded_parameters_are_gathered_to_the_sender_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]

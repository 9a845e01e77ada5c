"""Trees to push and what the servers should hold after, for the CPU tests
of ``send`` over the in-memory link."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_sender import SendConfig

from .concurrency import wait_for

SMALL = SendConfig(buffer_size_bytes=4096, num_buffers=2)


def params(seed: int = 0) -> dict:
    """Five tensors of four dtypes; ``embed`` (6 KiB) is a chunk of its own in ``SMALL``."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {"embed": jax.random.normal(k[0], (64, 48), jnp.bfloat16),
            "layer": {"w": jax.random.normal(k[1], (16, 16), jnp.float32),
                      "b": jnp.arange(7, dtype=jnp.int8) + seed,
                      "n": jax.random.normal(k[2], (33,), jnp.bfloat16)},
            "head": jax.random.normal(k[3], (40, 40), jnp.float16)}


def held(server) -> dict[str, bytes]:
    """What a memory server's workers hold, by name."""
    return {k: v.tobytes() for k, v in server.store.items()}


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Name for name, shape, dtype and bytes."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name, w in want.items():
        g = got[name]
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (name, g.shape, g.dtype, w.shape, w.dtype)
        assert g.tobytes() == w.tobytes(), name


def leaves(tree, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """(path, leaf) of a tree of dicts, lists and tuples, in JAX's order (dict
    keys sorted, sequences in order, ``None`` an empty subtree), or of
    ``(name, array)`` pairs; written out here, not read from the library, so
    a wrong name or order there cannot agree with itself."""
    if not path and isinstance(tree, list) and tree and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in tree):
        return [((name,), a) for name, a in tree]
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in leaves(tree[k], (*path, str(k)))]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in leaves(v, (*path, str(i)))]
    return [(path, tree)]


def expected(tree, transform=None) -> dict[str, bytes]:
    """What the workers should hold after ``tree`` was pushed (through
    ``transform``): each leaf's bytes under its dotted path."""
    return {".".join(p): np.asarray(a if transform is None else transform(p, a)).tobytes()
            for p, a in leaves(tree)}


def pushed(server) -> list[str]:
    """The routes a server got since its last init."""
    routes = server.routes()
    inits = [i for i, r in enumerate(routes) if r == "/init_weight_transfer_engine"]
    return routes[inits[-1] + 1 if inits else 0:]


def calls(server, path: str) -> list:
    """The server's log entries for ``path``."""
    return [c for c in server.log if c.path == path]


def answered(server, path: str | None = None) -> bool:
    """Every call the server got (of ``path``) has been answered (a released hold too)."""
    return all(c.answered is not None for c in list(server.log) if path in (None, c.path))


class Held:
    """``server.hold[path]`` for the block; released when it ends (even on a
    failure), then waits until every call the server got was answered, so
    its state is settled before the test goes on."""

    def __init__(self, server, path: str):
        self.server, self.path = server, path

    def __enter__(self) -> Held:
        self.server.hold[self.path] = threading.Event()
        return self

    def __exit__(self, *exc) -> None:
        self.server.hold.pop(self.path).set()
        assert wait_for(lambda: answered(self.server)), f"{self.path}: a call never answered"


def comm(sender):
    """The sender's communicator (a ``MemoryComm`` over the link)."""
    return sender.session.connection.comm


def torch_layout(path, x):
    """What a Flax trainer's mapping does: kernels transposed, float32 cast to bfloat16."""
    if path[-1] in ("w", "head"):
        x = x.T
    return x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x


def every_dtype(seed: int = 0) -> dict:
    """One tensor of each wire dtype JAX holds, spread over several chunks of ``SMALL``."""
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    return {"a": {"w": jax.random.normal(k[0], (24, 40), jnp.float32),
                  "b": jax.random.randint(k[1], (37,), -128, 127, jnp.int8),
                  "u": jax.random.randint(k[2], (11,), 0, 255, jnp.int32).astype(jnp.uint8)},
            "f8": jax.random.normal(k[3], (300,), jnp.float32).astype(jnp.float8_e4m3fn),
            "i": jax.random.randint(k[4], (5, 3), -2**31, 2**31 - 1, jnp.int32),
            "head": jax.random.normal(k[5], (40, 40), jnp.float16)}


def slow_step():
    """A jitted step that returns the tree it is given, but only after seconds
    of CPU work: its outputs exist well after it is dispatched."""
    a = jnp.full((1500, 1500), 0.01, jnp.float32)
    heavy = jax.jit(lambda a: jax.lax.fori_loop(0, 120, lambda i, x: jnp.tanh(x @ a), a))
    step = jax.jit(lambda t: jax.tree_util.tree_map(
        lambda x: x + (heavy(a)[0, 0] * 0).astype(x.dtype), t))
    jax.block_until_ready(step(params(1)))  # compiled
    return step

"""Settings and inputs that used to fail late or silently: each is refused
when given, in one sentence naming it, or kept exact.

* ``SendConfig`` deadlines past what a timed wait takes (``OverflowError`` at
  every push, then a ``close()`` that left the servers' engines initialized,
  or a ``reconnect()`` that left the sender broken), and sizes past what a
  GPU holds;
* host (numpy) arrays of 64-bit dtypes, which JAX narrows while
  ``jax_enable_x64`` is off (``[2**40, 7]`` arrived as ``[0, 7]``): refused,
  naming the fix; sent exactly with x64 on (in a child, where it is on).
"""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender import MetadataError, SendConfig

from support import ROOT, on_tests_path
from support.pushes import expected, held, params, pushed
from support.servers.memory_link import memory_sender

PAST_THE_BOUND = {
    "send_timeout_s=1e10": (dict(send_timeout_s=1e10), "send_timeout_s", "at most 10000"),
    "send_timeout_s just past": (dict(send_timeout_s=1e4 + 1), "send_timeout_s", "at most 10000"),
    "reconnect_timeout_s=1e12": (dict(reconnect_timeout_s=1e12), "reconnect_timeout_s",
                                 "at most 1e+06"),
    "init_timeout_s=1e7": (dict(init_timeout_s=1e7), "init_timeout_s", "at most 1e+06"),
    "buffer_size_bytes=10**30": (dict(buffer_size_bytes=10**30), "buffer_size_bytes",
                                 f"from 1 to {2**40}"),
    "buffer_size_bytes just past": (dict(buffer_size_bytes=2**40 + 1), "buffer_size_bytes",
                                    f"from 1 to {2**40}"),
    "num_buffers=10**18": (dict(num_buffers=10**18), "num_buffers", "from 1 to 64"),
}


@pytest.mark.parametrize("setting,name,bound", PAST_THE_BOUND.values(), ids=PAST_THE_BOUND.keys())
def test_a_setting_that_would_overflow_later_is_refused_when_made(setting, name, bound):
    """Each was accepted, then every push raised OverflowError (a socket's
    timeout past about 9.2e9 s; a wait's deadline derived from a 10**30-byte
    chunk); a num_buffers of 10**18 makes every vLLM worker fail as an update
    starts (a stream and a slot per buffer)."""
    with pytest.raises(MetadataError) as e:
        SendConfig(**setting)
    message = str(e.value)
    assert message.startswith(f"SendConfig.{name} must be ") and bound in message
    assert ". " not in message and "\n" not in message


def test_every_setting_at_its_bound_pushes_reconnects_and_closes():
    """What is accepted does not overflow later: a push, a reconnect and a
    close at the bounds, each server's engine shut down at the end."""
    config = SendConfig(send_timeout_s=1e4, init_timeout_s=1e6, reconnect_timeout_s=1e6,
                        buffer_size_bytes=2**40, num_buffers=64)
    sender, (server,), _ = memory_sender(config)
    sender.send(params(), weight_version="v1")
    assert held(server) == expected(params())
    sender.reconnect()
    sender.send(params(1), weight_version="v2")
    assert held(server) == expected(params(1)) and server.weight_version == "v2"
    sender.close()
    assert server.routes()[-1] == "/shutdown_weight_transfer_engine"


HOST_64 = {
    "int64": (np.array([2**40, 7], np.int64), "int64", "int32"),
    "float64": (np.array([0.1, 1e30]), "float64", "float32"),
    "an int64 scalar": (np.int64(2**40), "int64", "int32"),
}


@pytest.mark.parametrize("array,dtype,narrowed", HOST_64.values(), ids=HOST_64.keys())
def test_a_64_bit_host_array_is_refused_naming_the_fix(array, dtype, narrowed):
    """With x64 off (JAX's default, and this process's), JAX narrows it
    silently: refused before any request of the push, as a tree leaf and as
    a ``(name, array)`` pair; the same tree as 32-bit arrays pushes."""
    sender, (server,), _ = memory_sender()
    for tree in ({"w": jnp.ones(3), "ids": array}, [("w", jnp.ones(3)), ("ids", array)]):
        with pytest.raises(MetadataError) as e:
            sender.send(tree)
        message = str(e.value)
        assert f"'ids' is {dtype}, which JAX turns into {narrowed}" in message
        assert "jax.config.update('jax_enable_x64', True)" in message
        assert f"cast it to {narrowed} yourself" in message and ". " not in message
    assert pushed(server) == []  # no request of any push
    sender.send({"w": jnp.ones(3), "ids": np.asarray(array, narrowed)})
    assert len(pushed(server)) == 3
    sender.close()


def test_a_python_int_past_int32_is_refused_in_one_sentence():
    """It was a bare OverflowError from JAX's tracing."""
    sender, (server,), _ = memory_sender()
    with pytest.raises(MetadataError, match=r"the value at 'step' is the Python int 1099511627776"):
        sender.send({"w": jnp.ones(3), "step": 2**40})
    assert pushed(server) == []
    sender.close()


X64_PUSH = """
import jax
import numpy as np
from support.servers.memory_link import memory_sender
assert jax.config.jax_enable_x64
sent = {"ids": np.array([2**40, 7, -2**62], np.int64), "w": np.array([0.1, 1e300, -0.0])}
sender, (server,), _ = memory_sender()
sender.send(sent, weight_version="x64")
for name, a in sent.items():
    got = server.store[name]
    assert got.dtype == a.dtype and got.tobytes() == a.tobytes(), (name, got, a)
sender.close()
print("exact")
"""


def test_with_x64_on_a_64_bit_host_array_is_sent_exactly():
    """int64 and float64 are wire dtypes of vLLM: with x64 on, JAX keeps them
    and the workers get the very bytes (a child, started with x64 on)."""
    env = on_tests_path(dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu"))
    out = subprocess.run([sys.executable, "-c", X64_PUSH], capture_output=True, text=True,
                         env=env, timeout=240, cwd=str(ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "exact", out.stderr[-3000:]

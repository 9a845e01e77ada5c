import os
import signal

import jax
import pytest

from jax_sender.testing.harness import SHARE_GPUS, gpu_count

pytest_plugins = ["support.children.sigterm"]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# The pytest process itself stays off the GPUs (XLA would preallocate 75% of
# every one); GPU tests run their ranks as child processes, one GPU each.
# A config update, not JAX_PLATFORMS, so the children do not inherit it.
jax.config.update("jax_platforms", "cpu")


GPUS = gpu_count()
# With JAX_SENDER_SHARE_GPUS=n the ranks share n GPUs (see harness.gpu_env):
# the 4-rank tests run on 2, every test on 1.
SHARED = GPUS >= 1 and bool(os.environ.get(SHARE_GPUS))
TWO_RANKS = GPUS >= 2 or SHARED
FOUR_RANKS = GPUS >= 4 or SHARED


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handling for a test that sends SIGINT: a run
    started in the background of a script has SIGINT ignored, and its
    Ctrl-Cs would then test nothing."""
    before = signal.getsignal(signal.SIGINT)
    if before in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if before in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, before)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu1" in item.keywords and GPUS < 1:
            item.add_marker(pytest.mark.skip(reason="needs one CUDA GPU, found 0"))
        elif "gpu4" in item.keywords and not FOUR_RANKS:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 4 GPUs (or fewer with {SHARE_GPUS}=2 or 1), found {GPUS}"))
        elif "gpu" in item.keywords and not TWO_RANKS:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 2 GPUs (or 1 with {SHARE_GPUS}=1), found {GPUS}"))

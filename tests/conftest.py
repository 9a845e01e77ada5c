import os

import jax
import pytest

from jax_sender.testing.harness import SHARE_GPUS, gpu_count

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# The pytest process itself stays off the GPUs (XLA would preallocate 75% of
# every one); GPU tests run their ranks as child processes, one GPU each.
# A config update, not JAX_PLATFORMS, so the children do not inherit it.
jax.config.update("jax_platforms", "cpu")


GPUS = gpu_count()
# With JAX_SENDER_SHARE_GPUS the 4-rank tests share 2 GPUs (see harness.gpu_env).
FOUR_RANKS = GPUS >= 4 or (GPUS >= 2 and bool(os.environ.get(SHARE_GPUS)))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu4" in item.keywords and not FOUR_RANKS:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 4 GPUs (or 2 with {SHARE_GPUS}=2), found {GPUS}"))
        elif "gpu" in item.keywords and GPUS < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, found {GPUS}"))

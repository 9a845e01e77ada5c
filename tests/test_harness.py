"""The child-process environment that puts ranks on GPUs (``harness.gpu_env``)."""

import pytest

from jax_sender.harness import SHARE_GPUS, gpu_env


def test_one_rank_per_gpu_by_default(monkeypatch):
    monkeypatch.delenv(SHARE_GPUS, raising=False)
    for name in ("NCCL_HOSTID", "NCCL_NET", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    env = gpu_env(3)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["NCCL_NVLS_ENABLE"] == "0"
    assert not {"NCCL_HOSTID", "NCCL_NET", "XLA_PYTHON_CLIENT_PREALLOCATE"} & set(env)


@pytest.mark.parametrize("share", ["1", "2", "3"])
def test_shared_gpus_fold_ranks_and_give_each_its_own_host(monkeypatch, share):
    monkeypatch.setenv(SHARE_GPUS, share)
    envs = [gpu_env(g) for g in range(4)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [str(g % int(share)) for g in range(4)]
    # NCCL refuses two ranks of one host on one device: every rank is a host.
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert {(e["NCCL_NET"], e["NCCL_SOCKET_IFNAME"]) for e in envs} == {("Socket", "lo")}
    # Two JAX processes on one GPU cannot both take 75% of it up front.
    assert {e["XLA_PYTHON_CLIENT_PREALLOCATE"] for e in envs} == {"false"}

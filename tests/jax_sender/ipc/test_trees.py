"""A model's tree by name through the IPC sender: Tunix's Qwen3 state through
``TUNIX_QWEN3`` lands in vLLM 0.33.0's real ``ipc`` worker engine as the
Hugging Face tensors vLLM loads (on CPU: ``support.ipc_fabric`` stands in
for CUDA, as in ``test_push``)."""

from __future__ import annotations

import hashlib

import jax
import pytest

from jax_sender import TUNIX_QWEN3, SendConfig
from jax_sender._src.ipc.sender import open_ipc_sender
from uniqueid import VLLMClient

from support.ipc_fabric import FabricMemory
from support.tiny_tunix import hugging_face, qwen3_state
from support.vllm_children import ipc_fabric_host


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("ipc-trees") / "requests.jsonl"
    with ipc_fabric_host(log, "0") as served:
        yield served


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_a_tunix_qwen3_state_lands_as_the_hugging_face_tensors(url, packed):
    memory = FabricMemory()
    config = SendConfig(packed=packed, buffer_size_bytes=1 << 14)
    with open_ipc_sender([VLLMClient(url)], {0: jax.devices("cpu")[0]}, mapping=TUNIX_QWEN3,
                         config=config, memory=memory, strict_devices=False) as sender:
        for seed in (1, 2):
            state = qwen3_state(seed)
            sender.send(state, weight_version=f"tunix-{seed}")
            want = {f"dp0:pp0:pcp0:tp0:{name}": hashlib.sha256(a.tobytes()).hexdigest()
                    for name, a in hugging_face(state).items()}
            held = sender.session.clients[0].weight_checker("checksum")["checksums"]
            assert {k: held.get(k) for k in want} == want
            assert sender.verify(state).ok
    assert memory.alive() == []

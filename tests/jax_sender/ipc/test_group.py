"""Two trainer processes of one IPC group (``IPCSender.connect_group``)
against vLLM 0.33.0's real ``ipc`` engine on CPU: a worker on each
process's stand-in GPU (``support.ipc_fabric``), process 0 posting every
update with both processes' handles, merged through the group's store
(``uniqueid.ipc.group``). Each scenario is ``support.children.ipc_group``
in two processes; the weights are checked by vLLM's own digests."""

import os
import subprocess

import pytest

from jax_sender.testing.harness import free_port, run_all

from support import ROOT, child
from support.vllm_children import ipc_fabric_host


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vLLM's ipc engine in a worker on stand-in GPU 0 and one on GPU 1."""
    log = tmp_path_factory.mktemp("group") / "requests.jsonl"
    with ipc_fabric_host(log, "0,1") as url:
        yield url


def group(url: str, scenario: str, mode: str, processes=(0, 1), timeout: float = 240) -> list[str]:
    """``scenario`` in trainer processes ``processes`` of a group of two; their outputs."""
    store = f"127.0.0.1:{free_port()}"
    procs = []
    for p in processes:
        argv, env = child("children.ipc_group", scenario, str(p), url, store, mode,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return run_all(procs, timeout)


@pytest.mark.parametrize("mode", ["packed", "unpacked"])
def test_two_processes_push_exactly_each_worker_reading_its_own_gpus_process(server, mode):
    """Several chunks (packed), a changed tree, a reconnect of both."""
    outs = group(server, "push", mode)
    assert "chunk" in outs[0]


@pytest.mark.parametrize("mode", ["packed", "unpacked"])
def test_a_process_whose_copies_fail_fails_the_push_on_both_and_the_next_is_exact(server, mode):
    group(server, "copy_fails", mode)


def test_a_process_pushing_other_tensors_is_refused_before_they_load(server):
    group(server, "other_tree", "unpacked")


def test_a_process_that_never_comes_is_named_at_the_connects_deadline(server):
    (out,) = group(server, "alone", "packed", processes=(0,))
    assert "trainer process 1" in out and "connect_group" in out

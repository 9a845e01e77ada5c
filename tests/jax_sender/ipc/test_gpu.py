"""The colocated push on a GPU: vLLM 0.33.0's real ``IPCWeightTransferEngine``
in two tensor-parallel workers on the trainer's own GPU (``vllm_ipc.py``),
the trainer a child process on that GPU (``support.children.ipc_scenarios``).
No NCCL anywhere in the push. Every server is killed with its process group.
"""

import subprocess
import time

import pytest

from jax_sender.testing.harness import VLLMServer, gpu_env, vllm_available
from uniqueid import redact

from support import ROOT, child

pytestmark = pytest.mark.gpu1


def run(name: str, *args: str, timeout: float = 300) -> str:
    argv, env = child("children.ipc_scenarios", name, *args, env=gpu_env("0"))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout
    return out.stdout


def server(tmp_path, *args: str, env: dict | None = None) -> VLLMServer:
    if not vllm_available():
        pytest.skip("vLLM 0.33.0's tree (.vllm/) is not importable here")
    log = tmp_path / "requests.jsonl"
    return VLLMServer("0,0", output=log.with_suffix(".out"), requests=log, ipc=True, args=args,
                      env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})})


def shown(tmp_path) -> None:
    out = tmp_path / "requests.out"
    print("vLLM server output:", redact(out.read_text()[-4000:]) if out.exists() else "none")


@pytest.fixture(scope="module")
def ipc_served(tmp_path_factory):
    """One server for the tests that leave it ready for the next, and its process."""
    folder = tmp_path_factory.mktemp("ipc")
    served = server(folder)
    with served as url:
        yield url, served.proc.pid
    shown(folder)


@pytest.fixture
def ipc_server(ipc_served):
    return ipc_served[0]


def test_ipc_arguments_agree_with_torchs_own_producer():
    print(run("torch_contract"))


@pytest.mark.parametrize("mode", ["packed", "unpacked"])
def test_ipc_push_into_vllms_ipc_engine(ipc_server, mode):
    print(run("push", ipc_server, mode, "2"))


def test_ipc_soak_of_100_pushes(ipc_served):
    url, pid = ipc_served
    print(run("soak", url, "100", str(pid), timeout=500))


@pytest.mark.parametrize("times", ["1", "2"])
def test_ipc_ctrl_c_once_and_twice_then_the_same_server(ipc_server, times):
    print(run("ctrl_c", ipc_server, times))


def test_ipc_a_trainer_killed_mid_push_then_a_fresh_trainer(ipc_server, tmp_path):
    argv, env = child("children.ipc_scenarios", "killed_mid_push", ipc_server, env=gpu_env("0"))
    with open(tmp_path / "trainer.err", "w") as err:
        trainer = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                   cwd=ROOT)
        try:
            line = trainer.stdout.readline()
            time.sleep(0.5)  # into the push's rounds
        finally:
            trainer.kill()
            rest = trainer.communicate(timeout=30)[0]
    assert "INSIDE THE PUSH" in line, (tmp_path / "trainer.err").read_text()[-3000:]
    assert "PUSH ENDED" not in rest, "the trainer was killed after its push, not inside it"
    print(run("fresh_push", ipc_server))


@pytest.mark.parametrize("mode", ["packed", "unpacked"])
def test_ipc_a_workers_load_failure_then_the_same_server(tmp_path, mode):
    try:
        with server(tmp_path, "--fail-load-after", "3") as url:
            print(run("load_fails", url, mode))
    finally:
        shown(tmp_path)


@pytest.mark.parametrize("args, env, why", [
    (("--backend", "nccl"), {}, "needs vLLM's ipc backend"),
    ((), {"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"}, "VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
])
def test_ipc_refusals_before_the_server_is_touched(tmp_path, args, env, why):
    try:
        with server(tmp_path, *args, env=env) as url:
            print(run("refused", url, why))
    finally:
        shown(tmp_path)

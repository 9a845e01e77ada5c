"""A wrong setup reads as one sentence that names the cause and the fix, not
a traceback: each case in a child process with that case's environment (this
machine has no GPU and no NVIDIA driver)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_sender import TransferError

ROOT = pathlib.Path(__file__).resolve().parents[3]


def child(*args: str, code: str | None = None, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code] if code else [sys.executable, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=dict(os.environ, **env))


def one_sentence(out: subprocess.CompletedProcess) -> str:
    text = (out.stdout + out.stderr).strip()
    assert "Traceback" not in text, text[-3000:]
    assert out.returncode != 0 and len(text.splitlines()) == 1, text[-3000:]
    return text


@pytest.mark.parametrize("script", ["benches/bench.py", "benches/per_op.py"])
def test_benchmarks_without_gpus(script):
    text = one_sentence(child(script))
    assert "needs 2 NVIDIA GPUs and found 0" in text


def test_vllms_sparse_engine_without_its_tree(tmp_path):
    text = one_sentence(child("-m", "jax_sender.testing.vllm_sparse", str(tmp_path),
                              "--port", "1", "--log", str(tmp_path / "log")))
    assert "has no server.py or shim.py" in text and "docs/testing.md" in text


def test_demo_without_jax():
    code = ("import sys; sys.modules['jax'] = None\n"
            "from jax_sender.demo.__main__ import main\nsys.exit(main([]))")
    out = child(code=code)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stdout.strip() == ("The demo needs JAX with CUDA and Flax (jax is missing): "
                                  "pip install 'jax-vllm-nccl[cuda13]'. Nothing was run.")


def test_demo_without_a_gpu():
    out = child("-m", "jax_sender.demo")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "needs an NVIDIA GPU and its driver (found none)" in out.stdout


@pytest.mark.parametrize("gpus, says", [("abc", "takes CUDA device numbers"),
                                         ("0", "JAX sees no GPU")])
def test_reference_server_refuses_gpus_it_cannot_use(gpus, says):
    out = child("-m", "jax_sender.testing.server", "--gpus", gpus)
    assert out.returncode != 0 and "READY" not in out.stdout
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_reference_server_needs_gpus_or_an_explicit_no_workers():
    out = child("-m", "jax_sender.testing.server")
    assert out.returncode == 2 and "--gpus --no-workers is required" in out.stderr


def test_connect_where_jax_has_no_gpu_names_the_fix():
    from jax_sender import WeightSender
    with pytest.raises(TransferError, match=r"JAX sees no GPU here.*\[cuda13\]"):
        WeightSender.connect("http://127.0.0.1:9")


@pytest.mark.parametrize("call", ["Communicator.init_rank(2, get_unique_id(), 0, 0)",
                                  "cuda.Stream(0)", "cuda.DeviceMemory(8, 0)"])
def test_device_calls_without_a_driver_say_so(call):
    code = ("from nccl_cffi import Communicator, CudaError, cuda, get_unique_id\n"
            f"try:\n    {call}\nexcept CudaError as e:\n    print(e)\n")
    out = child(code=code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("no NVIDIA driver found") and "libcuda.so.1" in out.stdout


def test_bench_ranks_get_their_ids_in_the_environment_not_the_command_line(tmp_path):
    """A failing rank's error prints its command line; an id is a credential."""
    import importlib.util  # benches/ is no package: its process helpers, loaded by path
    spec = importlib.util.spec_from_file_location("procs", ROOT / "benches" / "procs.py")
    procs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(procs)
    role = tmp_path / "roles.py"
    role.write_text("import json, os, sys\n"
                    "print('RESULT ' + json.dumps([sys.argv, os.environ['JAX_SENDER_BENCH_IDS']]))\n")
    secret = "c2VjcmV0" * 21 + "c2U="
    (argv, ids), = procs.ranks("role_x", 1, "7", ids=secret, script=role)[0]
    assert json.loads(ids) == secret and secret not in " ".join(argv)

"""Torch's CUDA IPC producer contract without torch: the rebuild arguments,
their pickle read by torch's own unpickler and bound by torch's own
``rebuild_cuda_tensor`` (torch in a child: ``JAX_SENDER_VLLM_PYTHON``),
vLLM's own decoder of ``ipc_handles_pickled`` (accepted with its flag,
refused without), and the ref-counter file's layout."""

import base64
import json
import os
import pickle
import struct
import subprocess
import sys

import pytest

from uniqueid.ipc.counters import (
    FILE_BYTES,
    HEADER_BYTES,
    SLOTS,
    CountersHeld,
    RefCounters,
    sweep,
)
from uniqueid.ipc.handles import Global, RebuildArgs, Reduce, pickled
from uniqueid.ipc.wire import IPCInitInfo, IPCUpdateInfo

from support import ROOT, on_tests_path
from support.vllm_children import interpreter

ARGS = RebuildArgs(shape=(3, 4), dtype="bfloat16", itemsize=2, device=0,
                   handle=bytes(range(64)), offset=512, counter="/jax_vllm_1_ab", slot=9999)

TORCH_READS = r"""
import base64, inspect, json, pickle, sys, torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
obj = pickle.loads(base64.b64decode(sys.stdin.read()))
args = obj["uuid-0"]
inspect.signature(rebuild_cuda_tensor).bind(*args)
want = (torch.Tensor, torch.Size((3, 4)), (4, 1), 0, torch.storage.TypedStorage, torch.bfloat16,
        0, b"\x02c" + bytes(range(64)), 24, 512, False, b"/jax_vllm_1_ab", 9999, bytes(64), False)
print(json.dumps({"equal": args == want, "types": [type(a).__name__ for a in args],
                  "dtypes": [str(d) for d in obj["dtypes"]], "big": obj["big"]}))
"""

VLLM_DECODES = r"""
import os, sys, json
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = sys.argv[1]
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
try:
    info = IPCWeightTransferUpdateInfo(**json.loads(sys.stdin.read()))
    print(json.dumps({"ok": True, "uuids": list(info.ipc_handles), "sizes": info.tensor_sizes}))
except ValueError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"""


def run(code: str, stdin: str, *argv: str) -> dict:
    out = subprocess.run([interpreter(), "-c", code, *argv], input=stdin, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_torchs_unpickler_builds_torchs_own_arguments_and_rebuild_takes_them():
    dtypes = [Global("torch", d) for d in ("int8", "uint8", "int32", "int64", "float16",
                                           "float32", "float64", "bfloat16", "float8_e4m3fn")]
    got = run(TORCH_READS, pickled({"uuid-0": ARGS.to_tuple(), "dtypes": dtypes,
                                    "big": [2**40, -2**40, -1, 255, 256, "x" * 300]}))
    assert got["equal"], got["types"]
    assert got["types"] == ["_TensorMeta", "Size", "tuple", "int", "type", "dtype", "int",
                            "bytes", "int", "int", "bool", "bytes", "int", "bytes", "bool"]
    assert got["dtypes"] == ["torch.int8", "torch.uint8", "torch.int32", "torch.int64",
                             "torch.float16", "torch.float32", "torch.float64",
                             "torch.bfloat16", "torch.float8_e4m3fn"]
    assert got["big"] == [2**40, -2**40, -1, 255, 256, "x" * 300]


@pytest.mark.parametrize("flag, accepted", [("1", True), ("0", False)])
def test_vllms_decoder_takes_the_payload_only_behind_its_flag(flag, accepted):
    payload = IPCUpdateInfo(names=["a"], dtype_names=["bfloat16"], shapes=[[3, 4]],
                            tensor_sizes=[24],
                            ipc_handles_pickled=pickled({"uuid-0": ARGS.to_tuple()})).to_payload()
    got = run(VLLM_DECODES, json.dumps(payload), flag)
    if accepted:
        assert got == {"ok": True, "uuids": ["uuid-0"], "sizes": [24]}
    else:
        assert not got["ok"] and "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in got["error"]


def test_pythons_unpickler_reads_the_same_structure_without_torch():
    class Named(str):
        def __call__(self, *args):  # REDUCE: torch.Size((3, 4))
            return (str(self), args)

    class Names(pickle.Unpickler):
        def find_class(self, module, name):
            return Named(f"{module}.{name}")

    import io
    obj = Names(io.BytesIO(base64.b64decode(pickled([ARGS.to_tuple(), {"k": (True, b"")}])))).load()
    (args, rest) = obj
    assert rest == {"k": (True, b"")}
    assert args[0] == "torch.Tensor" and args[4] == "torch.storage.TypedStorage"
    assert args[1] == ("torch.Size", ((3, 4),)) and args[2] == (4, 1) and args[9] == 512
    assert args[5] == "torch.bfloat16" and args[7][:2] == b"\x02c" and len(args[7]) == 66


TORCH_READS_MANY = r"""
import base64, json, pickle, sys, torch
exports = pickle.loads(base64.b64decode(sys.stdin.read()))
print(json.dumps({"n": len(exports), "ok": all(
    list(e) == ["uuid-0"] and e["uuid-0"][0] is torch.Tensor and e["uuid-0"][5] is torch.float16
    and e["uuid-0"][1] == torch.Size((k + 1,))
    and e["uuid-0"][7] == b"\x02c" + (k % 300).to_bytes(2, "little") * 32
    and e["uuid-0"][11] == b"/jax_vllm_1_ab" and e["uuid-0"][12] == k
    for k, e in enumerate(exports))}))
"""


def test_an_unpacked_payloads_repeats_read_back_as_torch_builds_them():
    """Hundreds of exports repeating torch's classes, a dtype, a UUID, the
    counter file and 300 handles, each twice (so the memo's indices pass 255)."""
    exports = [{"uuid-0": RebuildArgs(shape=(k + 1,), dtype="float16", itemsize=2, device=0,
                                      handle=(k % 300).to_bytes(2, "little") * 32,
                                      offset=256 * k,
                                      counter="/jax_vllm_1_ab", slot=k).to_tuple()}
               for k in range(600)]
    assert run(TORCH_READS_MANY, pickled(exports)) == {"n": 600, "ok": True}


def test_what_the_arguments_refuse():
    with pytest.raises(ValueError, match="64 bytes"):
        RebuildArgs(shape=(1,), dtype="uint8", itemsize=1, device=0, handle=b"x", offset=0,
                    counter="/c", slot=0)
    with pytest.raises(ValueError, match="multiple of bfloat16"):
        RebuildArgs(shape=(1,), dtype="bfloat16", itemsize=2, device=0, handle=bytes(64),
                    offset=3, counter="/c", slot=0)
    with pytest.raises(TypeError, match="cannot pickle float"):
        pickled({"x": 1.5})
    assert Reduce(Global("torch", "Size"), ((0,),)).callable.name == "Size"


def test_the_payloads_are_vllms_0_33_keys():
    assert IPCInitInfo(packed=True).to_payload() == {"packed": True}
    with pytest.raises(TypeError):
        IPCInitInfo(packed=1)
    unpacked = IPCUpdateInfo(names=["a"], dtype_names=["uint8"], shapes=[[1]],
                             ipc_handles_pickled="eA==").to_payload()
    assert set(unpacked) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}
    with pytest.raises(ValueError, match="tensor_sizes"):
        IPCUpdateInfo(names=["a"], dtype_names=["uint8"], shapes=[[1]], tensor_sizes=[],
                      ipc_handles_pickled="eA==")


def test_the_ref_counter_file_is_torchs_layout_and_goes_at_close():
    counters = RefCounters()
    path = "/dev/shm" + counters.name
    assert os.path.getsize(path) == FILE_BYTES == HEADER_BYTES + 8 * SLOTS
    with open(path, "rb") as f:
        raw = f.read()
    assert struct.unpack_from("<i", raw, 0)[0] == 1  # the producer maps it
    taken = counters.take(3)
    with open(path, "rb") as f:
        raw = f.read()
    assert [struct.unpack_from("<q", raw, HEADER_BYTES + 8 * s)[0] for s in taken] == [1, 1, 1]
    with open(path, "r+b") as f:  # a worker gives one back, as torch's receiver does
        f.seek(HEADER_BYTES + 8 * taken[1])
        f.write(struct.pack("<q", 0))
    assert counters.held(taken) == [taken[0], taken[2]]
    with pytest.raises(CountersHeld, match="--ipc=host"):
        counters.wait(taken, 0.05, "a test buffer")
    counters.drop(taken)
    counters.wait(taken, 0.05, "a test buffer")
    assert len(counters.take(SLOTS)) == SLOTS  # every slot free again
    with pytest.raises(CountersHeld, match="still held"):
        counters.take(1)
    counters.close()
    assert not os.path.exists(path)


HOLDER = ("import sys, time; from uniqueid.ipc.counters import RefCounters; "
          "c = RefCounters(sys.argv[1]); print(c.name, flush=True); time.sleep(60)")


def test_a_killed_trainers_ref_counter_file_goes_at_the_next_ones_start():
    """A SIGKILLed producer cannot unlink its file; the next one removes it
    (its lock is free), and leaves a live producer's file (locked) alone."""
    prefix = f"jax_vllm_test{os.getpid()}"
    holders = [subprocess.Popen([sys.executable, "-c", HOLDER, prefix], stdout=subprocess.PIPE,
                                text=True, env=on_tests_path(dict(os.environ)), cwd=ROOT)
               for _ in range(2)]
    try:
        dead, alive = ("/dev/shm" + h.stdout.readline().strip() for h in holders)
        holders[0].kill()
        holders[0].wait(10)
        assert os.path.exists(dead) and os.path.exists(alive)
        counters = RefCounters(prefix)
        assert not os.path.exists(dead) and os.path.exists(alive)
        assert os.path.exists("/dev/shm" + counters.name)  # its own: made locked, then named
        counters.close()
    finally:
        for h in holders:
            h.kill()
            h.wait(10)
    assert sweep(prefix) == [alive[len("/dev/shm/"):]]  # now gone too

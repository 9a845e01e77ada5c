"""Dtype mapping, error translation and argument validation (no GPU)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nccl_cffi
from nccl_cffi import results
from nccl_cffi.comm import Communicator


@pytest.mark.parametrize("spelling,code", [
    (np.int8, 0), (np.dtype("uint8"), 1), ("int32", 2), (np.uint32, 3), ("torch.int64", 4),
    (np.float16, 6), ("half", 6), (jnp.float32, 7), ("float", 7), (np.float64, 8),
    (jnp.bfloat16, 9), (ml_dtypes.bfloat16, 9), ("torch.bfloat16", 9),
    (jnp.float8_e4m3fn, 10), ("float8_e4m3fn", 10), (ml_dtypes.float8_e5m2, 11),
])
def test_every_spelling_maps_to_nccl(spelling, code):
    assert nccl_cffi.nccl_type(spelling, 22809) == code


def test_torch_dtype_objects_by_name():
    class FakeTorchDtype:  # what str(torch.bfloat16) looks like, without torch
        def __str__(self):
            return "torch.bfloat16"
    assert nccl_cffi.dtype_name(FakeTorchDtype()) == "bfloat16"


@pytest.mark.parametrize("bad", [np.complex64, "bool", np.bool_, "float8_e4m3fnuz", object])
def test_unsupported_dtypes_are_refused(bad):
    with pytest.raises(TypeError):
        nccl_cffi.nccl_type(bad, 22809)


def test_fp8_needs_a_recent_nccl():
    with pytest.raises(TypeError, match="needs NCCL >= 22400"):
        nccl_cffi.nccl_type("float8_e4m3fn", 21805)


def test_numpy_dtype_round_trip():
    for name in nccl_cffi.NCCL_TYPES:
        assert nccl_cffi.dtype_name(nccl_cffi.numpy_dtype(name)) == name


# What ncclGetErrorString says for each result code (nccl.h's ncclResult_t;
# the same text in every NCCL 2.2x and 2.30 release checked).
NCCL_TEXT = {1: "unhandled cuda error", 2: "unhandled system error", 3: "internal error",
             4: "invalid argument", 5: "invalid usage",
             6: "remote process exited or there was a network error", 8: "timeout"}


@pytest.mark.parametrize("code,cls", [
    (1, nccl_cffi.UnhandledCudaError), (2, nccl_cffi.NcclSystemError),
    (3, nccl_cffi.InternalError), (4, nccl_cffi.InvalidArgumentError),
    (5, nccl_cffi.InvalidUsageError), (6, nccl_cffi.RemoteError), (8, nccl_cffi.NcclTimeoutError),
])
def test_result_codes_become_typed_errors(code, cls):
    err = results.make_error(code, "ncclBroadcast")
    assert type(err) is cls and err.code == code
    assert str(err).startswith(f"ncclBroadcast failed: {NCCL_TEXT[code]}")
    assert str(err).endswith(f"(ncclResult_t {code})")


def test_success_and_in_progress_pass():
    assert results.check(0, "x") == 0
    assert results.check(7, "x") == 7
    with pytest.raises(nccl_cffi.InvalidArgumentError):
        results.check(4, "x")


@pytest.mark.parametrize("text,hint", [
    ("Mismatched NCCL version detected : rank 0 version 22803 rank 1 version 22809", "NCCL_LIBRARY"),
    ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000", "distinct GPU"),
])
def test_init_failures_say_what_to_do(monkeypatch, text, hint):
    monkeypatch.setattr(results, "last_error", lambda comm=None: text)
    err = results.make_error(5, "ncclCommInitRank")
    assert text in str(err) and "Fix:" in str(err)
    assert {"NCCL_LIBRARY": "VLLM_NCCL_SO_PATH", "distinct GPU": "CUDA_VISIBLE_DEVICES"}[hint] in str(err)
    assert err.last_error == text


@pytest.mark.parametrize("kwargs,match", [
    (dict(nranks=0, rank=0, device=0), "nranks"),
    (dict(nranks=2, rank=2, device=0), "out of range"),
    (dict(nranks=2, rank=-1, device=0), "out of range"),
    (dict(nranks=2, rank=0, device=-1), "CUDA ordinal"),
])
def test_init_arguments_are_checked_before_nccl(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Communicator.init_rank(unique_id=nccl_cffi.get_unique_id(), **kwargs)


def test_init_rejects_a_bad_unique_id():
    with pytest.raises(ValueError, match="128 bytes"):
        Communicator.init_rank(2, b"short", 0, 0)


def test_raw_pointers_need_count_and_dtype():
    with pytest.raises(ValueError, match="count= and dtype="):
        nccl_cffi.as_buffer(0x1000)
    buf = nccl_cffi.as_buffer(0x1000, count=3, dtype="bfloat16")
    assert (buf.ptr, buf.count, buf.dtype, buf.nbytes) == (0x1000, 3, "bfloat16", 6)
    with pytest.raises(ValueError, match="null"):
        nccl_cffi.as_buffer(0, count=3, dtype="float32")


def test_cuda_array_interface_objects():
    class Fake:
        __cuda_array_interface__ = {"data": (0xABC0, False), "shape": (4, 5),
                                    "typestr": "<f2", "strides": None, "version": 3}
    buf = nccl_cffi.as_buffer(Fake())
    assert (buf.ptr, buf.count, buf.dtype) == (0xABC0, 20, "float16")
    with pytest.raises(ValueError, match="exceeds"):
        nccl_cffi.as_buffer(Fake(), count=21)
    with pytest.raises(TypeError, match="holds float16"):
        nccl_cffi.as_buffer(Fake(), dtype="float32")

    class Strided(Fake):
        __cuda_array_interface__ = dict(Fake.__cuda_array_interface__, strides=(2, 8))
    with pytest.raises(ValueError, match="C-contiguous"):
        nccl_cffi.as_buffer(Strided())


def test_host_arrays_are_refused():
    with pytest.raises(TypeError, match="cannot get a device buffer"):
        nccl_cffi.as_buffer([0.0, 1.0])
    with pytest.raises(ValueError, match="device type 1, not CUDA"):
        nccl_cffi.as_buffer(np.zeros(3))  # read through DLPack: a CPU tensor
    with pytest.raises(ValueError, match="not on a CUDA device"):
        nccl_cffi.as_buffer(jnp.zeros(3))  # a CPU JAX array


def test_poll_until_returns_checks_and_times_out():
    """The wait behind every deadline: done ends it, check may end it, the
    deadline ends it through on_timeout (where callers abort)."""
    import time

    from nccl_cffi import poll_until
    ready = time.monotonic() + 0.01
    calls = []
    poll_until(lambda: time.monotonic() > ready, 1.0, check=lambda: calls.append(1),
               on_timeout=lambda: AssertionError("timed out"))
    assert calls  # checked between polls
    with pytest.raises(KeyError):
        poll_until(lambda: False, 1.0, check=lambda: {}["peer died"],
                   on_timeout=lambda: AssertionError("timed out"))
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="late"):
        poll_until(lambda: False, 0.05, on_timeout=lambda: TimeoutError("late"))
    assert 0.05 <= time.monotonic() - t < 0.5
    poll_until(lambda: True, 0.0, on_timeout=lambda: AssertionError("already done"))

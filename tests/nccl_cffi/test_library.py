"""Library discovery, version and unique ids against the real libnccl wheel (no GPU)."""

import os
import subprocess
import sys

import pytest

import nccl_cffi
from nccl_cffi.library import split_version


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("NCCL_LIBRARY", "VLLM_NCCL_SO_PATH")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=e)


def test_loads_the_wheel_by_path_and_reports_why():
    info = nccl_cffi.library_info()
    assert os.path.isabs(info.path) and os.path.isfile(info.path)
    assert "nvidia/nccl/lib" in info.path, info
    assert info.source.startswith("cuda.pathfinder")
    assert info.tried[0] == "path argument: none given"
    assert any(t.startswith("$NCCL_LIBRARY") for t in info.tried)
    assert info.tried[-1].endswith("(loaded)")


def test_version_matches_the_installed_wheel():
    from importlib.metadata import version
    (major, minor, patch), code = nccl_cffi.nccl_version()
    assert code == major * 10000 + minor * 100 + patch  # NCCL_VERSION_CODE since 2.9
    assert version("nvidia-nccl-cu13").startswith(f"{major}.{minor}.{patch}")


def test_split_version_old_and_new_codes():
    assert split_version(22809) == (2, 28, 9)
    assert split_version(2708) == (2, 7, 8)


def test_explicit_env_var_wins_and_is_reported():
    path = nccl_cffi.library_info().path
    code = "import nccl_cffi; i = nccl_cffi.library_info(); print(i.source, '|', i.path)"
    for var in ("NCCL_LIBRARY", "VLLM_NCCL_SO_PATH"):
        out = run_py(code, **{var: path})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"${var} | {path}"


@pytest.mark.parametrize("var", ["NCCL_LIBRARY", "VLLM_NCCL_SO_PATH"])
def test_a_wrong_explicit_choice_raises_naming_it(var):
    """An override exists to match the server's build: one that points nowhere
    must not quietly load the wheel instead."""
    code = ("import nccl_cffi\ntry:\n    nccl_cffi.load_library()\n"
            "except nccl_cffi.NcclLibraryNotFound as e:\n    print(e)\nelse:\n"
            "    print('LOADED', nccl_cffi.library_info())\n")
    out = run_py(code, **{var: "/nonexistent/libnccl.so.2"})
    assert out.returncode == 0, out.stderr
    assert f"${var} cannot be used: /nonexistent/libnccl.so.2 does not exist" in out.stdout
    assert "LOADED" not in out.stdout


def test_a_wrong_path_argument_raises_and_a_non_library_file_too(tmp_path):
    code = ("import sys, nccl_cffi\ntry:\n    nccl_cffi.load_library(sys.argv[1])\n"
            "except nccl_cffi.NcclLibraryNotFound as e:\n    print(e)\n")
    for path, why in ((tmp_path / "missing.so", "does not exist"), (__file__, "did not load")):
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "path argument cannot be used" in out.stdout and why in out.stdout


def truncated_copy(tmp_path, nbytes: int) -> str:
    """The real libnccl cut to its first ``nbytes``."""
    path = tmp_path / f"cut-{nbytes}.so"
    with open(nccl_cffi.library_info().path, "rb") as f:
        path.write_bytes(f.read(nbytes))
    return str(path)


@pytest.mark.parametrize("nbytes", [4096, 2**20, 2**24])
@pytest.mark.parametrize("var", ["NCCL_LIBRARY", "NCCL_M2N_LIBRARY"])
def test_a_truncated_library_is_refused_before_it_is_loaded(tmp_path, nbytes, var):
    """Loading it crashed the process (SIGBUS, no message); now one error. In
    a child, so a crash is seen as one. NCCL_M2N_LIBRARY: libnccl_m2n's own
    loader, over the wheel's libnccl, looks the same way."""
    cut = truncated_copy(tmp_path, nbytes)
    load = "nccl_cffi.load_library()" if var == "NCCL_LIBRARY" else "load_m2n()"
    code = ("import nccl_cffi\nfrom nccl_cffi.m2n import load_m2n\ntry:\n"
            f"    {load}\nexcept nccl_cffi.NcclLibraryNotFound as e:\n    print(e)\n")
    out = run_py(code, **{var: cut})
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    assert f"{cut} is cut short: {nbytes} bytes, where its ELF headers need" in out.stdout


def test_a_whole_library_is_not_taken_for_a_cut_one():
    from nccl_cffi.library import cut_short
    assert cut_short(nccl_cffi.library_info().path) is None
    assert cut_short(sys.executable) is None  # an executable ELF, whole


def test_nothing_found_lists_every_place():
    # Hide the wheel from pathfinder and the system library.
    code = ("import sys; import nccl_cffi.library as L\n"
            "L._pathfinder_path = lambda: (None, 'cuda.pathfinder: not found (hidden)')\n"
            "L._system_path = lambda: None\n"
            "try:\n    L.load_library()\nexcept L.NcclLibraryNotFound as e:\n"
            "    print(e)\n    sys.exit(0)\nsys.exit(1)\n")
    out = run_py(code)
    assert out.returncode == 0, out.stdout + out.stderr
    for needle in ("path argument: none given", "$NCCL_LIBRARY: not set",
                   "$VLLM_NCCL_SO_PATH: not set", "cuda.pathfinder: not found (hidden)",
                   "system libnccl.so.2: not found", "install nvidia-nccl-cu13"):
        assert needle in out.stdout
    assert "not found (hidden): not found" not in out.stdout
    assert len(out.stdout.strip().splitlines()) == 1  # one sentence, the fix in it


def test_cannot_switch_library_in_one_process(tmp_path):
    nccl_cffi.load_library()  # whichever test runs first, the library is loaded now
    with pytest.raises(RuntimeError, match="already loaded"):
        nccl_cffi.load_library(tmp_path / "other.so")


def test_errors_pickle_with_their_fields(monkeypatch):
    import pickle

    from nccl_cffi import results
    detail = "Mismatched NCCL version detected : rank 0 version 22809 rank 1 version 23007"
    monkeypatch.setattr(results, "last_error", lambda comm=None: detail)
    with_detail = results.make_error(5, "ncclCommInitRank")
    assert with_detail.last_error == detail
    for err in (with_detail, nccl_cffi.NcclTimeoutError("late"),
                nccl_cffi.NcclLibraryNotFound("none"), nccl_cffi.CudaError("no driver")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert (back.code, back.last_error) == (err.code, err.last_error)
        assert isinstance(back, nccl_cffi.NcclError)


def test_unique_ids_are_fresh_128_bytes_and_round_trip():
    a, b = nccl_cffi.get_unique_id(), nccl_cffi.get_unique_id()
    assert len(a) == len(b) == nccl_cffi.UNIQUE_ID_BYTES == 128
    assert a != b
    c = nccl_cffi.unique_id_from_bytes(a)
    assert nccl_cffi.unique_id_to_bytes(c) == a


@pytest.mark.parametrize("bad", [b"", b"x" * 127, b"x" * 129])
def test_unique_id_length_is_checked(bad):
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_cffi.unique_id_from_bytes(bad)


def test_unique_id_type_is_checked():
    with pytest.raises(TypeError):
        nccl_cffi.unique_id_from_bytes("x" * 128)


def test_committed_ffi_module_matches_the_cdef():
    from cffi import FFI

    from nccl_cffi._cdef import CDEF
    from nccl_cffi._ffi import ffi as committed
    fresh = FFI()
    fresh.cdef(CDEF)
    assert committed.list_types() == fresh.list_types()
    for t in ("ncclConfig_t", "ncclUniqueId", "DLTensor", "DLManagedTensorVersioned"):
        assert committed.sizeof(t) == fresh.sizeof(t), t
    for t in ("ncclMesh_t", "ncclDistTensor_t", "ncclM2nConfig_t"):
        assert committed.sizeof(t) == fresh.sizeof(t), t
    nccl_part = CDEF.split("/* NCCL M2N")[0]  # what follows is libnccl_m2n's
    names = [ln.split("(")[0].split()[-1].lstrip("*") for ln in nccl_part.splitlines()
             if ln.startswith(("ncclResult_t nccl", "const char* nccl"))]
    lib = nccl_cffi.load_library()
    for n in names:
        assert callable(getattr(lib, n)), n

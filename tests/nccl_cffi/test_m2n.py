"""The NCCL M2N binding on CPU: what it refuses before any library call
(each in one sentence, in a fresh process: the library loads once per
process), and the descriptors it hands ``ncclReshard``."""

import subprocess
import sys

import pytest

from nccl_cffi._ffi import ffi
from nccl_cffi.m2n import API_VERSION, REPLICATE, DistTensor

from support import ROOT, on_tests_path


def _load_in_child(env: dict, prelude: str = "") -> str:
    code = prelude + (
        "from nccl_cffi import m2n\n"
        "try:\n"
        "    m2n.load_m2n()\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, '|', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=on_tests_path(env))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_no_libnccl_m2n_names_the_package_to_install(tmp_path):
    import os
    out = _load_in_child(dict(os.environ, NCCL_M2N_LIBRARY=str(tmp_path / "libnccl_m2n.so")))
    assert out.startswith("NcclLibraryNotFound | no libnccl_m2n found"), out
    assert "pip install 'nccl-extensions[cu13]'" in out and "\n" not in out


def test_a_file_that_does_not_load_is_refused_in_one_sentence(tmp_path):
    import os
    bogus = tmp_path / "libnccl_m2n.so"
    bogus.write_bytes(b"not a library")
    out = _load_in_child(dict(os.environ, NCCL_M2N_LIBRARY=str(bogus)))
    assert out.startswith("NcclLibraryNotFound | libnccl_m2n at") and "did not load" in out, out
    assert "\n" not in out


def test_an_nccl_older_than_2_30_5_is_refused_with_the_fix():
    import os
    prelude = ("import nccl_cffi.m2n as m, nccl_cffi.library as lib\n"
               "real = lib.library_info()\n"
               "m.library_info = lambda: lib.LibraryInfo(real.path, real.source, (2, 28, 9), 22809)\n")
    out = _load_in_child(dict(os.environ), prelude)
    assert out.startswith("NcclLibraryNotFound | NCCL M2N needs NCCL >= 2.30.5"), out
    assert "pip install 'nvidia-nccl-cu13>=2.30.5'" in out and "2.28.9" in out


def _shared_library(out, source: str, *flags: str) -> str:
    c = out.with_suffix(".c")
    c.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(c), *flags], check=True,
                   capture_output=True, timeout=60)
    return str(out)


@pytest.mark.parametrize("uses", ["ncclReshardOnlyNewer", "ncclGetVersion"])
def test_an_m2n_library_bound_to_an_earlier_libnccl_names_it_and_the_fix(tmp_path, uses):
    """JAX loads the nvidia-nccl-cu13 wheel's libnccl.so.2 before this package
    loads its own: libnccl_m2n binds to the first, and fails to load (a symbol
    only the newer one has) or would call into a library that did not make the
    communicator. Both are refused in one sentence naming the file and the fix."""
    import os
    import shutil
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler to build the stand-in libraries")
    for d in ("other", "link"):
        (tmp_path / d).mkdir()
    version = "int ncclGetVersion(int *v) { *v = 22809; return 0; }\n"
    soname = "-Wl,-soname,libnccl.so.2"
    other = _shared_library(tmp_path / "other" / "libnccl.so.2", version, soname)
    _shared_library(tmp_path / "link" / "libnccl.so.2",
                    version + "int ncclReshardOnlyNewer(void) { return 0; }\n", soname)
    m2n = _shared_library(tmp_path / "libnccl_m2n.so",
                          f"int {uses}();\nint probe(void) {{ return {uses}(0); }}\n",
                          "-L" + str(tmp_path / "link"), "-l:libnccl.so.2")
    prelude = f"import ctypes, os\nctypes.CDLL({other!r}, mode=os.RTLD_NOW | os.RTLD_GLOBAL)\n"
    out = _load_in_child(dict(os.environ, NCCL_M2N_LIBRARY=m2n), prelude)
    assert out.startswith(f"NcclLibraryNotFound | {m2n} binds to {other}, loaded into"), out
    assert "pip install 'nvidia-nccl-cu13>=2.30.5'" in out and "LD_PRELOAD=/" in out, out
    assert "\n" not in out


def test_a_descriptor_is_the_c_struct_m2n_reads():
    d = DistTensor(ptr=0xABC0, local_shape=(4, 6, 2), dtype=9, mesh=(2, 3), start_rank=5,
                   placements=(REPLICATE, 1))
    desc, keep = d.to_c()
    assert desc.size == ffi.sizeof("ncclDistTensor_t") and desc.version == API_VERSION
    assert int(ffi.cast("uintptr_t", desc.dataPtr)) == 0xABC0
    assert [desc.localShape[i] for i in range(desc.ndims)] == [4, 6, 2]
    assert desc.dtype == 9 and [desc.placements[i] for i in range(2)] == [REPLICATE, 1]
    mesh = desc.mesh
    assert mesh.size == ffi.sizeof("ncclMesh_t") and mesh.ndims == 2 and mesh.startRank == 5
    assert [mesh.dims[0], mesh.dims[1]] == [2, 3]
    assert keep  # the arrays the struct points into stay alive with it


def test_a_side_off_its_mesh_passes_a_null_pointer():
    desc, _ = DistTensor(ptr=0, local_shape=(8,), dtype=7, mesh=(1, 1), start_rank=0,
                         placements=(REPLICATE, 0)).to_c()
    assert desc.dataPtr == ffi.NULL


def test_a_call_stuck_inside_the_library_does_not_hold_the_next_for_ever(monkeypatch):
    """The library is single-threaded per process: a reshard that never
    returns (a peer gone) holds it, and the next call ends by its deadline,
    naming the cure, instead of waiting with it."""
    import threading

    from nccl_cffi import NcclTimeoutError, m2n
    monkeypatch.setattr(m2n, "NATIVE_WAIT_S", 0.5)
    inside, leave = threading.Event(), threading.Event()

    def stuck():
        with m2n._inside("ncclReshard"):
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=stuck, daemon=True)
    t.start()
    inside.wait(5)
    try:
        with pytest.raises(NcclTimeoutError, match="restart this process"):
            with m2n._inside("ncclM2nInit"):
                pass
    finally:
        leave.set()
        t.join(5)
    with m2n._inside("ncclM2nInit"):  # free again once the stuck call returned
        pass

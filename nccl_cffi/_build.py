"""cffi out-of-line ABI build: emits ``nccl_cffi/_ffi.py`` (pure Python).

ABI mode needs no compiler and no NCCL headers at install time; the library
is opened with ``dlopen`` at run time, from a path this package chooses (see
``library.py``). The emitted module is committed, because editable installs
do not run cffi's build step; after editing ``_cdef.py`` run
``python nccl_cffi/_build.py`` (a test checks the two agree).
"""

import importlib.util
import pathlib

from cffi import FFI

_here = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_cdef", _here / "_cdef.py")
_cdef = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cdef)

ffibuilder = FFI()
ffibuilder.cdef(_cdef.CDEF)
ffibuilder.set_source("nccl_cffi._ffi", None)

if __name__ == "__main__":
    ffibuilder.emit_python_code(str(_here / "_ffi.py"))

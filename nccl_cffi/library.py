"""Finding and loading libnccl, by path, so that every rank runs one build.

NCCL refuses peers of another version at init ("Mismatched NCCL version
detected"), and a JAX process may already hold some other libnccl (the CUDA
plugin's, or the system's). A plain ``dlopen("libnccl.so.2")`` hands back
whatever is loaded; opening an absolute path loads that file even then. So
every candidate below is resolved to a file path first, and the path is what
gets opened.

Search order, each step reported in ``library_info()``:

1. the ``path`` argument of ``load_library``;
2. ``$NCCL_LIBRARY``, then ``$VLLM_NCCL_SO_PATH`` (what vLLM users already set);
3. the ``nvidia-nccl-cu13`` / ``-cu12`` wheel, located by ``cuda.pathfinder``;
4. the system's ``libnccl.so.2``.

An explicit choice (1 or 2) that does not load raises instead of falling
through: it exists to match the server's build, and silently loading another
one would only fail later, at init, as a version mismatch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from functools import cache

from ._ffi import ffi
from .errors import NcclLibraryNotFound

_SONAME = "libnccl.so.2"
# ELF64: the file header's and a program header's sizes, and a loadable segment's type.
_ELF64_HEADER, _ELF64_PHDR, _PT_LOAD = 64, 56, 1
_ENV_VARS = ("NCCL_LIBRARY", "VLLM_NCCL_SO_PATH")


@dataclass(frozen=True)
class LibraryInfo:
    """Which libnccl this process uses, and why.

    Attributes:
        path: the loaded file, symlinks resolved.
        source: the step of the search order that chose it (e.g.
            ``"$NCCL_LIBRARY"``).
        version: (major, minor, patch).
        version_code: NCCL's raw version code (e.g. 22809).
        tried: the search log, one line per candidate looked at.
    """

    path: str
    source: str
    version: tuple[int, int, int]
    version_code: int
    tried: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        v = ".".join(map(str, self.version))
        return f"NCCL {v} from {self.path} (chosen by {self.source})"


_lock = threading.Lock()
_lib = None
_info: LibraryInfo | None = None


def _pathfinder_path() -> tuple[str | None, str]:
    """Where ``cuda.pathfinder`` finds libnccl, asked in a clean interpreter.

    In this process pathfinder would first return any libnccl already loaded
    (JAX's), which is exactly the file we must not pick blindly; a child
    process has loaded nothing, so its answer is the wheel's file.
    """
    code = (
        "import json\n"
        "from cuda.pathfinder import load_nvidia_dynamic_lib as f\n"
        "d = f('nccl')\n"
        "print(json.dumps([d.abs_path, d.found_via]))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cuda.pathfinder: could not run ({e})"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"cuda.pathfinder: not found ({last})"
    path, via = json.loads(out.stdout.strip().splitlines()[-1])
    if not path:
        return None, "cuda.pathfinder: found no file path"
    return path, f"cuda.pathfinder ({via})"


def _system_path() -> str | None:
    """The file the dynamic loader resolves ``libnccl.so.2`` to, if any."""
    try:
        handle = ctypes.CDLL(_SONAME, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError:
        return None
    # dladdr on one of its symbols gives the file it came from
    class _DlInfo(ctypes.Structure):
        _fields_ = (("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p))
    libdl = ctypes.CDLL(ctypes.util.find_library("dl") or "libc.so.6")
    info = _DlInfo()
    addr = ctypes.cast(handle.ncclGetVersion, ctypes.c_void_p)
    if libdl.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(info.dli_fname.decode())
    return None


def _candidates(path: str | None):
    """Yield (path or None, source label, explicit) in search order."""
    yield path, "path argument", True
    for var in _ENV_VARS:
        yield os.environ.get(var) or None, f"${var}", True
    yield (*_pathfinder_path(), False)
    yield _system_path(), f"system {_SONAME}", False


def _open(path: str):
    return ffi.dlopen(path, ffi.RTLD_NOW | ffi.RTLD_LOCAL)


def _version_of(lib) -> int:
    v = ffi.new("int*")
    rc = lib.ncclGetVersion(v)
    if rc != 0:
        raise OSError(f"ncclGetVersion failed with code {rc}")
    return int(v[0])


def split_version(code: int) -> tuple[int, int, int]:
    """NCCL's version code (22809, or 2809 before 2.9) as (major, minor, patch)."""
    if code < 10000:
        return code // 1000, (code % 1000) // 100, code % 100
    return code // 10000, (code % 10000) // 100, code % 100


def _absent(source: str, explicit: bool) -> str:
    """The search log's line for a candidate that names no file."""
    if source == "path argument":
        return f"{source}: none given"
    if explicit:
        return f"{source}: not set"
    return source if ":" in source else f"{source}: not found"  # pathfinder says why


def cut_short(path: str) -> str | None:
    """Why the shared library at ``path`` would crash the loader, or None.

    Why look before ``dlopen``: the loader maps each segment the ELF program
    headers name, and touching a page past the end of the file (a copy or
    download cut short) is a SIGBUS that kills the process with no message.
    Only 64-bit ELF files are looked at; anything else ``dlopen`` refuses in
    words of its own.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_ELF64_HEADER)
        if len(head) < _ELF64_HEADER or head[:4] != b"\x7fELF" or head[4] != 2:
            return None
        order = "<" if head[5] == 1 else ">"
        (phoff,) = struct.unpack_from(order + "Q", head, 32)
        entry, count = struct.unpack_from(order + "HH", head, 54)
        f.seek(phoff)
        table = f.read(entry * count)
    reach = phoff + entry * count
    if entry >= _ELF64_PHDR and len(table) == entry * count:
        for i in range(count):
            kind, _, offset, _, _, filesz = struct.unpack_from(order + "IIQQQQ", table, i * entry)
            if kind == _PT_LOAD:
                reach = max(reach, offset + filesz)
    if reach <= size:
        return None
    return (f"{path} is cut short: {size} bytes, where its ELF headers need {reach} (a copy "
            "or download that did not finish?)")


def _try_open(candidate: str) -> tuple[object, int] | str:
    """The opened library and its version code, or why it cannot be used."""
    real = os.path.realpath(candidate)
    if not os.path.isfile(real):
        return f"{candidate} does not exist"
    try:
        short = cut_short(real)
    except OSError as e:
        return f"{real} cannot be read ({e})"
    if short:
        return short
    try:
        lib = _open(real)
        return lib, _version_of(lib)
    except ffi.error:  # it loads, but has no ncclGetVersion
        return f"{real} is not libnccl (it has no ncclGetVersion)"
    except (OSError, AttributeError) as e:
        return f"{real} did not load ({e})"


def load_library(path: str | os.PathLike | None = None):
    """Open libnccl once per process and return the cffi library object.

    The first successful call fixes the library for the process: NCCL's
    global state lives in it, so two copies in one process would not know of
    each other's communicators.

    Args:
        path: the file to load (else the search order in the module docstring).

    Returns:
        The cffi library object.

    Raises:
        NcclLibraryNotFound: an explicit choice that cannot be used, or none found.
        RuntimeError: a later call naming a different file.
    """
    global _lib, _info
    want = os.fspath(path) if path is not None else None
    with _lock:
        if _lib is not None:
            if want is not None and os.path.realpath(want) != _info.path:
                raise RuntimeError(
                    f"libnccl is already loaded from {_info.path} ({_info.source}); "
                    f"cannot switch to {want} in the same process")
            return _lib
        tried: list[str] = []
        for candidate, source, explicit in _candidates(want):
            if candidate is None:
                tried.append(_absent(source, explicit))
                continue
            opened = _try_open(candidate)
            if not isinstance(opened, str):
                lib, code = opened
                real = os.path.realpath(candidate)
                tried.append(f"{source}: {real} (loaded)")
                _lib, _info = lib, LibraryInfo(real, source, split_version(code), code,
                                               tuple(tried))
                return _lib
            tried.append(f"{source}: {opened}")
            if explicit:
                raise NcclLibraryNotFound(
                    f"the libnccl chosen by {source} cannot be used: {opened}. Point it "
                    "at the libnccl.so.2 your vLLM server loads, or unset it to use the "
                    "nvidia-nccl-cu13 wheel")
        raise NcclLibraryNotFound(
            "no loadable libnccl found (looked at " + "; ".join(tried) + "): install "
            "nvidia-nccl-cu13 (or -cu12) with pip, or point NCCL_LIBRARY at the libnccl.so.2 "
            "your vLLM server uses")


def library_info() -> LibraryInfo:
    """The loaded library's path, why it was chosen, its version and the search log.

    Loads the library first if no call has yet.

    Returns:
        The ``LibraryInfo``.

    Raises:
        NcclLibraryNotFound: no usable libnccl.
    """
    load_library()
    assert _info is not None
    return _info


def nccl_version() -> tuple[tuple[int, int, int], int]:
    """((major, minor, patch), raw version code) of the loaded libnccl.

    Returns:
        The version as a tuple, and NCCL's code for it (e.g. 22809).

    Raises:
        NcclLibraryNotFound: no usable libnccl.
    """
    info = library_info()
    return info.version, info.version_code


@cache
def has_symbol(name: str) -> bool:
    """Whether the loaded libnccl exports ``name`` (older builds lack some)."""
    try:
        getattr(load_library(), name)
    except (AttributeError, ffi.error):
        return False
    return True

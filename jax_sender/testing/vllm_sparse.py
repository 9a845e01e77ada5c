"""vLLM 0.33.0's real ``sparse_nccl`` receiver behind its real routes, for
tests and benchmarks: ``python -m jax_sender.testing.vllm_sparse TREE --port P --log F``.

It is ``TREE/server.py --nccl`` (see the README) with the worker engine
swapped for ``SparseNCCLWeightTransferEngine`` (so the broadcasts, the patch
checks and the NaN-masked load are vLLM's own code) and a toy model whose
``load_weights`` ends in the same-shaped ``copy_`` that vLLM's sparse loader
requires, into tensors that start at zero. Needs torch and vLLM's tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from typing import Any


def package_alone(name: str) -> Any:
    """Register one vLLM package without running its ``__init__`` (which
    pulls in the model-loading stack and, on a GPU machine, kernels this
    tree leaves out): its submodules then import as usual; a package
    already imported is kept.

    Args:
        name: the package's dotted name, ``vllm.``...

    Returns:
        The package module (in ``sys.modules``).
    """
    import vllm
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(os.path.dirname(vllm.__file__), *name.split(".")[1:])]
        sys.modules[name] = package
    return sys.modules[name]


def module_alone(name: str) -> Any:
    """Import one vLLM module without its package's ``__init__`` (see
    :func:`package_alone`).

    Args:
        name: the module's dotted name, ``vllm.``...

    Returns:
        The module (also in ``sys.modules``, where later imports find it).
    """
    package_alone(name.rpartition(".")[0])
    return importlib.import_module(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", help="the folder holding vLLM 0.33.0's server.py and shim.py")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True, help="file that gets one JSON line per request")
    args = ap.parse_args()
    missing = [f for f in ("server.py", "shim.py") if not os.path.isfile(os.path.join(args.tree, f))]
    if missing:
        sys.exit(f"vLLM's sparse engine not started: {args.tree} has no {' or '.join(missing)}; "
                 "it needs vLLM 0.33.0's receiving code there (see docs/testing.md)")
    sys.path.insert(0, args.tree)
    try:
        import shim  # the tree's: lets vLLM's NCCL code run on this image
        shim.load()
    except ImportError as e:
        sys.exit(f"vLLM's sparse engine not started: {e.name} does not import here; it needs "
                 "torch and vLLM's tree on PYTHONPATH (see docs/testing.md)")
    spec = importlib.util.spec_from_file_location("vllm_server", f"{args.tree}/server.py")
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)

    import torch
    import uvicorn
    # The sparse engine's loader module needs only torch, but its package's
    # __init__ pulls in the whole model-loading stack: load the module alone.
    module_alone("vllm.model_executor.model_loader.checkpoint_weight_patch")
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferEngine

    # build_app subclasses whatever this name holds when it runs.
    nccl_engine.NCCLWeightTransferEngine = SparseNCCLWeightTransferEngine
    app, model = server.build_app(argparse.Namespace(nccl=True, world_size=1, log=args.log))

    def load_weights(pairs) -> None:
        for name, t in pairs:
            held = model.store.get(name)
            if held is None:
                held = model.store[name] = torch.zeros_like(t)
            held.copy_(t)  # vLLM swaps in its NaN-keeping copy here
            model.loads += 1

    model.load_weights = load_weights
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

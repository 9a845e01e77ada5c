"""One vLLM ``nccl_m2n`` worker's metadata-group side, run by vLLM 0.33.0's
own code in a child process (the interpreter of ``JAX_SENDER_VLLM_PYTHON``;
no package of this repository is imported here).

It joins the group with vLLM's ``StatelessProcessGroup.create`` (torch's
``TCPStore`` client, as ``worker_init_metadata_group`` does) and runs the
agreements of ``M2NWeightTransferEngine.init_transfer_engine`` in its order
with the inputs of a JSON spec, printing one JSON line per step:
``{"step": ..., "ok": result}`` or ``{"step": ..., "error": "Type: text"}``
(then it exits). Steps: ``source``, ``data``, ``runtime``, ``placements``
(the rows ``publish_destination_placements`` broadcasts, as hex, over a
stand-in communicator), ``complete``, ``gather`` (a bare
``all_gather_obj`` of the spec's ``record``), ``exit`` (leave at once,
without closing anything: a rank that dies).

    python vllm_m2n_rank.py HOST PORT RANK WORLD_SIZE SPEC_JSON
"""

import json
import os
import sys

import torch
from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.weight_transfer import m2n_common as m2n


def report(step, **fields):
    print(json.dumps({"step": step, **fields}), flush=True)


class _Comm:
    """``publish_destination_placements`` broadcasts over NCCL; on the
    publishing rank the broadcast leaves the rows as they are."""

    def __init__(self, rank):
        self.rank = rank

    def broadcast(self, *args, **kwargs):
        pass


def run(step, group, spec, state):
    if step == "source":
        params = [m2n.M2NWireParam.from_dict(p) for p in spec["params"]]
        declared = spec.get("declared") or m2n.source_plan_digest(params)
        state["source"] = m2n.check_source_plan_agreement(
            group, params, expected_digest=declared, local_error=spec.get("source_error"))
        return state["source"]
    if step == "data":
        uid = spec.get("uid_hex")
        return m2n.check_data_plane_agreement(
            group, None if uid is None else bytes.fromhex(uid), spec.get("data_error"))
    if step == "runtime":
        return m2n.check_runtime_ready_agreement(group, spec.get("runtime_error"))
    if step == "placements":
        rows = [None if p is None else tuple(p) for p in spec["placements"]]
        seen = {}
        comm = _Comm(spec["rank_offset"])
        comm.broadcast = lambda tensor, *a, **k: seen.setdefault("rows", tensor.clone())
        m2n.publish_destination_placements(comm, torch.device("cpu"), None, spec["rank_offset"],
                                           rows, len(rows))
        return seen["rows"].numpy().tobytes().hex()
    if step == "complete":
        mesh = m2n.M2NMesh(tuple(spec["dst_dims"]), spec["rank_offset"])
        rows = [None if p is None else tuple(p) for p in spec["placements"]]
        return m2n.check_complete_plan_agreement(group, state["source"], mesh, rows,
                                                 spec.get("complete_error"))
    if step == "gather":
        return group.all_gather_obj(spec["record"])
    if step == "exit":
        os._exit(0)
    raise ValueError(f"unknown step {step}")


def main():
    host, port, rank, world_size, spec = sys.argv[1:6]
    spec = json.loads(spec)
    group = StatelessProcessGroup.create(host=host, port=int(port), rank=int(rank),
                                         world_size=int(world_size),
                                         store_timeout=spec.get("store_timeout", 300))
    report("joined")
    state = {}
    for step in spec["steps"]:
        try:
            result = run(step, group, spec, state)
        except Exception as e:  # noqa: BLE001 - reported to the test
            report(step, error=f"{type(e).__name__}: {e}")
            return
        report(step, ok=result)


if __name__ == "__main__":
    main()

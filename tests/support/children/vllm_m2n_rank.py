"""vLLM ``nccl_m2n`` workers' metadata-group side, run by vLLM 0.33.0's own
code in a child process (the interpreter of ``JAX_SENDER_VLLM_PYTHON``; no
package of this repository is imported here). It imports torch and vLLM
once, then serves jobs: each line of stdin is one worker's job,
``{"host", "port", "rank", "world_size", "spec"}``.

A job joins the group with vLLM's ``StatelessProcessGroup.create`` (torch's
``TCPStore`` client, as ``worker_init_metadata_group`` does) and runs the
agreements of ``M2NWeightTransferEngine.init_transfer_engine`` in its order
with the spec's inputs, printing one JSON line per step (``joined`` first),
``{"step": ..., "ok": result}`` or ``{"step": ..., "error": "Type: text"}``
(the job stops at an error), then ``{"step": "end"}``. Steps: ``source``,
``data``, ``runtime``, ``placements`` (the rows
``publish_destination_placements`` broadcasts, as hex, over a stand-in
communicator), ``complete``, ``exit`` (the process leaves at once, closing
nothing: a rank that dies). A line ``{"plans": [...]}`` instead runs vLLM's
``validate_transfer_plan`` on each plan and reports the outcomes.

    python vllm_m2n_rank.py      (prints {"step": "ready"} once imported)
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
    publishing rank the broadcast leaves the rows as they are: keep them."""

    def __init__(self, rank):
        self.rank = rank
        self.rows = None

    def broadcast(self, tensor, *args, **kwargs):
        self.rows = tensor.clone()


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
        comm = _Comm(spec["rank_offset"])
        m2n.publish_destination_placements(comm, torch.device("cpu"), None, spec["rank_offset"],
                                           rows, len(rows))
        return comm.rows.numpy().tobytes().hex()
    if step == "complete":
        mesh = m2n.M2NMesh(tuple(spec["dst_dims"]), spec["rank_offset"])
        rows = [None if p is None else tuple(p) for p in spec["placements"]]
        return m2n.check_complete_plan_agreement(group, state["source"], mesh, rows,
                                                 spec.get("complete_error"))
    if step == "exit":
        os._exit(0)
    raise ValueError(f"unknown step {step}")


def job(host, port, rank, world_size, spec):
    try:
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank,
                                             world_size=world_size,
                                             store_timeout=spec.get("store_timeout", 300))
    except Exception as e:  # noqa: BLE001 - reported to the test
        report("joined", error=f"{type(e).__name__}: {e}")
        return
    report("joined")
    state = {}
    for step in spec["steps"]:
        try:
            result = run(step, group, spec, state)
        except Exception as e:  # noqa: BLE001 - reported to the test
            report(step, error=f"{type(e).__name__}: {e}")
            return
        report(step, ok=result)


def validate(plans):
    """vLLM's ``validate_transfer_plan`` on each plan (no group): ``"ok"``
    or what it raised, as its trainer would send it."""
    outcomes = []
    for plan in plans:
        try:
            metas = [m2n.M2NParamMeta(p["name"], getattr(torch, p["dtype_name"]), tuple(p["shape"]),
                                      m2n.M2NLayout(m2n.M2NMesh(tuple(p["src_mesh_dims"]), 0),
                                                    p["src_placements"]))
                     for p in plan["params"]]
            mesh = m2n.M2NMesh(tuple(plan["dst_dims"]), plan["rank_offset"])
            rows = [None if r is None else tuple(r) for r in plan["placements"]]
            m2n.validate_transfer_plan(metas, mesh, rows)
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes


def main():
    report("ready")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "plans" in request:
                report("validate", ok=validate(request["plans"]))
            else:
                job(request["host"], request["port"], request["rank"], request["world_size"],
                    request["spec"])
        finally:
            report("end")


if __name__ == "__main__":
    main()

"""Trainer processes of a multi-process JAX job on CPU, for ``test_group.py``:
``python -m support.children.group_processes SCENARIO PROCESS PORT``.

Two processes with two CPU devices each form one JAX world over loopback
(gloo collectives), the layout a multi-host trainer has with GPUs. Each
prints ``OK ...`` and exits 0, or raises.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

VALUES = {"fsdp.a": np.arange(24, dtype=np.float32).reshape(8, 3),
          "fsdp.b": np.linspace(-1, 1, 4, dtype=np.float32),
          "stage0.w": np.full((2, 2), 7, np.float32),
          "stage1.w": np.arange(6, dtype=np.float32)}


def _global(name: str, devices: list) -> jax.Array:
    """``VALUES[name]`` split over ``devices`` along its first axis."""
    value = VALUES[name]
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d"))
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx],
                                        dtype=value.dtype)


def _only_process_0_waits(process: int, wait, error: type[Exception], label: str) -> None:
    """Process 0 runs ``wait``, which must raise ``error`` at its deadline, while
    process 1 stays in the JAX world but out of it; process 1 leaves first."""
    if process == 0:
        try:
            wait()
        except error as e:
            print(f"OK {label}: {e}")
            time.sleep(5)  # leads the JAX world: let process 1 leave first
        else:
            raise AssertionError(f"{label}: the wait completed without process 1")
    else:
        time.sleep(5)  # in the world, out of the wait, past its deadline
        print(f"OK {label}: process 1 stayed out")


def _m2n_blocks(process: int, devices: list) -> None:
    """Every M2N source layout a two-process mesh gives, and each process's
    block (assembled from its two devices) equal to its slice of the value."""
    from jax_sender import Mapping, MetadataError
    from jax_sender._src.core.tensors.describe import describe
    from jax_sender._src.m2n.layout import local_block, process_boxes, source_layout
    from jax_sender._src.m2n.sender import plan_tensors
    flat = Mesh(np.array(devices), ("d",))
    grid = Mesh(np.array(devices).reshape(2, 2), ("p", "l"))  # a row per process
    cases = {  # name: (mesh, spec, shape, (mesh dims, placements) expected)
        "rows": (flat, PartitionSpec("d"), (8, 6), ((2, 1), (0, -1))),
        "columns": (flat, PartitionSpec(None, "d"), (8, 8), ((2, 1), (1, -1))),
        "replicated": (flat, PartitionSpec(), (8, 6), ((2, 1), None)),
        "local only": (grid, PartitionSpec("l"), (8, 6), ((2, 1), None)),
        "per process": (grid, PartitionSpec("p"), (8, 6), ((2, 1), (0, -1))),
    }
    mine = [d for d in devices if d.process_index == process][0]
    for name, (mesh, spec, shape, want) in cases.items():
        value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        x = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), value.__getitem__)
        boxes = process_boxes(name, x, 2)
        layout = source_layout(name, shape, boxes)
        assert (layout.mesh, layout.placements) == want, (name, layout)
        block = np.asarray(local_block(x, boxes[process], mine))
        assert np.array_equal(block, value[tuple(slice(a, b) for a, b in boxes[process])]), name
        assert block.shape == layout.local_shape, (name, block.shape)
    strided = jax.make_array_from_callback(
        (8, 6), NamedSharding(grid, PartitionSpec(("l", "p"))), lambda i: np.zeros((8, 6))[i])
    try:
        process_boxes("strided", strided, 2)
    except MetadataError as e:
        assert "do not form one box" in str(e), e
    else:
        raise AssertionError("a process holding two apart slices was accepted")
    x = jax.make_array_from_callback((8, 6), NamedSharding(flat, PartitionSpec("d")),
                                     lambda i: np.ones((8, 6), np.float32)[i])
    metas, sources = describe({"w": x}, Mapping(transform=lambda path, a: a.T))
    (t,) = plan_tensors(metas, sources, Mapping(transform=lambda path, a: a.T), 2, process)
    assert (t.meta.shape, t.layout.placements) == ((6, 8), (1, -1)), t
    print(f"OK m2n: process {process}, {len(cases)} layouts and the transpose's")


def main(scenario: str, process: int, port: str) -> None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process,
                               initialization_timeout=60)
    from jax_sender import SendConfig, TensorMeta
    from jax_sender._src.core.errors import GatherTimeout
    from jax_sender._src.core.group import (
        TrainerGroup,
        gather,
        join_gathers,
        ready,
        share_from_process_0,
    )
    from jax_sender._src.core.turns import broadcast_plan, owners_of, turn_updates
    from uniqueid import RendezvousError, RendezvousTimeout, VLLMClient, VLLMConnectionError

    from support.servers.memory_link import MemoryJoin
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mine = [d for d in devices if d.process_index == 1]

    def plan_of(names: list[str], arrays: list[jax.Array]):
        return broadcast_plan([TensorMeta.of(n, a) for n, a in zip(names, arrays)],
                              [owners_of(a) for a in arrays])

    if scenario == "fsdp":
        # Every parameter over both processes: process 0 broadcasts, process 1 only
        # gathers, both in the packed wire order (fsdp.a, larger than the 64-byte
        # buffer, goes first although it is listed second).
        names = ["fsdp.b", "fsdp.a"]
        arrays = [_global(n, devices) for n in names]
        plan = plan_of(names, arrays)
        assert plan.group == (0,) and [t.params for t in plan.turns] == [(0, 1)], plan
        metas = [TensorMeta.of(n, a) for n, a in zip(names, arrays)]
        (turn,) = [t.turn for t in turn_updates(plan, metas, 64, {})]
        assert turn.params == (1, 0), turn
        if process == 0:
            for i in turn.params:
                full = ready(gather(arrays[i]), 60, names[i])
                assert np.array_equal(np.asarray(full), VALUES[names[i]]), names[i]
        else:
            join_gathers([turn], arrays, process, 60)
        print(f"OK fsdp: process {process}, group {plan.group}, order {turn.params}")
    elif scenario == "stages":
        # One stage per process: two broadcasters, no gather.
        names = ["stage0.w", "stage1.w"]
        arrays = [_global("stage0.w", [d for d in devices if d.process_index == 0]),
                  _global("stage1.w", mine)]
        plan = plan_of(names, arrays)
        assert plan.group == (0, 1), plan
        assert [(t.src, t.process, t.params) for t in plan.turns] == [(0, 0, (0,)), (1, 1, (1,))]
        assert plan.group_rank(process) == process
        print(f"OK stages: process {process}, turns {plan.turns}")
    elif scenario == "share":
        got = share_from_process_0(b"id and world size" if process == 0 else None)
        assert got == b"id and world size", got
        print(f"OK share: process {process}")
    elif scenario == "late":
        # Process 1 never reaches connect_group: process 0's share gives up.
        _only_process_0_waits(process, lambda: share_from_process_0(b"id", timeout=3),
                              RendezvousTimeout, "late")
    elif scenario == "unreachable":
        # Process 0 cannot reach its server: it raises, and process 1 is told, not left waiting.
        plan = plan_of(["fsdp.a"], [_global("fsdp.a", devices)])
        clients = [VLLMClient("http://127.0.0.1:9", connect_timeout=5)] if process == 0 else []
        group = TrainerGroup(plan=plan, process=process, device=0, share=share_from_process_0,
                             clients=clients, config=SendConfig(), joiner=MemoryJoin())
        expected = VLLMConnectionError if process == 0 else RendezvousError
        try:
            group.form(30)
        except expected as e:
            print(f"OK unreachable: process {process} raised {type(e).__name__}: {e}")
        else:
            raise AssertionError("form() returned with an unreachable server")
    elif scenario == "absent":
        # Process 1 never joins the gather: process 0's deadline fires.
        arr = _global("fsdp.a", devices)
        _only_process_0_waits(process, lambda: ready(gather(arr), 3, "the gather of fsdp.a"),
                              GatherTimeout, "absent")
    elif scenario == "m2n":
        _m2n_blocks(process, devices)
    else:
        raise ValueError(scenario)
    sys.stdout.flush()
    if scenario not in ("late", "absent"):
        # Process 0 hosts the coordination service: leaving first would take it
        # down under process 1, whose JAX then aborts it. Both leave together.
        jax.distributed.shutdown()
    os._exit(0)  # a gather left waiting must not hold the process


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

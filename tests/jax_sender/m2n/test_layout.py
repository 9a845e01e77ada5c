"""JAX shardings as NCCL M2N source layouts: every placement kind M2N can
express, each refusal in one sentence, and (in a real two-process JAX
world on CPU) the blocks each process holds and sends."""

import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_sender import MetadataError
from jax_sender._src.m2n.layout import (
    MAX_SOURCE_SHARDS,
    check_tensor,
    process_boxes,
    source_layout,
)
from jax_sender.testing.harness import free_port, run_all

from support import child

R = -1


def _rows(shape, slices, order):
    """Boxes of processes holding slice ``order[p]`` of dimension 0 cut in ``slices``."""
    width = shape[0] // slices
    rest = tuple((0, n) for n in shape[1:])
    return [((s * width, (s + 1) * width),) + rest for s in order]


def test_every_process_holding_the_whole_tensor_is_replicated():
    layout = source_layout("w", (8, 6), [((0, 8), (0, 6))] * 4)
    assert (layout.mesh, layout.placements, layout.local_shape) == ((4, 1), None, (8, 6))
    assert layout.shards == 1


def test_one_slice_per_process_shards_the_first_mesh_axis():
    layout = source_layout("w", (8, 6), _rows((8, 6), 4, [0, 1, 2, 3]))
    assert (layout.mesh, layout.placements, layout.local_shape) == ((4, 1), (0, R), (2, 6))
    assert layout.shards == 4


def test_slices_replicated_over_neighbours_shard_the_first_axis():
    # FSDP over 2 slices, each replicated on 2 consecutive processes: mesh (2, 2)
    layout = source_layout("w", (8, 6), _rows((8, 6), 2, [0, 0, 1, 1]))
    assert (layout.mesh, layout.placements) == ((2, 2), (0, R))


def test_slices_cycling_over_processes_shard_the_second_axis():
    layout = source_layout("w", (8, 6), _rows((8, 6), 2, [0, 1, 0, 1]))
    assert (layout.mesh, layout.placements, layout.local_shape) == ((2, 2), (R, 0), (4, 6))


def test_a_column_split_names_its_dimension():
    boxes = [((0, 8), (0, 3)), ((0, 8), (3, 6))]
    layout = source_layout("w", (8, 6), boxes)
    assert (layout.mesh, layout.placements, layout.local_shape) == ((2, 1), (1, R), (8, 3))


def test_a_third_dimension_splits_too():
    boxes = [((0, 2), (0, 4), (k * 3, k * 3 + 3)) for k in range(2)]
    layout = source_layout("experts", (2, 4, 6), boxes)
    assert (layout.placements, layout.local_shape) == ((2, R), (2, 4, 3))


@pytest.mark.parametrize("boxes, match", [
    ([((0, 4), (0, 3)), ((4, 8), (3, 6))], r"split along dimensions \[0, 1\].*one tensor dimension"),
    ([((0, 5), (0, 6)), ((5, 8), (0, 6))], r"split unevenly.*pick a mesh size that divides it"),
    (_rows((8, 6), 4, [0, 2, 1, 3]), r"hold slices \[0, 2, 1, 3\].*order the mesh's devices"),
    (_rows((8, 6), 2, [1, 0]), r"hold slices \[1, 0\]"),
])
def test_layouts_m2n_cannot_express_are_refused_in_one_sentence(boxes, match):
    with pytest.raises(MetadataError, match=match) as e:
        source_layout("w", (8, 6), boxes)
    assert "\n" not in str(e.value) and str(e.value).startswith("'w'")


def test_more_source_shards_than_m2n_feeds_into_one_destination_are_refused():
    n = 2 * MAX_SOURCE_SHARDS
    with pytest.raises(MetadataError, match=f"{n} slices.*at most {MAX_SOURCE_SHARDS}"):
        source_layout("w", (n, 4), _rows((n, 4), n, range(n)))
    ok = source_layout("w", (MAX_SOURCE_SHARDS, 4),
                       _rows((MAX_SOURCE_SHARDS, 4), MAX_SOURCE_SHARDS, range(MAX_SOURCE_SHARDS)))
    assert ok.shards == MAX_SOURCE_SHARDS


@pytest.mark.parametrize("dtype, shape, match", [
    ("bool", (4,), "does not move"), ("complex64", (4,), "does not move"),
    ("float32", (), "0 dimensions"), ("bfloat16", (2, 2, 2, 2), "4 dimensions"),
])
def test_tensors_m2n_cannot_move_are_refused(dtype, shape, match):
    with pytest.raises(MetadataError, match=match):
        check_tensor("w", dtype, shape)


@pytest.mark.parametrize("dtype", ["uint32", "uint64", "float8_e5m2", "bfloat16", "int64"])
def test_every_dtype_m2n_moves_passes(dtype):
    check_tensor("w", dtype, (4, 2))


def test_host_data_is_held_whole_by_every_process():
    assert process_boxes("w", np.zeros((3, 2)), 3) == [((0, 3), (0, 2))] * 3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2), st.booleans())
def test_any_expressible_layout_round_trips(rows, cols, dim, on_rows):
    """Blocks made from a mesh layout give that layout back (or the same
    blocks under another factorisation of the ranks)."""
    t = rows * cols
    shape = [6, 4, 10]
    shape[dim] *= rows if on_rows else cols
    n = rows if on_rows else cols
    width = shape[dim] // n
    boxes = []
    for p in range(t):
        s = p // cols if on_rows else p % cols
        boxes.append(tuple((s * width, (s + 1) * width) if d == dim else (0, shape[d])
                           for d in range(3)))
    layout = source_layout("w", tuple(shape), boxes)
    if n == 1:
        assert layout.placements is None
        return
    a, b = layout.mesh
    axis = layout.placements.index(dim)
    got = [(p // b) if axis == 0 else (p % b) for p in range(t)]
    assert got == [box[dim][0] // width for box in boxes]
    assert layout.local_shape[dim] == width


def test_two_jax_processes_send_the_blocks_they_hold():
    """Four CPU devices in two processes: layouts of every kind, each
    process's block assembled from its devices, the layout of a transform's
    output, and the refusals (see ``support.children.group_processes``)."""
    port = str(free_port())
    procs = []
    for process in (0, 1):
        argv, env = child("children.group_processes", "m2n", str(process), port,
                          env=dict(__import__("os").environ))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = run_all(procs, timeout=240)
    assert all("OK m2n" in out for out in outs)

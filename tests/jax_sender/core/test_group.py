"""Several broadcasting trainer processes: vLLM's validation, and the
cross-process gathers and id sharing of a real two-process JAX world on CPU."""

import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_sender import MetadataError, TensorMeta
from jax_sender._src.core.turns import BroadcastPlan, broadcast_plan, turn_updates
from jax_sender.testing.harness import free_port, run_all

from support import ROOT, child


def _metas(n: int) -> list[TensorMeta]:
    return [TensorMeta(f"p{i}", "bfloat16", (4,)) for i in range(n)]


def test_single_owner_and_fsdp_layouts_have_one_broadcaster():
    plan = broadcast_plan(_metas(3), [None, (0,), (0, 1, 2)])
    assert plan.group == (0,)
    assert [(t.src, t.process, t.params) for t in plan.turns] == [(0, 0, (0, 1, 2))]
    assert plan.group_rank(0) == 0 and plan.group_rank(1) is None


def test_first_owners_broadcast_in_ascending_turns():
    # process 2 co-owns process 1's parameters; process 3 broadcasts its own
    plan = broadcast_plan(_metas(4), [(3,), (1, 2), (0,), (1,)])
    assert plan.group == (0, 1, 3)
    assert [(t.src, t.process, t.params) for t in plan.turns] == [
        (0, 0, (2,)), (1, 1, (1, 3)), (2, 3, (0,))]
    assert plan.group_rank(2) is None  # only gathers


def test_process_0_broadcasting_nothing_still_leads_the_group():
    plan = broadcast_plan(_metas(2), [(1,), (2,)])
    assert plan.group == (0, 1, 2)
    assert [t.src for t in plan.turns] == [1, 2]


@pytest.mark.parametrize("owners, match", [
    ([(1, 0)], r"owners \[1, 0\]: process 0 only gathers in its own turn"),
    ([(0,), None, (1,)], r"'p1' is host data.*processes \[0, 1\] broadcast"),
    ([(0, 1), (1,)], r"process 1 owns parameters broadcast by processes 0 and 1"),
])
def test_vllms_rules_are_enforced(owners, match):
    with pytest.raises(MetadataError, match=match):
        broadcast_plan(_metas(len(owners)), owners)


_owners = st.one_of(st.none(), st.lists(st.integers(0, 4), min_size=1, max_size=3,
                                        unique=True).map(lambda o: tuple(sorted(o))))


@settings(max_examples=300, deadline=None)
@given(st.lists(_owners, min_size=1, max_size=8))
def test_any_layout_is_planned_by_vllms_rules_or_refused(owners):
    """Every parameter in exactly one turn, sent by its first owner; the group
    is process 0 plus the first owners; a process co-owns parameters of one
    broadcaster only. Otherwise a MetadataError, never anything else."""
    firsts = {0 if o is None else o[0] for o in owners}
    first_of: dict[int, int] = {}
    one_each = all(first_of.setdefault(r, o[0]) == o[0] for o in owners if o for r in o)
    valid = len(firsts) == 1 or (None not in owners and one_each)
    try:
        plan = broadcast_plan(_metas(len(owners)), owners)
    except MetadataError:
        assert not valid
        return
    assert valid
    assert sorted(i for t in plan.turns for i in t.params) == list(range(len(owners)))
    assert plan.group == tuple(sorted({0} | {t.process for t in plan.turns}))
    for t in plan.turns:
        assert plan.group[t.src] == t.process
        assert all((owners[i] or (0,))[0] == t.process for i in t.params)
    assert [t.src for t in plan.turns] == sorted(t.src for t in plan.turns)


def test_each_turn_is_its_own_update_with_its_own_chunks_and_reuse():
    """What process 0 posts per turn, and the chunks the workers cut per call."""
    metas = [TensorMeta(f"p{i}", "bfloat16", (n,)) for i, n in enumerate([3, 2, 4, 1])]
    plan = broadcast_plan(metas, [(0,), (1,), (0,), (1,)])
    first = turn_updates(plan, metas, 5, {})
    assert [t.update.to_payload() for t in first] == [
        {"names": ["p0", "p2"], "dtype_names": ["bfloat16"] * 2, "shapes": [[3], [4]]},
        {"names": ["p1", "p3"], "dtype_names": ["bfloat16"] * 2, "shapes": [[2], [1]],
         "src": 1}]  # src omitted when 0, so vLLM 0.33.0 reads the first
    # 5-byte buffer: 6 | 8 bytes, then 4 + 2, cut within each turn (across the
    # whole list the chunks would be p0+p1, p2, p3)
    assert [[(c.start, c.stop) for c in t.chunks] for t in first] == [[(0, 1), (1, 2)],
                                                                      [(0, 2)]]
    # Reuse per src: turn 1's metadata changed, turn 0's did not.
    changed = metas[:3] + [TensorMeta("p3", "bfloat16", (5,))]
    again = turn_updates(plan, changed, None, {t.turn.src: t.metas for t in first})
    assert again[0].update.to_payload() == {"names": [], "dtype_names": [], "shapes": []}
    assert again[1].update.names == ["p1", "p3"] and again[1].chunks == []


def test_a_misaligned_turn_is_sent_in_an_aligned_order():
    """int8 then float32 would put the float32 at byte 3 (vLLM's consumer
    fails there mid-stream): the turn goes by decreasing dtype size instead."""
    metas = [TensorMeta("a", "int8", (3,)), TensorMeta("b", "float32", (2,))]
    (t,) = turn_updates(BroadcastPlan.single(2), metas, 1 << 20, {})
    assert t.turn.params == (1, 0) and [m.name for m in t.metas] == ["b", "a"]
    assert t.update.names == ["b", "a"] and t.chunks[0].offsets == (0, 8)


def _world(scenario: str, timeout: float = 120) -> list[str]:
    """Run ``scenario`` as JAX processes 0 and 1; their outputs."""
    port = str(free_port())
    procs = []
    for p in (0, 1):
        argv, env = child("children.group_processes", scenario, str(p), port, env=dict(os.environ))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return run_all(procs, timeout)


def test_fsdp_gather_across_processes():
    """Process 0 gathers each parameter whole; process 1, outside the transfer
    group, joins the same gathers in the same order."""
    _world("fsdp")


def test_stage_per_process_gives_two_broadcasters():
    _world("stages")


def test_id_and_world_size_are_shared_from_process_0():
    _world("share")


def test_a_process_that_never_joins_ends_the_share_at_its_deadline():
    assert "did not all reach connect_group within 3" in _world("late")[0]


def test_process_0_failing_to_reach_its_server_fails_every_process():
    outs = _world("unreachable")
    assert "VLLMConnectionError" in outs[0] and "RendezvousError" in outs[1]


def test_gather_without_its_other_owner_hits_the_deadline():
    assert "did not complete within 3" in _world("absent")[0]

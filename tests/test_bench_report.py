"""The benchmark's report, from the committed 2 x H200 run (no GPU)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _redraw(run, out_dir: pathlib.Path) -> str:
    """``bench.py --plot`` of a run's JSON (a path, or the data to write there)."""
    if isinstance(run, dict):
        path = out_dir / "run.json"
        path.write_text(json.dumps(run))
        run = str(path)
    out = subprocess.run([sys.executable, "benches/bench.py", "--plot", run, "--out",
                          str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


RUN = "benches/bench-2xh200.json"  # one `bench.py --reps 5` run, every stage


def test_report_redraws_from_a_runs_json(tmp_path):
    table = _redraw(RUN, tmp_path)
    for row in ("raw ncclBroadcast 1 GiB", "packed send qwen3-8b", "vLLM's torch sender",
                "unpacked send qwen3-8b", "many-small", "large", "uniqueid.handshake",
                "from_unique_id_bytes", "| 64 MiB | 1 |", "| 2048 MiB | 3 |"):
        assert row in table, row
    assert "| packed send qwen3-8b -> vLLM 0.33.0 consumer | 0.0493 |" in table
    assert "broadcasts alone 362.1 GB/s (0.995 x raw)" in table
    assert (tmp_path / "bench.md").read_text().strip() in table


def test_the_floor_sits_under_each_packed_push(tmp_path):
    """The consumer's floor (chunks already packed, no sender work) under the
    pushes it bounds, with both senders' times against it."""
    table = _redraw(RUN, tmp_path)
    for row in ("|   vLLM's torch sender, same | 0.0503 | 0.0501 | 325.6 | 0.89 | ratio to raw; "
                "ours / torch = 1.02;",
                "|   floor: chunks already packed, no sender work | 0.0488 | 0.0484 | 335.7 | 0.92 "
                "| time / floor: ours 1.01, torch 1.03; ratio to raw |",
                "| time / floor: ours 0.93, torch 0.92; ratio to raw |",
                "| uniqueid.handshake | 176.4 | 167.0 | 0.99 |"):
        assert row in table, row
    assert table.count("floor: chunks") == 2  # qwen3-8b and many-small, not unpacked or large


def test_each_torch_row_states_both_whole_calls(tmp_path):
    """Beside the update span, the whole call a user waits for (start to
    finish, with ours' preparation and handoffs) of both senders."""
    table = _redraw(RUN, tmp_path)
    assert ("ours / torch = 1.02; whole call (start to finish), median: ours 56.6 ms, torch "
            "55.7 ms, ours / torch = 0.98 |") in table
    assert table.count("whole call (start to finish)") == 4  # packed, unpacked, many-small, large


def test_our_rows_use_the_update_call_timed_inside_its_thread(tmp_path):
    """Where a run has it, our ``/update_weights`` time is the one measured
    inside the HTTP call's thread, as torch's is (figures made up here: the
    committed run predates it)."""
    data = json.loads((ROOT / RUN).read_text())
    data["ours"][0]["update"] = [0.0480] * 5  # qwen3-8b packed
    table = _redraw(data, tmp_path)
    assert "| packed send qwen3-8b -> vLLM 0.33.0 consumer | 0.0480 | 0.0480 |" in table
    assert "ratio to raw; ours / torch = 1.05;" in table
    assert "time / floor: ours 0.98, torch 1.03" in table


def test_the_unpacked_floor_sits_under_the_unpacked_push(tmp_path):
    """Each tensor broadcast from one buffer with no sender work, under the
    unpacked pushes, both senders against it (the floor's figures made up
    here: the committed run has no unpacked floor)."""
    data = json.loads((ROOT / RUN).read_text())
    unpacked = next(j for j in data["ours"] if j["mode"] == "unpacked")
    data["ours"].append(dict(unpacked, mode="preplaced", transfer=[0.0530, 0.0531, 0.0529]))
    table = _redraw(data, tmp_path)
    assert ("|   floor: each tensor from one buffer, no sender work | 0.0530 | 0.0529 | 309.1 "
            "| 0.85 | time / floor: ours 1.01, torch 1.00; ratio to raw |") in table
    assert table.count("floor: chunks") == 2 and table.count("no sender work") == 3


def test_sparse_rows_sit_beside_the_same_runs_dense_baselines(tmp_path):
    table = _redraw(RUN, tmp_path)
    for row in ("vLLM 0.33.0 sparse_nccl engine",
                "| 1% | 0.49 | 16.38 | 0.03 | 0.118 |", "| 10% |",
                "| 50% | 24.57 | 16.38 | 1.50 | 0.439 | 0.435 | 0.504 | 0.045 | 9.8 | 0.049 |",
                "- 1%: patches 0.005 s, broadcasts 0.031 s of 0.118 s"):
        assert row in table, row


@pytest.mark.parametrize("rows", [
    # a push's fixed cost
    ["| ours, `send()` | 7.05 | 4.87 | 1.06 |", "| vLLM's torch engine, `send_weights()` | 6.64 |",
     "| ours | 1.68 | 3.01 | 1.97 |", "Ours and torch's took turns, 3 blocks of 20 pushes each."],
    # sparse over a slow link
    ["NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket",
     "| dense, packed 1 GiB x 2 | 1.54 | 0.371 | 0.364 | 1.0 |",
     "| sparse, 1% changed | 0.046 | 0.021 | 0.021 | 17.4 |"],
    # the training loop: each push against no push
    ["| none | 23.98 | 0.00 | 0 | |", "| blocking `send()` | 37.50 | 13.51 | 13.68 | 7.28 |",
     "| vLLM's torch sender, blocking `send_weights()` | 44.08 | 20.10 | 19.60 | 7.07 |",
     "| `send(wait=False)` | 26.97 | 2.99 | 1.75 | 6.84 |",
     "| its snapshot alone (the same copies, no broadcast) | 26.21 | 2.23 | 1.77 | |",
     "adds 0.22 x what the blocking push adds to a step, 0.15 x what vLLM's torch sender adds",
     "its snapshot (dispatch and copy) is 2.23 ms; the other 0.76 ms is the push running beside "
     "the training step: its broadcast on the GPU, its thread on the host.",
     "the step takes 25.92 ms against 24.29 ms without it, +1.63 ms: the broadcast's own cost",
     "Its extra device memory is its snapshot, one copy of the pushed bytes on the trainer's "
     "GPU (0.98 GB), kept for the next asynchronous push."],
], ids=["fixed cost", "slow link", "training loop"])
def test_each_stage_sits_beside_its_baselines(tmp_path, rows):
    table = _redraw(RUN, tmp_path)
    for row in rows:
        assert row in table, row


def test_three_server_rows_compare_one_broadcast_with_pushes_in_turn(tmp_path):
    """The 4-GPU rows, drawn from a run's JSON (figures made up here: no 4-GPU run yet)."""
    one = {"bytes": 16_000_000_000, "transfer": [0.05, 0.06, 0.055]}
    seq = {"bytes": 16_000_000_000, "transfer": [0.165, 0.16, 0.17]}
    data = {"reps": 3, "raw": [0.003] * 3, "raw4": [0.004] * 3, "target": "reference receiver",
            "servers_one": [one], "servers_seq": [seq]}
    table = _redraw(data, tmp_path)
    assert "| raw ncclBroadcast 1 GiB, 4 ranks (baseline) | 0.0040 |" in table
    assert "| one broadcast -> 3 servers (1 -> 3 receivers) | 0.0550 | 0.0500 | 290.9 | 1.08 |" \
        in table
    assert "3.00 x the one broadcast's time" in table


def test_per_op_report_puts_each_communicator_next_to_raw():
    sys.path.insert(0, str(ROOT / "benches"))
    import per_op
    # 1 GiB in 2.5 ms is 429.5 GB/s; 8 GB in 25 ms is 320 GB/s.
    data = {"non-blocking": [(0.025, 0.004)] * 3, "blocking": [(0.02, 0.001), (0.03, 0.002)],
            "bytes": 8_000_000_000, "ops": 100}
    rows = per_op.report([0.0025, 0.003, 0.002], data).splitlines()
    assert rows[2] == "| raw ncclBroadcast 1 GiB (baseline) | 2.50 | 2.00 | 429.5 | 1.00 | |"
    assert rows[3] == "| non-blocking, 100 broadcasts | 25.00 | 25.00 | 320.0 | 0.75 | 40.0 |"
    assert rows[4] == "| blocking, 100 broadcasts | 25.00 | 20.00 | 320.0 | 0.75 | 15.0 |"


def test_capped_training_rows_sit_beside_the_uncapped_blocking_push(tmp_path):
    """``--max-ctas``: the loop again with NCCL's CTAs capped on every rank, in
    a table of its own (figures made up here)."""
    def row(mode, step, blocked=(), **kw):
        return dict(mode=mode, step=[step] * 3, blocked=list(blocked), transfer=[],
                    bytes=10**9, tensors=91, **kw)
    data = {"reps": 3, "raw": [0.003] * 3, "target": "reference receiver",
            "train": [row("none", 0.024), row("blocking", 0.038, [0.014] * 3),
                      row("async", 0.030, [0.002] * 3), row("none", 0.024, max_ctas=8),
                      row("blocking", 0.044, [0.02] * 3, max_ctas=8),
                      row("async", 0.027, [0.002] * 3, max_ctas=8)]}
    table = _redraw(data, tmp_path)
    assert "adds 0.43 x what the blocking push adds to a step." in table  # uncapped rows only
    assert "| 8 | 24.00 | 20.00 | 3.00 | 2.00 | 0.15 | 0.21 |" in table


def test_a_raw_broadcast_beside_the_step_is_stated_against_its_own_loop(tmp_path):
    """The broadcast alone beside each step (no push), against the same
    process's loop without it (figures made up here)."""
    steps = lambda ms: [ms / 1e3] * 3  # noqa: E731
    data = {"reps": 3, "raw": [0.003] * 3, "target": "reference receiver",
            "train": [dict(mode="none", step=steps(24), blocked=[], transfer=[], bytes=10**9,
                           tensors=91),
                      dict(mode="beside", step=steps(24.8), none=steps(23.9), blocked=[],
                           transfer=[], bytes=10**9, tensors=91)]}
    table = _redraw(data, tmp_path)
    assert ("A raw broadcast of the same 1.00 GB launched beside each step (no push thread, "
            "no HTTP, no snapshot; another process receives it on GPU 1): the step takes "
            "24.80 ms against 23.90 ms without it, +0.90 ms") in table
    assert "| beside" not in table  # a line of its own, not a push row


def test_the_fixed_cost_row_joins_the_blocks_the_senders_took_in_turns(tmp_path):
    """Each sender's blocks are joined into one row, the repetitions of all of
    them (figures made up here)."""
    sys.path.insert(0, str(ROOT / "benches"))
    from bench import _merged

    def block(ms, n=4):
        return dict(workload="tiny", mode="packed", buffer=1 << 30, nbuf=2, reps=n,
                    wall=[ms / 1e3] * n, start=[0.002] * n, transfer=[0.003] * n,
                    finish=[0.002] * n, bytes=4096, tensors=1)
    ours = _merged([dict(block(ms), update=[0.0028] * 4) for ms in (7.0, 7.2, 9.0)])
    assert ours["reps"] == 12 and len(ours["wall"]) == 12 and ours["bytes"] == 4096
    theirs = _merged([block(6.8), block(7.1), block(7.1)])
    shipped = _merged([dict(wall=[ms / 1e3] * 4, reps=4, bytes=4096, tensors=1)
                       for ms in (8.5, 9.0, 9.1)])
    data = {"reps": 1, "raw": [0.003], "target": "vLLM 0.33.0 consumer", "fixed_blocks": 3,
            "init": {"ours": [0.18], "vllm": [0.19]}, "ours": [ours], "torch": [theirs],
            "fixed_shipped": shipped,
            "fixed_block_medians": {"ours": [0.0070, 0.0072, 0.0090],
                                    "torch": [0.0068, 0.0071, 0.0071],
                                    "shipped": [0.0085, 0.0090, 0.0091]}}
    table = _redraw(data, tmp_path)
    assert "median ms. Ours and torch's took turns, 3 blocks of 4 pushes each." in table
    assert ("Block medians, ms (the host's drift from block to block): ours 7.00-9.00; "
            "torch 6.80-7.10; torch over vLLM's client 8.50-9.10.") in table
    assert "| ours, `send()` | 7.20 | 7.00 | 1.01 |" in table
    assert ("| the same over vLLM's own HTTP client (`HTTPVLLMWeightSyncClient`: a new "
            "connection per call) | 9.00 | 8.50 | 1.27 |") in table
    assert "Ours / torch's engine over vLLM's own client, what a torch user runs: 0.80." in table
    assert "update: the `/update_weights` call timed inside its thread" in table
    assert "| ours | 2.00 | 2.80 | 2.00 |" in table and "| torch | 2.00 | 3.00 | 2.00 |" in table

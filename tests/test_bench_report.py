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


def test_report_redraws_from_a_runs_json(tmp_path):
    table = _redraw("benches/bench-2xh200.json", tmp_path)
    for row in ("raw ncclBroadcast 1 GiB", "packed send qwen3-8b", "vLLM's torch sender",
                "unpacked send qwen3-8b", "many-small", "large", "uniqueid.handshake",
                "from_unique_id_bytes", "| 64 MiB | 1 |", "| 2048 MiB | 3 |"):
        assert row in table, row
    assert "| packed send qwen3-8b -> vLLM 0.33.0 consumer | 0.0491 |" in table
    assert "broadcasts alone 361.8 GB/s (0.989 x raw)" in table
    assert (tmp_path / "bench.md").read_text().strip() in table


def test_the_floor_sits_under_each_packed_push(tmp_path):
    """The consumer's floor (chunks already packed, no sender work) under the
    pushes it bounds, with both senders' times against it."""
    table = _redraw("benches/dense-2xh200.json", tmp_path)
    for row in ("| packed send qwen3-8b -> vLLM 0.33.0 consumer | 0.0494 | 0.0491 |",
                "|   vLLM's torch sender, same | 0.0505 | 0.0502 | 324.4 | 0.89 | ratio to raw; "
                "ours / torch = 1.02 |",
                "|   floor: chunks already packed, no sender work | 0.0497 | 0.0494 | 329.4 | 0.91 "
                "| time / floor: ours 0.99, torch 1.02; ratio to raw |",
                "| time / floor: ours 1.33, torch 0.97; ratio to raw |",
                "| ours, `send()` | 8.63 | 7.87 | 0.97 |", "| ours | 2.16 | 3.47 | 2.47 |",
                "| uniqueid.handshake | 211.3 | 185.4 | 1.01 |"):
        assert row in table, row
    assert table.count("floor: chunks") == 2  # qwen3-8b and many-small, not unpacked or large


def test_sparse_rows_sit_beside_the_same_runs_dense_baselines(tmp_path):
    table = _redraw("benches/bench-2xh200.json", tmp_path)
    for row in ("vLLM 0.33.0 sparse_nccl engine",
                "| 1% | 0.49 | 16.38 | 0.03 | 0.601 |", "| 10% |",
                "| 50% | 24.57 | 16.38 | 1.50 | 0.686 | 0.651 | 0.776 | 0.045 | 15.3 | 0.049 |",
                "- 1%: patches 0.495 s, broadcasts 0.509 s of 0.601 s"):
        assert row in table, row


@pytest.mark.parametrize("run, rows", [
    ("benches/bench-2xh200.json",  # a push's fixed cost, and sparse over a slow link
     ["| ours, `send()` | 6.06 | 5.34 | 0.98 |", "| vLLM's torch engine, `send_weights()` | 6.20 |",
      "| ours | 1.23 | 2.33 | 1.51 |", "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket",
      "| dense, packed 1 GiB x 2 | 1.54 | 0.238 | 0.224 | 1.0 |",
      "| sparse, 1% changed | 0.046 | 0.058 | 0.054 | 4.1 |"]),
    ("benches/train-2xh200.json",  # the training loop: each push against no push
     ["| none | 23.89 | 0.00 | 0 | |", "| blocking `send()` | 37.69 | 13.79 | 14.25 | 8.24 |",
      "| vLLM's torch sender, blocking `send_weights()` | 41.70 | 17.81 | 17.32 | 6.71 |",
      "| `send(wait=False)` | 30.03 | 6.14 | 1.71 | 6.72 |",
      "| its snapshot alone (the same copies, no broadcast) | 26.07 | 2.17 | 1.26 | |",
      "adds 0.45 x what the blocking push adds to a step, 0.34 x what vLLM's torch sender adds",
      "its snapshot (dispatch and copy) is 2.17 ms; the other 3.97 ms is the broadcast"]),
])
def test_each_stage_sits_beside_its_baselines(tmp_path, run, rows):
    table = _redraw(run, tmp_path)
    for row in rows:
        assert row in table, row


def test_three_server_rows_compare_one_broadcast_with_pushes_in_turn(tmp_path):
    """The 4-GPU rows, drawn from a run's JSON (figures made up here: no such run yet)."""
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
    a table of its own (figures made up here: no such run yet)."""
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

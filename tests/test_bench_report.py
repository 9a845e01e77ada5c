"""The benchmark's report, from the committed 2 x H200 run (no GPU)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_report_redraws_from_a_runs_json(tmp_path):
    out = subprocess.run([sys.executable, "benches/bench.py", "--plot",
                          "benches/bench-2xh200.json", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    table = out.stdout
    for row in ("raw ncclBroadcast 1 GiB", "packed send qwen3-8b", "vLLM's torch sender",
                "unpacked send qwen3-8b", "many-small", "large", "uniqueid.handshake",
                "from_unique_id_bytes", "| 64 MiB | 1 |", "| 2048 MiB | 3 |"):
        assert row in table, row
    assert "| packed send qwen3-8b -> vLLM 0.33.0 consumer | 0.0514 |" in table
    assert (tmp_path / "bench.md").read_text().strip() in table


def test_sparse_report_redraws_with_its_same_run_baseline(tmp_path):
    out = subprocess.run([sys.executable, "benches/bench.py", "--plot",
                          "benches/bench-sparse-2xh200.json", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for row in ("raw ncclBroadcast 1 GiB", "vLLM 0.33.0 sparse_nccl engine",
                "| 1% | 0.49 | 16.38 | 0.03 |", "| 10% |", "| 50% | 24.57 | 16.38 | 1.50 |"):
        assert row in out.stdout, row

"""The fleet bench (``benches/fleet.py``, CPU): its report of the committed
runs, every figure computed here from the run's own numbers, and a short
run of the bench itself against real do-nothing servers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from statistics import median

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = [ROOT / "benches" / "fleet-cpu-before.json", ROOT / "benches" / "fleet-cpu.json"]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_the_report_prints_each_size_of_a_committed_run(bench, run):
    if not run.exists():
        pytest.skip(f"{run.name} is not committed")
    data = json.loads(run.read_text())
    text = bench.fleet.report(data)
    rows = {(c[0], c[1]): c for c in map(cells, text.splitlines())
            if c[0].isdigit() and len(c) == 13}
    assert len(rows) == len(data["rows"])
    for r in data["rows"]:
        got = rows[(str(r["workers"]), str(r["servers"]))]
        assert got[2] == f"{r['connect_s']:.3f}" and got[3] == f"{r['clients_s']:.3f}"
        assert got[4] == f"{median(r['push_s']) * 1e3:.1f}"
        assert got[5] == f"{median(r['own_s']) * 1e3:.1f}"
        assert got[6] == f"{median(r['cpu_s']) * 1e3:.1f}"
        assert got[7] == f"{median(r['cpu_s']) * 1e3 / r['servers']:.3f}"
        assert got[10:] == [str(r["threads"]), str(r["fds"]), f"{r['memory_mib']:.0f}"]
    assert f"{data['load_start'][0]:.2f}" in text and f"{data['load_end'][0]:.2f}" in text


def test_the_per_server_cost_is_the_slope_from_the_fewest_servers_to_the_most_and_the_cpu_there(bench):
    rows = [{"servers": n, "workers": 1, "push_s": [t, t + 1, t - 1], "cpu_s": [c, c / 2, c * 2]}
            for n, t, c in ((1, 5.0, 1.0), (4, 6.0, 2.0), (64, 131.0, 0.016))]
    fixed, per = bench.fleet.fit(rows)
    assert (fixed, per) == (5000.0, pytest.approx((131.0 - 5.0) * 1e3 / 63))
    line = bench.fleet.cost_line("this", {"commit": "abc", "rows": rows}, 1)
    assert line == (f"this (abc): 5000.0 ms at 1, + {(131.0 - 5.0) * 1e3 / 63:.2f} ms a server; "
                    "CPU 0.250 ms a server at 64")


def test_a_short_run_measures_every_size_against_real_servers(tmp_path):
    out = tmp_path / "fleet.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    p = subprocess.run([sys.executable, "benches/fleet.py", "--sizes", "1", "3", "--workers",
                        "1", "2", "--pushes", "2", "--no-idle", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["servers"], r["workers"]) for r in data["rows"]] == [(1, 1), (3, 1), (1, 2),
                                                                   (3, 2)]
    for r in data["rows"]:
        assert len(r["push_s"]) == len(r["own_s"]) == len(r["cpu_s"]) == 2
        assert 0 < min(r["push_s"]) and 0 < r["clients_s"] <= r["connect_s"]
        assert 1 <= r["threads"] < 16 and r["fds"] >= 3 and r["idle_push_s"] is None
    assert "per-server cost of a push, 2 worker(s) a server" in p.stdout

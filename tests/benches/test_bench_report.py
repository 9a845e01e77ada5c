"""The benchmark's JSON and report, with no GPU.

Every expected figure is computed here from a run's own numbers (medians,
bests, rates, each ratio against its own baseline) and formatted as the
report prints it; nothing is copied from a report. The committed 2 x H200
run is the main input; runs edited here, whose figures are far apart (and
whose medians differ from their means, firsts and middles), make a wrong
column, a swapped baseline or a wrong statistic show as another string.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import subprocess
import sys
from statistics import mean, median

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ROOT / "benches" / "bench-2xh200.json"  # one `bench.py --reps 5` run, every stage
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture
def data() -> dict:
    return json.loads(RUN.read_text())


def draw(bench, data: dict) -> str:
    return bench.report.report(bench.rows.Run.from_json(data))


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def lines_of(table: str, first: str) -> list[str]:
    """The lines of ``table`` whose first cell is ``first`` (its spaces kept)."""
    return [line for line in table.splitlines() if line.startswith(f"| {first} |")]


def line_of(table: str, first: str) -> list[str]:
    found = lines_of(table, first)
    assert len(found) == 1, (first, found)
    return cells(found[0])


def under(table: str, first: str) -> dict[str, list[str]]:
    """The indented rows right under the row ``first``, by their label."""
    lines = table.splitlines()
    i = lines.index(next(line for line in lines if line.startswith(f"| {first} |")))
    out = {}
    for line in lines[i + 1:]:
        if not line.startswith("|   "):
            break
        c = cells(line)
        out[c[0]] = c
    return out


def gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / median(times) / 1e9


def figure(nbytes: int, times: list[float], base: float) -> list[str]:
    """A figure table's middle cells: median s, best s, median GB/s, ratio."""
    return [f"{median(times):.4f}", f"{min(times):.4f}", f"{gbps(nbytes, times):.1f}",
            f"{gbps(nbytes, times) / base:.2f}"]


def raw_gbps(data: dict) -> float:
    return gbps(GiB, data["raw"])


def our_time(row: dict) -> list[float]:
    """Our push's time: the update call timed in its thread, else the push thread's span."""
    return row.get("update") or row["transfer"]


def default_push(data: dict, workload: str, mode: str = "packed") -> dict:
    return next(j for j in data["ours"] if (j["workload"], j["mode"], j["buffer"], j["nbuf"])
                == (workload, mode, GiB, 2))


def spread(low: float) -> list[float]:
    """Four times from ``low``: median, mean, best, first and middle element all differ."""
    out = [low * 1.6, low, low * 1.2, low * 5.0]
    assert len({median(out), mean(out), min(out), out[0], out[len(out) // 2]}) == 5
    return out


def far_apart(data: dict) -> dict:
    """The committed run with our, torch's and the floor's times of every dense
    job far apart (ours 1x, torch 2x, the floor 0.5x), four repetitions each."""
    data = copy.deepcopy(data)
    for j in data["ours"]:
        j["transfer"] = spread(0.04 * (0.5 if j["mode"] == "prepacked" else 1))
        j["wall"] = spread(0.05)
    for t in data["torch"]:
        t["transfer"] = spread(0.08)
        t["wall"] = spread(0.11)
    data["raw"] = spread(0.003)
    return data


# -- the JSON as typed rows ----------------------------------------------------------

def test_the_committed_run_loads_into_typed_rows_and_saves_back_unchanged(bench, data):
    run = bench.rows.Run.from_json(data)
    assert run.to_json() == data
    assert json.dumps(run.to_json(), indent=1) == RUN.read_text()  # key order too
    assert all(isinstance(j, bench.rows.PushRow) for j in run.ours + run.slow_dense)
    assert all(isinstance(t, bench.rows.TorchRow) for t in run.torch)
    assert all(isinstance(j, bench.rows.SparseRow) for j in run.sparse + run.slow_sparse)
    assert all(isinstance(j, bench.rows.TrainRow) for j in run.train)
    first = run.ours[0]
    assert (first.job.workload, first.job.mode, first.job.buffer, first.job.nbuf) == (
        data["ours"][0]["workload"], "packed", GiB, 2)
    assert first.transfer == data["ours"][0]["transfer"] and first.update is None
    assert run.init.vllm == data["init"]["vllm"] and run.fixed_shipped is None


def test_a_row_refuses_a_key_it_has_no_field_for_and_needs_its_figures(bench, data):
    rows = bench.rows
    with pytest.raises(ValueError, match="trasnfer"):
        rows.PushRow.from_json(dict(data["ours"][0], trasnfer=[1.0]))
    with pytest.raises(ValueError, match="fixed_blocs"):
        rows.Run.from_json(dict(data, fixed_blocs=3))
    missing = {k: v for k, v in data["sparse"][0].items() if k != "dense"}
    with pytest.raises(TypeError, match="dense"):
        rows.SparseRow.from_json(missing)
    old = {k: v for k, v in data["sparse"][0].items() if k != "host"}  # predates ``host``
    assert rows.SparseRow.from_json(old).host is None
    assert rows.SparseRow.from_json(old).to_json() == old


def test_blocks_of_one_job_merge_into_one_row(bench, data):
    """The fixed-cost row joins the blocks the senders took in turns: every
    repetition of each, ``reps`` summed, the rest from the first block."""
    rows = bench.rows
    tiny = next(j for j in data["ours"] if j["workload"] == "tiny")
    blocks = [rows.PushRow.from_json(dict(tiny, reps=4, wall=[w] * 4, transfer=[w / 2] * 4,
                                          bytes=4096 + i)) for i, w in enumerate((7e-3, 8e-3))]
    joined = rows.merged(blocks)
    assert joined.job.reps == 8 and joined.job.workload == "tiny"
    assert joined.wall == [7e-3] * 4 + [8e-3] * 4 and joined.transfer == [3.5e-3] * 4 + [4e-3] * 4
    assert joined.bytes == 4096 and blocks[0].job.reps == 4  # the blocks are left as they were


# -- the report, from the command line ------------------------------------------------

def test_the_command_line_redraws_the_report_from_a_runs_json(bench, data, tmp_path):
    out = subprocess.run([sys.executable, "benches/bench.py", "--plot", str(RUN), "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    table = draw(bench, data)
    assert out.stdout.startswith(table + "\n") and "\nplot: " in out.stdout
    assert (tmp_path / "bench.md").read_text() == table + "\n"


# -- each stage, against its baselines ------------------------------------------------

@pytest.fixture(params=["committed", "far apart"])
def run_data(request, data) -> dict:
    return data if request.param == "committed" else far_apart(data)


def test_the_raw_broadcast_is_the_baseline(bench, run_data):
    table = draw(bench, run_data)
    assert line_of(table, "raw ncclBroadcast 1 GiB, 2 ranks (baseline)")[1:] == [
        *figure(GiB, run_data["raw"], raw_gbps(run_data))[:3], "1.00",
        "10 back-to-back broadcasts per repetition"]
    assert table.startswith(f"Sender GPU 0, receiver GPU 1; {run_data['reps']} timed repetitions")


def test_each_dense_push_sits_over_torchs_and_the_floors(bench, run_data):
    """Ours against raw, vLLM's torch sender's against raw and against ours,
    the floor under both: each ratio from its own pair of medians."""
    table, raw, target = draw(bench, run_data), raw_gbps(run_data), run_data["target"]
    torch = {(t["workload"], t["mode"]): t for t in run_data["torch"]}
    floors = {(f["workload"], {"prepacked": "packed", "preplaced": "unpacked"}[f["mode"]]): f
              for f in run_data["ours"] if f["mode"] in ("prepacked", "preplaced")}
    pushes = [("qwen3-8b", "packed"), ("qwen3-8b", "unpacked"), ("many-small", "packed"),
              ("large", "packed")]
    for workload, mode in pushes:
        j = default_push(run_data, workload, mode)
        label = f"{mode} send {workload} -> {target}"
        row = line_of(table, label)
        assert row[1:5] == figure(j["bytes"], our_time(j), raw)
        # the link's own (GPU) time where there was more than one broadcast, else the
        # host-clock span of the broadcasts
        link = (j["link_bytes"] / median(j["link"]) if j["link_bytes"] else
                j["bytes"] / median(j["broadcast"])) / 1e9
        assert bool(j["link_bytes"]) == (workload != "many-small")  # one chunk
        assert row[5].startswith(
            f"{j['tensors']} tensors, {j['chunks']} {'chunks' if mode == 'packed' else 'broadcasts'}; "
            f"broadcasts alone {link:.1f} GB/s ({link / raw:.3f} x raw)")
        assert row[5].endswith("; ratio to raw")
        subs = under(table, label)
        t = torch[(workload, mode)]
        theirs = subs["vLLM's torch sender, same"]
        assert theirs[1:5] == figure(t["bytes"], t["transfer"], raw)
        ours_over_torch = gbps(j["bytes"], our_time(j)) / gbps(t["bytes"], t["transfer"])
        assert theirs[5] == (
            f"ratio to raw; ours / torch = {ours_over_torch:.2f}; whole call (start to finish), "
            f"median: ours {median(j['wall']) * 1e3:.1f} ms, torch {median(t['wall']) * 1e3:.1f} ms, "
            f"ours / torch = {median(t['wall']) / median(j['wall']):.2f}")
        f = floors.get((workload, mode))
        floor_rows = [c for label_, c in subs.items() if label_.startswith("floor:")]
        assert len(floor_rows) == (f is not None)
        if f is not None:
            floor = median(our_time(f))
            assert floor_rows[0][1:] == [*figure(f["bytes"], our_time(f), raw), (
                f"time / floor: ours {median(our_time(j)) / floor:.2f}, "
                f"torch {median(t['transfer']) / floor:.2f}; ratio to raw")]
    assert table.count("no sender work") == len(floors) == 2  # qwen3-8b and many-small, packed


def test_the_first_push_states_the_senders_peak_memory_against_its_bound(bench, data):
    table = draw(bench, data)
    j = data["ours"][0]
    fits = [n for n in (s * 2 for s in _sizes(bench, j["workload"])) if n <= j["buffer"]]
    bound = j["nbuf"] * (j["buffer"] + max(fits))
    assert line_of(table, f"packed send qwen3-8b -> {data['target']}")[5].endswith(
        f"; sender peak extra {j['peak'] / GiB:.2f} GiB (bound {bound / GiB:.2f} GiB); ratio to raw")


def _sizes(bench, workload: str) -> list[int]:
    return [math.prod(shape) for _, shape in bench.workloads.workload(workload)]


def test_many_small_tensors_are_stated_per_tensor(bench, data):
    table = draw(bench, data)
    j = default_push(data, "many-small")
    per = {k: median(j[k]) / j["tensors"] * 1e6 for k in ("transfer", "host", "prepare")}
    assert (f"; per tensor: {per['transfer']:.1f} us in all, of which the sender's host "
            f"{per['host']:.1f} us; prepare {per['prepare']:.1f} us; ratio to raw |") in table


def test_our_time_is_the_update_call_timed_inside_its_thread_where_a_run_has_it(bench, data):
    """The committed run predates it (the push thread's span); edited here."""
    j = default_push(data, "qwen3-8b")
    j["update"] = spread(0.02)
    table, raw = draw(bench, data), raw_gbps(data)
    row = line_of(table, f"packed send qwen3-8b -> {data['target']}")
    assert row[1:5] == figure(j["bytes"], j["update"], raw) != figure(j["bytes"], j["transfer"], raw)
    floor = next(f for f in data["ours"] if f["mode"] == "prepacked" and f["workload"] == "qwen3-8b")
    assert f"time / floor: ours {median(j['update']) / median(floor['transfer']):.2f}," in table


def test_an_unpacked_floor_sits_under_the_unpacked_push(bench, data):
    unpacked = default_push(data, "qwen3-8b", "unpacked")
    data["ours"].append(dict(unpacked, mode="preplaced", transfer=[0.0530, 0.0531, 0.0529, 0.06]))
    table = draw(bench, data)
    subs = under(table, f"unpacked send qwen3-8b -> {data['target']}")
    t = next(t for t in data["torch"] if (t["workload"], t["mode"]) == ("qwen3-8b", "unpacked"))
    floor = median([0.0530, 0.0531, 0.0529, 0.06])
    assert subs["floor: each tensor from one buffer, no sender work"][5] == (
        f"time / floor: ours {median(unpacked['transfer']) / floor:.2f}, "
        f"torch {median(t['transfer']) / floor:.2f}; ratio to raw")
    assert table.count("floor: chunks already packed") == 2


def test_without_the_links_own_time_the_broadcasts_span_is_stated(bench, data):
    """Runs that predate the GPU-timed link (no ``link``), or a push with a
    repetition it did not time, state the broadcasts' host-clock span."""
    j, k = default_push(data, "qwen3-8b"), default_push(data, "large")
    del j["link"], j["link_bytes"]
    k["link"][2] = 0.0
    table, raw = draw(bench, data), raw_gbps(data)
    for row in (j, k):
        rate = gbps(row["bytes"], row["broadcast"])
        assert (f"broadcasts alone {rate:.1f} GB/s ({rate / raw:.3f} x raw)"
                in line_of(table, f"packed send {row['workload']} -> {data['target']}")[5])


def test_init_rows_are_stated_against_vllms_own(bench, run_data):
    table, init = draw(bench, run_data), run_data["init"]
    for name, times in (("uniqueid.handshake", init["ours"]),
                        ("vLLM PyNcclCommunicator.from_unique_id_bytes", init["vllm"])):
        assert line_of(table, name)[1:] == [f"{median(times) * 1e3:.1f}", f"{min(times) * 1e3:.1f}",
                                            f"{median(times) / median(init['vllm']):.2f}"]


def test_the_sweep_states_each_geometry_against_raw(bench, run_data):
    table, raw = draw(bench, run_data), raw_gbps(run_data)
    sweep = sorted((j for j in run_data["ours"] if j["workload"] == "qwen3-8b"
                    and j["mode"] == "packed"), key=lambda j: (j["buffer"], j["nbuf"]))
    assert len(sweep) == 15
    expected = [f"| {j['buffer'] // MiB} MiB | {j['nbuf']} | {gbps(j['bytes'], our_time(j)):.1f} | "
                f"{j['bytes'] / min(our_time(j)) / 1e9:.1f} | {gbps(j['bytes'], our_time(j)) / raw:.2f} | "
                f"{j['held'] / GiB:.2f} |" for j in sweep]
    got = [line for line in table.splitlines() if line.split(" | ")[0].endswith(" MiB")]
    assert got == expected


def test_a_pushs_fixed_cost_is_ours_against_torchs_engine(bench, run_data):
    table = draw(bench, run_data)
    ours = next(j for j in run_data["ours"] if j["workload"] == "tiny")
    theirs = next(t for t in run_data["torch"] if t["workload"] == "tiny")
    ms = lambda xs: f"{median(xs) * 1e3:.2f}"  # noqa: E731
    assert line_of(table, "ours, `send()`")[1:] == [
        ms(ours["wall"]), f"{min(ours['wall']) * 1e3:.2f}",
        f"{median(ours['wall']) / median(theirs['wall']):.2f}"]
    assert line_of(table, "vLLM's torch engine, `send_weights()`")[1:] == [
        ms(theirs["wall"]), f"{min(theirs['wall']) * 1e3:.2f}", "1.00"]
    blocks = run_data["fixed_blocks"]
    assert f"took turns, {blocks} blocks of {ours['reps'] // blocks} pushes each." in table
    assert line_of(table, "ours")[1:] == [ms(ours["start"]), ms(our_time(ours)), ms(ours["finish"])]
    assert line_of(table, "torch")[1:] == [ms(theirs["start"]), ms(theirs["transfer"]),
                                           ms(theirs["finish"])]


def test_the_fixed_cost_over_vllms_own_client_and_the_blocks_drift(bench, data):
    """A run with torch's engine over vLLM's own HTTP client too, and each
    block's medians (figures made up here: the committed run predates them)."""
    tiny = next(t for t in data["torch"] if t["workload"] == "tiny")
    shipped = {k: v for k, v in tiny.items() if k not in ("transfer", "start", "finish")}
    shipped["wall"] = spread(0.009)
    data["fixed_shipped"] = shipped
    data["fixed_block_medians"] = {"ours": [0.0070, 0.0072, 0.0090], "torch": [0.0068, 0.0071],
                                   "shipped": [0.0085, 0.0091]}
    table = draw(bench, data)
    ours = next(j for j in data["ours"] if j["workload"] == "tiny")
    assert line_of(table, "the same over vLLM's own HTTP client (`HTTPVLLMWeightSyncClient`: a new "
                   "connection per call)")[1:] == [
        f"{median(shipped['wall']) * 1e3:.2f}", f"{min(shipped['wall']) * 1e3:.2f}",
        f"{median(shipped['wall']) / median(tiny['wall']):.2f}"]
    assert ("Ours / torch's engine over vLLM's own client, what a torch user runs: "
            f"{median(ours['wall']) / median(shipped['wall']):.2f}.") in table
    assert ("Block medians, ms (the host's drift from block to block): ours 7.00-9.00; "
            "torch 6.80-7.10; torch over vLLM's client 8.50-9.10.") in table


def test_sparse_rows_sit_beside_the_same_runs_dense_baselines(bench, run_data):
    table, raw = draw(bench, run_data), raw_gbps(run_data)
    dense = default_push(run_data, "qwen3-8b")
    assert f"into {run_data['sparse_target']}." in table
    for j in run_data["sparse"]:
        at_raw = j["dense"] / raw / 1e9
        assert line_of(table, f"{j['fraction']:.0%}")[1:] == [
            f"{j['bytes'] / 1e9:.2f}", f"{j['dense'] / 1e9:.2f}", f"{j['bytes'] / j['dense']:.2f}",
            f"{median(j['transfer']):.3f}", f"{min(j['transfer']):.3f}", f"{median(j['total']):.3f}",
            f"{at_raw:.3f}", f"{median(j['transfer']) / at_raw:.1f}", f"{median(dense['transfer']):.3f}"]
        assert (f"- {j['fraction']:.0%}: patches {median(j['host']):.3f} s, broadcasts "
                f"{median(j['broadcast']):.3f} s of {median(j['transfer']):.3f} s") in table


def test_the_slow_link_states_each_sparse_push_against_the_dense_one(bench, data):
    table = draw(bench, data)
    dense = data["slow_dense"][0]
    assert f"(`{data['slow_link']}`)" in table
    assert line_of(table, "dense, packed 1 GiB x 2")[1:] == [
        f"{dense['bytes'] / 1e9:.2f}", f"{median(dense['transfer']):.3f}",
        f"{min(dense['transfer']):.3f}", "1.0"]
    for j in data["slow_sparse"]:
        assert line_of(table, f"sparse, {j['fraction']:.0%} changed")[1:] == [
            f"{j['bytes'] / 1e9:.3f}", f"{median(j['transfer']):.3f}", f"{min(j['transfer']):.3f}",
            f"{median(dense['transfer']) / median(j['transfer']):.1f}"]


def test_the_training_loop_states_what_each_push_adds_to_a_step(bench, data):
    table = draw(bench, data)
    first = {}
    for j in data["train"]:
        first.setdefault(j["mode"], j)  # the first "none" is the one before any push
    none = median(first["none"]["step"])
    ms = lambda x: f"{x * 1e3:.2f}"  # noqa: E731
    add = {m: median(j["step"]) - none for m, j in first.items()}
    labels = {"none": "none", "blocking": "blocking `send()`",
              "torch": "vLLM's torch sender, blocking `send_weights()`", "async": "`send(wait=False)`",
              "snapshot": "its snapshot alone (the same copies, no broadcast)"}
    for mode, label in labels.items():
        j = first[mode]
        assert line_of(table, label)[1:] == [
            ms(median(j["step"])), ms(add[mode]),
            ms(median(j["blocked"])) if j["blocked"] else "0",
            ms(median(j["transfer"])) if j["transfer"] else ""]
    assert (f"adds {add['async'] / add['blocking']:.2f} x what the blocking push adds to a step, "
            f"{add['async'] / add['torch']:.2f} x what vLLM's torch sender adds.") in table
    assert (f"its snapshot (dispatch and copy) is {ms(add['snapshot'])} ms; the other "
            f"{ms(add['async'] - add['snapshot'])} ms") in table
    beside = first["beside"]
    alone, with_it = median(beside["none"]), median(beside["step"])
    assert (f"the step takes {ms(with_it)} ms against {ms(alone)} ms without it, "
            f"+{ms(with_it - alone)} ms: the broadcast's own cost") in table
    assert not lines_of(table, "beside")  # a sentence, not a push row


def test_capped_training_rows_sit_beside_the_uncapped_blocking_push(bench, data):
    """``--max-ctas``: the loop again with NCCL's CTAs capped on every rank
    (figures made up here, each median apart from its mean)."""
    capped = {"none": [0.024, 0.023, 0.030], "blocking": [0.044, 0.040, 0.060],
              "async": [0.027, 0.025, 0.040]}
    data["train"] += [dict(mode=m, step=s, blocked=[0.002, 0.001, 0.009], transfer=[], bytes=10**9,
                           tensors=91, max_ctas=8) for m, s in capped.items()]
    table = draw(bench, data)
    first = {}
    for j in data["train"]:
        if "max_ctas" not in j:
            first.setdefault(j["mode"], j)
    uncapped = median(first["blocking"]["step"]) - median(first["none"]["step"])
    none = median(capped["none"])
    block, wait = median(capped["blocking"]) - none, median(capped["async"]) - none
    assert line_of(table, "8")[1:] == [
        f"{none * 1e3:.2f}", f"{block * 1e3:.2f}", f"{wait * 1e3:.2f}", "2.00",
        f"{wait / block:.2f}", f"{wait / uncapped:.2f}"]
    assert "| 8 |" not in table.split("NCCL_MAX_CTAS")[0]  # in its own table only


def test_three_server_rows_compare_one_broadcast_with_pushes_in_turn(bench, data):
    """The 4-GPU rows (figures made up here: no 4-GPU run yet)."""
    one = dict(data["ours"][0], transfer=[0.05, 0.06, 0.055, 0.2])
    seq = {k: data["ours"][0][k] for k in ("workload", "mode", "buffer", "nbuf", "reps", "bytes",
                                           "tensors")}
    seq.update(transfer=[0.165, 0.16, 0.17, 0.5], total=[0.2] * 4)
    small = {"reps": 4, "raw": [0.003] * 4, "raw4": [0.004, 0.0041, 0.0039, 0.01],
             "target": "reference receiver", "servers_one": [one], "servers_seq": [seq]}
    table = draw(bench, small)
    raw4 = gbps(GiB, small["raw4"])
    assert line_of(table, "raw ncclBroadcast 1 GiB, 4 ranks (baseline)")[1:5] == [
        *figure(GiB, small["raw4"], raw4)[:3], "1.00"]
    assert line_of(table, "one broadcast -> 3 servers (1 -> 3 receivers)")[1:] == [
        *figure(one["bytes"], one["transfer"], raw4), "ratio to 4-rank raw"]
    assert line_of(table, "  one push per server, one after another")[1:] == [
        *figure(seq["bytes"], seq["transfer"], raw4),
        f"GB/s per server's copy; {median(seq['transfer']) / median(one['transfer']):.2f} x the "
        "one broadcast's time"]


def test_per_op_report_puts_each_communicator_next_to_raw(bench):
    raw = [0.0025, 0.003, 0.002, 0.009]
    data = {"non-blocking": [(0.025, 0.004), (0.03, 0.005), (0.02, 0.001), (0.09, 0.02)],
            "blocking": [(0.02, 0.001), (0.03, 0.002)], "bytes": 8_000_000_000, "ops": 100}
    rows = bench.per_op.report(raw, data).splitlines()
    raw_gbs = gbps(GiB, raw)
    assert cells(rows[2])[1:5] == [f"{median(raw) * 1e3:.2f}", f"{min(raw) * 1e3:.2f}",
                                   f"{raw_gbs:.1f}", "1.00"]
    for line, label in zip(rows[3:], ("non-blocking", "blocking")):
        total = [t for t, _ in data[label]]
        rate = gbps(data["bytes"], total)
        assert cells(line) == [f"{label}, 100 broadcasts", f"{median(total) * 1e3:.2f}",
                               f"{min(total) * 1e3:.2f}", f"{rate:.1f}", f"{rate / raw_gbs:.2f}",
                               f"{median(c for _, c in data[label]) / 100 * 1e6:.1f}"]

"""A run's markdown report and plot, from its typed rows (``rows.Run``).

Every figure stands next to a baseline measured in the same run: the raw
1 GiB broadcast (the link's own rate), vLLM's own torch sender pushing the
same tensors into the same server, and the floor (what the consumer takes
when the sender costs nothing). Ratios are stated against those, never
against figures of another machine or day.
"""

from __future__ import annotations

import pathlib
import statistics
from collections.abc import Sequence

from rows import PushRow, Run, SparseRow, TorchRow, TrainRow
from workloads import FLOORS, GiB, MiB, tensor_bytes

median = statistics.median

TABLE_HEADER = ["| figure | median s | best s | median GB/s | ratio | notes |",
                "| --- | --- | --- | --- | --- | --- |"]


def row(name: str, nbytes: int, times: Sequence[float], base: float | None,
        note: str = "") -> str:
    """A line of a figure table: ``times``' median and best, the rate at which
    they moved ``nbytes``, and that rate over ``base`` GB/s (blank without one)."""
    med, best = median(times), min(times)
    gbps = nbytes / med / 1e9
    ratio = f"{gbps / base:.2f}" if base else ""
    return f"| {name} | {med:.4f} | {best:.4f} | {gbps:.1f} | {ratio} | {note} |"


def ms(times: Sequence[float]) -> str:
    """The median of ``times`` in ms, two decimals."""
    return f"{median(times) * 1e3:.2f}"


def link_gbps(j: PushRow) -> float:
    """The link's own rate: GPU-timed from the end of the first broadcast to the
    end of the last (the first also waits for the receiver's HTTP call); runs
    that predate it have the host-clock span of all broadcasts."""
    if j.link_bytes and min(j.link or [0]) > 0:
        return j.link_bytes / median(j.link) / 1e9
    return j.bytes / median(j.broadcast) / 1e9


def report(run: Run) -> str:
    """The whole report: the raw baseline, then each stage the run has."""
    raw = GiB / median(run.raw) / 1e9
    lines = [f"Sender GPU 0, receiver GPU 1; {run.reps} timed repetitions after one "
             "warm-up.", "", *TABLE_HEADER,
             row("raw ncclBroadcast 1 GiB, 2 ranks (baseline)", GiB, run.raw, raw,
                 "10 back-to-back broadcasts per repetition")]
    if run.ours is not None:
        lines += dense_report(run, raw) + fixed_report(run)
    if run.servers_seq is not None:
        lines += servers_report(run)
    if run.sparse is not None:
        lines += sparse_report(run, raw)
    if run.slow_sparse is not None:
        lines += slow_report(run)
    if run.train is not None:
        lines += train_report(run)
    return "\n".join(lines)


def dense_report(run: Run, raw: float) -> list[str]:
    """Our dense sends next to raw, vLLM's torch sender and the floor; init;
    the buffer sweep."""
    ours, target = run.ours or [], run.target
    lines = ["", f"Receiver: {target}.", "", *TABLE_HEADER]
    torch_rows = {(t.job.workload, t.job.mode): t for t in run.torch or []}
    floors = {(f.job.workload, FLOORS[f.job.mode]): f for f in ours if f.job.floor}
    for j in ours:
        if ((j.job.workload == "qwen3-8b" and not j.job.default_geometry)
                or j.job.workload == "tiny" or j.job.floor):
            continue  # in the sweep table, the fixed-cost one, or under its push
        lines += _push_lines(j, j is ours[0], torch_rows.get((j.job.workload, j.job.mode)),
                             floors.get((j.job.workload, j.job.mode)), target, raw)
    if run.init is not None:
        lines += _init_lines(run)
    sweep = [j for j in ours if j.job.workload == "qwen3-8b" and j.job.mode == "packed"]
    if len(sweep) > 1:
        lines += ["", "| buffer | buffers | median GB/s | best GB/s | x raw | sender extra GiB |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for j in sorted(sweep, key=lambda j: (j.job.buffer, j.job.nbuf)):
            med = j.bytes / median(j.span) / 1e9
            best = j.bytes / min(j.span) / 1e9
            lines.append(f"| {j.job.buffer // MiB} MiB | {j.job.nbuf} | {med:.1f} | "
                         f"{best:.1f} | {med / raw:.2f} | {j.held / GiB:.2f} |")
    return lines


def _push_lines(j: PushRow, first: bool, t: TorchRow | None, f: PushRow | None, target: str,
                raw: float) -> list[str]:
    """One of our pushes, then torch's of the same job and the floor under it."""
    packed = j.job.mode == "packed"
    note = (f"{j.tensors} tensors, {j.chunks} {'chunks' if packed else 'broadcasts'}; "
            f"broadcasts alone {link_gbps(j):.1f} GB/s ({link_gbps(j) / raw:.3f} x raw)")
    if j.job.workload == "many-small":
        def per(times: list[float]) -> float:
            return median(times) / j.tensors * 1e6
        note += (f"; per tensor: {per(j.transfer):.1f} us in all, of which the sender's "
                 f"host {per(j.host):.1f} us; prepare {per(j.prepare):.1f} us")
    if first:
        # num_buffers slots, each at most the buffer plus the last tensor of a
        # chunk (a tensor larger than the buffer is sent from its own memory)
        fits = tensor_bytes(j.job.workload)
        bound = j.job.nbuf * (j.job.buffer + max(n for n in fits if n <= j.job.buffer))
        note += f"; sender peak extra {j.peak / GiB:.2f} GiB (bound {bound / GiB:.2f} GiB)"
    lines = [row(f"{j.job.mode} send {j.job.workload} -> {target}", j.bytes, j.span, raw,
                 note + "; ratio to raw")]
    if t is not None and t.transfer is not None:
        ours_gbps = j.bytes / median(j.span) / 1e9
        theirs_gbps = t.bytes / median(t.transfer) / 1e9
        note = f"ratio to raw; ours / torch = {ours_gbps / theirs_gbps:.2f}"
        if j.wall is not None and t.wall is not None:  # the whole call a user waits for
            mine, other = median(j.wall), median(t.wall)
            note += (f"; whole call (start to finish), median: ours {mine * 1e3:.1f} ms, "
                     f"torch {other * 1e3:.1f} ms, ours / torch = {other / mine:.2f}")
        lines.append(row("  vLLM's torch sender, same", t.bytes, t.transfer, raw, note))
    if f is not None:
        floor = median(f.span)
        note = f"time / floor: ours {median(j.span) / floor:.2f}"
        if t is not None and t.transfer is not None:
            note += f", torch {median(t.transfer) / floor:.2f}"
        what = "chunks already packed" if packed else "each tensor from one buffer"
        lines.append(row(f"  floor: {what}, no sender work", f.bytes, f.span, raw,
                         note + "; ratio to raw"))
    return lines


def _init_lines(run: Run) -> list[str]:
    init = run.init
    assert init is not None
    lines = ["", "| init + warm-up, 2 ranks, no HTTP | median ms | best ms | ratio |",
             "| --- | --- | --- | --- |"]
    for name, times in (("uniqueid.handshake", init.ours),
                        ("vLLM PyNcclCommunicator.from_unique_id_bytes", init.vllm)):
        if times is None:
            continue
        ratio = f"{median(times) / median(init.vllm):.2f}" if init.vllm is not None else ""
        lines.append(f"| {name} | {median(times) * 1e3:.1f} | {min(times) * 1e3:.1f} | "
                     f"{ratio} |")
    return lines


def fixed_report(run: Run) -> list[str]:
    """A push's fixed cost (the 4 KiB push): ours against torch's engine, over
    our HTTP client and over vLLM's own; the blocks' drift; its parts."""
    ours = next((j for j in run.ours or [] if j.job.workload == "tiny"), None)
    theirs = next((t for t in run.torch or [] if t.job.workload == "tiny"), None)
    if ours is None or ours.wall is None:
        return []
    turns = (f" Ours and torch's took turns, {run.fixed_blocks} blocks of "
             f"{ours.job.reps // run.fixed_blocks} pushes each." if run.fixed_blocks is not None
             else "")
    them = theirs.wall if theirs is not None else None
    lines = ["", "A push's fixed cost: one 4 KiB tensor, the whole call (start, update, "
             f"finish), median ms.{turns}", "",
             "| sender | median ms | best ms | ratio |", "| --- | --- | --- | --- |",
             f"| ours, `send()` | {ms(ours.wall)} | {min(ours.wall) * 1e3:.2f} | "
             + (f"{median(ours.wall) / median(them):.2f} |" if them else " |")]
    if them:
        lines.append(f"| vLLM's torch engine, `send_weights()` | {ms(them)} | "
                     f"{min(them) * 1e3:.2f} | 1.00 |")
    shipped = run.fixed_shipped
    if them and shipped is not None and shipped.wall is not None:
        lines.append("| the same over vLLM's own HTTP client (`HTTPVLLMWeightSyncClient`: "
                     f"a new connection per call) | {ms(shipped.wall)} | "
                     f"{min(shipped.wall) * 1e3:.2f} | "
                     f"{median(shipped.wall) / median(them):.2f} |")
        lines += ["", "Ratio: time / torch's engine over our HTTP client (which the other "
                  "torch rows use too: the senders' own work compared). Ours / torch's "
                  "engine over vLLM's own client, what a torch user runs: "
                  f"{median(ours.wall) / median(shipped.wall):.2f}."]
    spread = run.fixed_block_medians
    if spread is not None:
        blocks = [(who, m) for who, m in (("ours", spread.ours), ("torch", spread.torch),
                                          ("torch over vLLM's client", spread.shipped)) if m]
        lines += ["", "Block medians, ms (the host's drift from block to block): " + "; ".join(
            f"{who} {min(m) * 1e3:.2f}-{max(m) * 1e3:.2f}" for who, m in blocks) + "."]
    if (theirs is not None and ours.start is not None and ours.finish is not None
            and theirs.start is not None and theirs.finish is not None
            and theirs.transfer is not None):
        how = ("the `/update_weights` call timed inside its thread" if ours.update is not None
               else "posting `/update_weights` to its answer; ours on the push thread")
        lines += ["", f"Its parts, median ms (start and finish are HTTP calls; update: {how}):",
                  "", "| sender | start | update | finish |", "| --- | --- | --- | --- |",
                  f"| ours | {ms(ours.start)} | {ms(ours.span)} | {ms(ours.finish)} |",
                  f"| torch | {ms(theirs.start)} | {ms(theirs.transfer)} | "
                  f"{ms(theirs.finish)} |"]
    return lines


def servers_report(run: Run) -> list[str]:
    """4 GPUs: one broadcast feeding three servers, against one push per server."""
    assert run.raw4 is not None and run.servers_one and run.servers_seq
    raw4 = GiB / median(run.raw4) / 1e9
    one, seq = run.servers_one[0], run.servers_seq[0]
    ratio = median(seq.transfer) / median(one.transfer)
    return ["", f"Three servers (GPUs 1-3, {run.target}), qwen3-8b packed, 1 GiB x 2.", "",
            *TABLE_HEADER,
            row("raw ncclBroadcast 1 GiB, 4 ranks (baseline)", GiB, run.raw4, raw4,
                "10 back-to-back broadcasts per repetition"),
            row("one broadcast -> 3 servers (1 -> 3 receivers)", one.bytes, one.transfer, raw4,
                "ratio to 4-rank raw"),
            row("  one push per server, one after another", seq.bytes, seq.transfer, raw4,
                f"GB/s per server's copy; {ratio:.2f} x the one broadcast's time")]


def sparse_report(run: Run, raw: float) -> list[str]:
    """Sparse pushes of qwen3-8b, next to the dense bytes at raw speed and the
    run's packed dense send."""
    dense = next((j for j in run.ours or [] if j.job.workload == "qwen3-8b"
                  and j.job.mode == "packed" and j.job.default_geometry), None)
    extra = dense is not None
    lines = ["", f"Sparse: `SparseSender.send` of qwen3-8b into {run.sparse_target}. Baselines "
             "of the same run: the dense bytes at the raw broadcast's speed"
             + (", and the packed dense send above" if extra else "") + ".", "",
             "| changed | wire GB | dense GB | wire / dense | median s | best s | "
             "with counting s | dense at raw s | time / dense at raw |"
             + (" dense send s |" if extra else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if extra else "")]
    sparse: list[SparseRow] = run.sparse or []
    for j in sparse:
        med = median(j.transfer)
        at_raw = j.dense / raw / 1e9
        lines.append(
            f"| {j.fraction:.0%} | {j.bytes / 1e9:.2f} | {j.dense / 1e9:.2f} | "
            f"{j.bytes / j.dense:.2f} | {med:.3f} | {min(j.transfer):.3f} | "
            f"{median(j.total):.3f} | {at_raw:.3f} | {med / at_raw:.1f} |"
            + (f" {median(dense.transfer):.3f} |" if dense is not None else ""))
    split = [j for j in sparse if j.host is not None]
    if split:
        lines += ["", "Where a sparse push's time goes (medians): the sender building "
                  "patches (host, waits included), the broadcasts' span, and the rest of "
                  "`/update_weights` (vLLM's loader after the last broadcast).", ""]
        lines += [f"- {j.fraction:.0%}: patches {median(j.host or []):.3f} s, "
                  f"broadcasts {median(j.broadcast):.3f} s of {median(j.transfer):.3f} s"
                  for j in split]
    return lines


def slow_report(run: Run) -> list[str]:
    """Over the slow link: the dense packed push against sparse pushes."""
    assert run.slow_dense
    dense = run.slow_dense[0]
    base = median(dense.transfer)
    lines = ["", f"Slow link: both ends on NCCL's socket transport (`{run.slow_link}`), "
             f"four qwen3-8b layers ({dense.bytes / 1e9:.2f} GB).", "",
             "| push | wire GB | median s | best s | x faster than dense |",
             "| --- | --- | --- | --- | --- |",
             f"| dense, packed 1 GiB x 2 | {dense.bytes / 1e9:.2f} | {base:.3f} | "
             f"{min(dense.transfer):.3f} | 1.0 |"]
    for j in run.slow_sparse or []:
        med = median(j.transfer)
        lines.append(f"| sparse, {j.fraction:.0%} changed | {j.bytes / 1e9:.3f} | "
                     f"{med:.3f} | {min(j.transfer):.3f} | {base / med:.1f} |")
    return lines


TRAIN_LABELS = (("none", "none"), ("blocking", "blocking `send()`"),
                ("torch", "vLLM's torch sender, blocking `send_weights()`"),
                ("async", "`send(wait=False)`"),
                ("snapshot", "its snapshot alone (the same copies, no broadcast)"))


def train_report(run: Run) -> list[str]:
    """The training loop: what each push adds to a step, against no push."""
    rows: dict[str, TrainRow] = {}
    for j in run.train or []:
        if j.max_ctas is None:
            rows.setdefault(j.mode, j)  # the first "none" (before any push)
    none = median(rows["none"].step)
    lines = ["", f"Training loop: a Flax decoder ({rows['none'].bytes / 1e9:.2f} GB of bf16 "
             f"parameters, {rows['none'].tensors} tensors) trains on GPU 0 and pushes to "
             f"{run.target} on GPU 1 after every step; medians over "
             f"{len(rows['none'].step)} steps.", "",
             "| push | step ms | added to a step ms | trainer blocked ms | push's transfer ms |",
             "| --- | --- | --- | --- | --- |"]
    for mode, label in TRAIN_LABELS:
        j = rows.get(mode)
        if j is None:
            continue
        step = median(j.step)
        lines.append(f"| {label} | {step * 1e3:.2f} | {(step - none) * 1e3:.2f} | "
                     + (f"{ms(j.blocked)} | " if j.blocked else "0 | ")
                     + (f"{ms(j.transfer)} |" if j.transfer else "|"))

    def add(mode: str) -> float:
        return median(rows[mode].step) - none

    if "blocking" in rows and "async" in rows:
        lines += ["", f"The asynchronous push adds {add('async') / add('blocking'):.2f} x what "
                  "the blocking push adds to a step"
                  + (f", {add('async') / add('torch'):.2f} x what vLLM's torch sender adds."
                     if "torch" in rows else ".")]
    if "async" in rows and "snapshot" in rows:
        lines += [f"Of the {add('async') * 1e3:.2f} ms it adds, its snapshot (dispatch and "
                  f"copy) is {add('snapshot') * 1e3:.2f} ms; the other "
                  f"{(add('async') - add('snapshot')) * 1e3:.2f} ms is the push running beside "
                  "the training step: its broadcast on the GPU, its thread on the host."]
    if "async" in rows:
        lines += [f"Its extra device memory is its snapshot, one copy of the pushed bytes on "
                  f"the trainer's GPU ({rows['async'].bytes / 1e9:.2f} GB), kept for the "
                  "next asynchronous push."]
    beside = rows.get("beside")
    if beside is not None and beside.none is not None:
        alone, with_it = median(beside.none), median(beside.step)
        lines += [f"A raw broadcast of the same {beside.bytes / 1e9:.2f} GB launched beside each "
                  "step (no push thread, no HTTP, no snapshot; another process receives it on "
                  f"GPU 1): the step takes {with_it * 1e3:.2f} ms against {alone * 1e3:.2f} ms "
                  f"without it, +{(with_it - alone) * 1e3:.2f} ms: the broadcast's own cost to "
                  "the step."]
    return lines + capped_report(run, add("blocking") if "blocking" in rows else None)


def capped_report(run: Run, blocking: float | None) -> list[str]:
    """The training loop again with NCCL's CTAs (SMs) capped on every rank:
    a slower broadcast that leaves more of the GPU to the training step.
    ``blocking``: what the uncapped blocking push adds to a step."""
    caps: dict[int, dict[str, TrainRow]] = {}
    for j in run.train or []:
        if j.max_ctas is not None:
            caps.setdefault(j.max_ctas, {}).setdefault(j.mode, j)
    if not caps:
        return []
    lines = ["", "The same loop with `NCCL_MAX_CTAS` set for the server and the trainer alike "
             "(NCCL needs the same cap on every rank), ms:", "",
             "| NCCL_MAX_CTAS | step, no push | blocking adds | `send(wait=False)` adds | "
             "it blocks the trainer | async / blocking, same cap | async / uncapped blocking |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, rows in sorted(caps.items()):
        none = median(rows["none"].step)
        block, wait = median(rows["blocking"].step) - none, median(rows["async"].step) - none
        lines.append(f"| {n} | {none * 1e3:.2f} | {block * 1e3:.2f} | {wait * 1e3:.2f} | "
                     f"{median(rows['async'].blocked) * 1e3:.2f} | {wait / block:.2f} | "
                     + (f"{wait / blocking:.2f} |" if blocking else "|"))
    return lines


def plot(run: Run, path: pathlib.Path) -> bool:
    """The buffer sweep's GB/s against buffer size, next to the unpacked send
    and the raw broadcast, drawn to ``path``; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    raw = GiB / median(run.raw) / 1e9
    ours = run.ours or []
    sweep = [j for j in ours if j.job.workload == "qwen3-8b" and j.job.mode == "packed"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for n in sorted({j.job.nbuf for j in sweep}):
        pts = sorted((j.job.buffer / MiB, j.bytes / median(j.span) / 1e9)
                     for j in sweep if j.job.nbuf == n)
        ax.plot(*zip(*pts), marker="o", label=f"packed, {n} buffer{'s' * (n > 1)}")
    for j in ours:
        if j.job.workload == "qwen3-8b" and j.job.mode == "unpacked":
            ax.axhline(j.bytes / median(j.span) / 1e9, color="gray", ls="--", label="unpacked")
    ax.axhline(raw, color="black", ls=":", label="raw 1 GiB broadcast")
    ax.set(xscale="log", xlabel="packed buffer size (MiB)", ylabel="GB/s (median)",
           title=f"qwen3-8b send -> {run.target}, 2 x H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True

"""Weight-push throughput, latency and memory, next to baselines measured in the same run.

    python benches/bench.py [--reps 5] [--quick] [--only dense|servers|sparse|slow|train]
    python benches/bench.py --plot results/bench.json  # redraw the plot elsewhere

GPU 0 is the trainer, GPU 1 the receiver. Rows:

- raw ``ncclBroadcast`` of one pre-allocated 1 GiB buffer through this
  project's binding, 10 back to back per repetition (algbw): the baseline;
- init + warm-up without HTTP: ``uniqueid.handshake`` against vLLM's
  ``PyNcclCommunicator.from_unique_id_bytes`` (both ranks start together);
- ``send`` of the workloads into vLLM 0.33.0's own consumer
  (``.vllm/server.py --nccl``), packed and unpacked, next to vLLM's own torch
  sender (``NCCLTrainerWeightTransferEngine``) pushing the same tensors into
  the same server; a buffer-size sweep; ``many-small``; ``large``;
- with 4 GPUs: a 4-rank raw broadcast, and ``qwen3-8b`` into three servers
  (GPUs 1-3) by one broadcast, against one push per server in turn;
- ``SparseSender.send`` of ``qwen3-8b`` with 1%, 10% and 50% of the elements
  changed into vLLM's own ``sparse_nccl`` engine (``jax_sender.testing.vllm_sparse``),
  next to the dense sends above;
- a push's fixed cost: one 4 KiB tensor, the whole ``send()`` against vLLM's
  torch engine's ``send_weights()`` (both: start, update, finish), the two
  senders taking turns in blocks;
- a slow link (``--only slow``): both ends forced onto NCCL's socket
  transport over loopback, four qwen3-8b layers, a dense push against
  ``SparseSender.send`` at 1% and 10% changed;
- a training loop (``--only train``): a Flax decoder's step on GPU 0
  (forward, backward, SGD, parameters donated) pushing to the server after
  every step: no push, the blocking push, ``send(wait=False)``; a raw
  broadcast of the same bytes launched beside each step (no push thread,
  no HTTP, no snapshot), which is what the broadcast alone costs the step;
  with ``--max-ctas N ...``, again with NCCL's CTAs capped at N on every rank.

Send time: the ``/update_weights`` call (the broadcasts start at once) to
its answer, i.e. every worker holding every tensor, timed inside the thread
that makes it, for both senders; ``broadcast`` is the sender's own
first-launch-to-last-done span.
Each row: median and best of ``--reps`` after one warm-up. Writes
``results/bench.md``, ``results/bench.json`` and, with matplotlib,
``results/bench.png``. Without ``.vllm/`` the sends go to the reference
receiver and the torch rows are left out.

Layout: this file is the entry point (arguments, stages, servers, the
run's JSON); ``workloads.py`` the tensors and jobs; ``roles.py`` and
``torch_roles.py`` what each child process runs (JAX, and vLLM's torch
side), started by ``procs.py`` as ``python benches/bench.py role_x ARGS``
and answering in ``RESULT`` lines; ``floor.py`` the floor push; ``rows.py``
the figures as typed rows (the JSON); ``report.py`` the tables and plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import roles
import torch_roles
from procs import mint_uid, need_gpus, one, ranks, roles_of, run_role, vllm_env
from report import plot, report
from rows import BlockMedians, InitTimes, PushRow, Run, SeqRow, SparseRow, TorchRow, TrainRow, merged
from workloads import Job, MiB

from jax_sender.testing.harness import SHARE_GPUS, gpu_count

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "results"

SPARSE_FRACTIONS = [0.01, 0.1, 0.5]
SLOW_FRACTIONS = [0.01, 0.1]
# Both ends on NCCL's socket transport over loopback: a slow link between
# trainer and servers, the case sparse updates exist for.
SLOW_LINK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
             "NCCL_SOCKET_IFNAME": "lo"}
STAGES = ("dense", "servers", "sparse", "slow", "train")
FIXED_BLOCKS = 10  # the 4 KiB row: ours and torch's in turns
TRAIN_STEPS = "20"
# A stage's failures that are recorded in the run while the others still run:
# a child that failed or overran, or emitted a row that its type refuses
# (``rows.JsonRow.from_json``: ValueError, TypeError).
STAGE_FAILURES = (RuntimeError, subprocess.TimeoutExpired, KeyError, TypeError, ValueError)


@dataclass
class Session:
    """A run in progress: where it writes, its repetitions, whether vLLM's
    tree imports here, and what it has measured so far."""

    out: pathlib.Path
    reps: int
    vllm: bool
    run: Run

    def save(self) -> None:
        """Write the run's JSON as it stands: every stage's figures are saved
        as soon as they exist."""
        (self.out / "bench.json").write_text(json.dumps(self.run.to_json(), indent=1))

    @property
    def torch_env(self) -> dict[str, str]:
        """What a torch role's process needs in its environment."""
        return vllm_env() if self.vllm else {}

    def server(self, gpu: str, sparse: bool = False):
        """The receiving server on ``gpu``: vLLM 0.33.0's own when it imports here
        (its log under the results folder), else the reference receiver."""
        from jax_sender.testing.harness import ReferenceServer, VLLMServer
        if not self.vllm:
            return ReferenceServer([gpu], backend="sparse_nccl" if sparse else "nccl")
        name = f"vllm_{'sparse_' * sparse}server_{gpu}"
        return VLLMServer(gpu, output=self.out / f"{name}.log",
                          requests=self.out / f"{name}.requests.jsonl", sparse=sparse)

    def stage(self, name: str, run_stage: Callable[[], None]) -> None:
        """Run a stage; its failure is recorded and the others still run."""
        try:
            run_stage()
        except STAGE_FAILURES as e:
            self.run.failed(name, str(e)[-3000:])
            print(f"stage {name} failed: {str(e)[-2000:]}", file=sys.stderr)


def jobs_json(jobs: Sequence[Job]) -> str:
    """``jobs`` as a role's argument."""
    return json.dumps([j.to_json() for j in jobs])


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment, which every child inherits."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(reps: int, quick: bool, only: str | None, max_ctas: Sequence[int],
            out: pathlib.Path) -> Run:
    """Run the raw baseline and the stages (``only``: that one), saving to ``out``.

    Args:
        reps: timed repetitions of each row, after one warm-up.
        quick: no buffer sweep, no many-small, no large.
        only: one of ``STAGES``, or None for all of them.
        max_ctas: the training loop again with each of these NCCL CTA caps.
        out: the results folder.

    Returns:
        The run, as saved in ``out / "bench.json"``.
    """
    from jax_sender.testing.harness import vllm_available
    need_gpus(2)
    if os.environ.get(SHARE_GPUS):
        sys.exit(f"unset {SHARE_GPUS}: ranks sharing a GPU talk over sockets, so their "
                 "timings mean nothing")
    four = gpu_count() >= 4
    if only == "servers" and not four:
        sys.exit("--only servers needs 4 GPUs")
    raw = ranks("role_raw", 2, "2", str(reps), ids=mint_uid())[0][0]
    vllm = vllm_available()
    s = Session(out, reps, vllm, Run(reps=reps, raw=raw, target="vLLM 0.33.0 consumer" if vllm
                                     else "reference receiver"))
    if only in (None, "dense"):
        dense(s, quick)
    if only in (None, "servers") and four:
        servers(s)
    if only in (None, "sparse"):
        with s.server("1", sparse=True) as url:
            s.run.sparse_target = ("vLLM 0.33.0 sparse_nccl engine" if vllm
                                   else "reference receiver, sparse_nccl")
            s.run.sparse = [SparseRow.from_json(x) for x in one(
                "role_sparse", url, json.dumps(SPARSE_FRACTIONS), str(reps))]
        s.save()
    if only in (None, "slow"):
        s.stage("slow", lambda: slow(s))
    if only in (None, "train"):
        s.stage("train", lambda: train(s, max_ctas))
        s.save()
    s.save()
    return s.run


def init_latency(s: Session) -> InitTimes:
    """Both ranks start each round at the same wall-clock instant; a round
    takes as long as its slower rank. Round 0 (library load, CUDA context) is
    dropped. Rounds are short, so there are four times ``reps`` of them."""
    rounds = s.reps * 4

    def rank_max(role: str, imports_s: float, env: dict[str, str]) -> list[float]:
        start = str(time.time() + imports_s)  # imports first
        r = ranks(role, 2, start, ids=[mint_uid() for _ in range(rounds + 1)],
                  timeout=120 + rounds, env=env)
        return [max(a, b) for a, b in zip(r[0][0], r[1][0])][1:]

    return InitTimes(ours=rank_max("role_init_ours", 10, {}),
                     vllm=rank_max("role_init_vllm", 25, s.torch_env) if s.vllm else None)


def dense(s: Session, quick: bool) -> None:
    """Init; our sends (the main jobs, the sweep, many-small, large, the
    floors) and torch's; the fixed cost."""
    reps = s.reps
    s.run.init = init_latency(s)
    s.save()
    main = [Job(workload="qwen3-8b", mode="packed", reps=reps),
            Job(workload="qwen3-8b", mode="unpacked", reps=reps)]
    sweep = [] if quick else [
        Job(workload="qwen3-8b", mode="packed", reps=reps, buffer=b * MiB, nbuf=n)
        for b in (64, 256, 512, 1024, 2048) for n in (1, 2, 3) if (b, n) != (1024, 2)]
    extra = [] if quick else [Job(workload="many-small", mode="packed", reps=reps),
                              Job(workload="large", mode="packed", reps=reps)]
    floors = [Job(workload="qwen3-8b", mode="prepacked", reps=reps),
              Job(workload="qwen3-8b", mode="preplaced", reps=reps)] + (
        [] if quick else [Job(workload="many-small", mode="prepacked", reps=reps)])
    with s.server("1") as url:
        s.run.ours = [PushRow.from_json(x) for x in one(
            "role_jax", url, jobs_json(main + sweep + extra + floors))]
        s.save()
        if s.vllm:
            try:
                s.run.torch = [TorchRow.from_json(x) for x in one(
                    "role_torch", url, jobs_json(main + extra), env=s.torch_env)]
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                s.run.torch_error = str(e)[-3000:]  # the table still prints our rows
            s.save()
        s.stage("fixed", lambda: fixed(s, url))
        s.save()


def fixed(s: Session, url: str) -> None:
    """The 4 KiB push, ours and vLLM's torch engine's in turns, in one process:
    ``FIXED_BLOCKS`` blocks of ``4 x reps`` pushes each (a push takes ~7 ms,
    so the row affords the repetitions). The host drifts by about +-10 %
    from block to block, so many short blocks rather than a few long ones,
    and their medians are kept to show it."""
    job = Job(workload="tiny", mode="packed", reps=s.reps * 4)
    with_torch = s.vllm and s.run.torch is not None
    runs = one("role_fixed", url, str(FIXED_BLOCKS), json.dumps(job.to_json()),
               "1" if with_torch else "0", env=s.torch_env if with_torch else {})
    s.run.fixed_blocks = FIXED_BLOCKS
    ours = [PushRow.from_json(r["row"]) for r in runs if r["sender"] == "ours"]
    torch = [TorchRow.from_json(r["row"]) for r in runs if r["sender"] == "torch"]
    shipped = [TorchRow.from_json(r["row"]) for r in runs if r["sender"] == "shipped"]

    def medians(rows: Sequence[PushRow | TorchRow]) -> list[float] | None:
        return [statistics.median(r.wall or []) for r in rows] if rows else None

    if ours:
        assert s.run.ours is not None
        s.run.ours.append(merged(ours))
        s.run.fixed_block_medians = BlockMedians(ours=medians(ours) or [], torch=medians(torch),
                                                 shipped=medians(shipped))
    if torch:
        assert s.run.torch is not None
        s.run.torch.append(merged(torch))
    if shipped:
        s.run.fixed_shipped = merged(shipped)


def servers(s: Session) -> None:
    """4 GPUs: a 4-rank raw broadcast, then qwen3-8b into three servers (GPUs
    1-3) by one broadcast, and by one push per server, one after another."""
    s.run.raw4 = ranks("role_raw", 4, "4", str(s.reps), ids=mint_uid())[0][0]
    s.save()
    servers = [s.server(g) for g in "123"]
    job = jobs_json([Job(workload="qwen3-8b", mode="packed", reps=s.reps)])
    with contextlib.ExitStack() as stack:
        urls = json.dumps([stack.enter_context(server) for server in servers])
        s.run.servers_one = [PushRow.from_json(x) for x in one("role_jax", urls, job)]
        s.save()
        s.run.servers_seq = [SeqRow.from_json(x) for x in one("role_seq", urls, job)]
        s.save()


def slow(s: Session) -> None:
    """Four qwen3-8b layers over NCCL's socket transport on loopback: a dense
    packed push into the dense engine, against sparse pushes into the sparse one."""
    with environment(SLOW_LINK):
        s.run.slow_link = " ".join(f"{k}={v}" for k, v in SLOW_LINK.items())
        with s.server("1") as url:
            s.run.slow_dense = [PushRow.from_json(x) for x in one(
                "role_jax", url, jobs_json([Job(workload="layers4", mode="packed",
                                                reps=s.reps)]))]
        s.save()
        with s.server("1", sparse=True) as url:
            s.run.slow_sparse = [SparseRow.from_json(x) for x in one(
                "role_sparse", url, json.dumps(SLOW_FRACTIONS), str(s.reps), "layers4")]
        s.save()


def train(s: Session, max_ctas: Sequence[int]) -> None:
    """The training loop pushing after every step (ours, then torch's); a raw
    broadcast beside each step; again under each NCCL CTA cap."""
    with s.server("1") as url:
        s.run.train = [TrainRow.from_json(x) for x in one("role_train", url, TRAIN_STEPS)]
        s.save()
        if s.vllm:
            s.run.train += [TrainRow.from_json(x) for x in one(
                "role_train_torch", url, TRAIN_STEPS, env=s.torch_env)]
    s.save()
    rows = s.run.train
    s.stage("beside", lambda: rows.extend(TrainRow.from_json(x) for x in ranks(
        "role_beside", 2, TRAIN_STEPS, ids=mint_uid(), timeout=300)[0]))
    for n in max_ctas:  # NCCL needs the same cap on every rank: server and trainer
        with environment({"NCCL_MAX_CTAS": str(n)}), s.server("1") as url:
            rows += [replace(TrainRow.from_json(x), max_ctas=n)
                     for x in one("role_train", url, TRAIN_STEPS)]
        s.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="no sweep, no many-small, no large")
    ap.add_argument("--only", choices=STAGES,
                    help="the raw baseline and this stage only (servers: 4 GPUs)")
    ap.add_argument("--max-ctas", type=int, nargs="*", default=[], metavar="N",
                    help="train stage: also run the loop with NCCL_MAX_CTAS=N on every rank")
    ap.add_argument("--plot", metavar="JSON", help="only redraw table and plot from a run's JSON")
    ap.add_argument("--out", default=str(OUT), help="results folder (default: results/)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        run = Run.from_json(json.loads(pathlib.Path(args.plot).read_text()))
    else:
        run = measure(args.reps, args.quick, args.only, args.max_ctas, out)
    table = report(run)
    (out / "bench.md").write_text(table + "\n")
    print(table)
    if run.ours is None:
        print("plot: none (no dense sends in this run)")
    else:
        print("plot:", out / "bench.png" if plot(run, out / "bench.png")
              else "matplotlib not installed; redraw with --plot results/bench.json")


if __name__ == "__main__":
    if not run_role(sys.argv, roles_of(roles, torch_roles)):
        main()

"""A fleet of servers: what connecting and pushing cost the sender per server (CPU, no GPU).

    PYTHONPATH=.:tests python benches/fleet.py [--sizes 1 4 16 64 256] [--workers 1 8]
        [--pushes 20] [--out results/fleet.json]
    python benches/fleet.py --report benches/fleet-cpu.json [--before benches/fleet-cpu-before.json]

(From the repository's root; ``tests`` for the test suite's ``support``.)
For each size, ``support.servers.idle_servers`` serves that many do-nothing vLLM
servers (every route answered at once with vLLM's shapes, idle connections
closed after 5 s as uvicorn does) from one asyncio process, and a fresh
sender process measures the real ``WeightSender`` against them: its group
formed through the real ``uniqueid.connect`` over the tests' ``MemoryJoin``,
its broadcasts handed to a data plane that moves nothing
(``support.servers.memory_link.NullBroadcaster``), so only the sender's cost per
server is seen, not NCCL's. Per size:

- connect: building the clients (``as_clients`` of the URLs, as
  ``WeightSender.connect`` does) plus forming the group (world sizes,
  inits, the join);
- a push of one 4 KiB tensor (``--pushes`` of them, after 3 to warm up),
  median wall time; the sender's own part of it (``send()`` less its
  start, update and finish calls, as ``host_cost.py`` counts it); the
  sender process's CPU time per push (HTTP included, this bench's own
  sampling thread not), and that divided by the servers;
- one push after 6 s idle (every kept connection closed by the servers);
- ``close()`` (every server released);
- the most threads and file descriptors the sender process held, and its
  peak memory above what it held before connecting (sampled every 10 ms).

The file-descriptor limit is raised to its hard limit first: each server
takes one in each process (1,024 servers pass the usual soft limit).

Writes ``--out`` (JSON, with the load average at the start and the end:
the figures of a loaded host are worth what its load is) and prints the
tables; ``--report`` prints them for a saved run, ``--before`` adds the
per-server cost of another run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULT = "RESULT "
IDLE_S = 6.0  # past the servers' 5 s keep-alive: every connection is re-dialled
WARM_UP = 3


# -- the sender's process -------------------------------------------------

class Sampler:
    """The process's threads, file descriptors and resident memory, at most
    of each since ``start``, every ``period`` seconds (its own thread not
    counted, and its CPU time told apart by ``cpu``: reading 1,024 file
    descriptors every 10 ms is this bench's cost, not the sender's)."""

    def __init__(self, period: float = 0.01):
        self.period = period
        self.threads = self.fds = self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-sampler", daemon=True)

    def sample(self) -> None:
        self.threads = max(self.threads, threading.active_count() - 1)
        self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))
        self.rss = max(self.rss, rss_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def cpu(self) -> float:
        """The CPU time its thread has used so far, in seconds."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def role_fleet(urls_json: str, workers: str, pushes: str, idle: str) -> None:
    """Connect to the servers, push, push after idling, close; one RESULT line."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_platforms", "cpu")
    from jax_sender import SendConfig, WeightSender
    from jax_sender._src.core.routes import SingleProcess
    from jax_sender._src.core.session import Session
    from uniqueid import as_clients

    from support.servers.memory_link import MemoryJoin, NullBroadcaster

    urls = json.loads(urls_json)
    params = [("w", jnp.arange(1024, dtype=jnp.float32))]
    jax.block_until_ready(params[0][1])
    config = SendConfig(send_timeout_s=120.0)
    base = rss_bytes()
    sampler = Sampler().start()
    t0 = time.perf_counter()
    clients = as_clients(urls)
    t1 = time.perf_counter()
    route = SingleProcess(clients=clients, device=0, config=config, joiner=MemoryJoin())
    session = Session(route, route.form(config.init_timeout_s), config,
                      broadcaster=lambda _: NullBroadcaster())
    t2 = time.perf_counter()
    sender = WeightSender(session, device=jax.devices("cpu")[0])
    for _ in range(WARM_UP):
        sender.send(params)
    walls, own, cpu = [], [], []
    for _ in range(int(pushes)):
        w, c = time.perf_counter(), time.process_time() - sampler.cpu()
        s = sender.send(params)
        walls.append(time.perf_counter() - w)
        cpu.append(time.process_time() - sampler.cpu() - c)
        own.append(walls[-1] - (s.start_s + s.update_s + s.finish_s))
    idle_push = None
    if idle == "1":
        time.sleep(IDLE_S)
        w = time.perf_counter()
        sender.send(params)
        idle_push = time.perf_counter() - w
    w = time.perf_counter()
    sender.close()
    closed = time.perf_counter() - w
    sampler.stop()
    print(RESULT + json.dumps(dict(
        servers=len(urls), workers=int(workers), clients_s=t1 - t0, connect_s=t2 - t0,
        push_s=walls, own_s=own, cpu_s=cpu, idle_push_s=idle_push, close_s=closed,
        threads=sampler.threads, fds=sampler.fds, memory_mib=(sampler.rss - base) / 2**20)),
        flush=True)


# -- the run ----------------------------------------------------------------

def measure(servers: int, workers: int, pushes: int, idle: bool) -> dict[str, Any]:
    """One size: its do-nothing servers in one process, the sender in another."""
    from support import on_tests_path
    from support.servers.idle_servers import IdleServers

    with IdleServers(servers, workers=workers) as fleet:
        p = subprocess.run([sys.executable, __file__, "role_fleet", json.dumps(fleet.urls),
                            str(workers), str(pushes), "1" if idle else "0"],
                           env=on_tests_path(dict(os.environ)), capture_output=True, text=True,
                           timeout=1800)
    found = [line for line in p.stdout.splitlines() if line.startswith(RESULT)]
    if p.returncode or not found:
        raise RuntimeError(f"the sender failed at {servers} servers:\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-4000:]}")
    return json.loads(found[0][len(RESULT):])


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def raise_fd_limit() -> None:
    """The soft limit on file descriptors up to the hard one, for this
    process and the ones it starts (a server takes one in each)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(sizes: list[int], workers: list[int], pushes: int, idle: bool) -> dict[str, Any]:
    raise_fd_limit()
    data: dict[str, Any] = {"commit": git_commit(), "cpus": os.cpu_count(),
                            "load_start": list(os.getloadavg()), "pushes": pushes, "rows": []}
    for w in workers:
        for n in sizes:
            data["rows"].append(measure(n, w, pushes, idle))
            print(f"{n} servers x {w} workers: push "
                  f"{statistics.median(data['rows'][-1]['push_s']) * 1e3:.1f} ms", flush=True)
    data["load_end"] = list(os.getloadavg())
    return data


# -- the report ---------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The median push (ms) at the fewest servers, and what each server past
    them added on the way to the most: (fixed, per server)."""
    by = sorted(rows, key=lambda r: r["servers"])
    first, last = by[0], by[-1]
    at = lambda r: statistics.median(r["push_s"]) * 1e3  # noqa: E731
    if last["servers"] == first["servers"]:
        return at(first), 0.0
    return at(first), (at(last) - at(first)) / (last["servers"] - first["servers"])


def cost_line(label: str, data: dict[str, Any], workers: int) -> str:
    rows = [r for r in data["rows"] if r["workers"] == workers]
    fixed, per = fit(rows)
    n = min(r["servers"] for r in rows)
    most = max(rows, key=lambda r: r["servers"])
    cpu = statistics.median(most["cpu_s"]) * 1e3 / most["servers"]
    return (f"{label} ({data.get('commit') or 'unknown'}): {fixed:.1f} ms at {n}, "
            f"+ {per:.2f} ms a server; CPU {cpu:.3f} ms a server at {most['servers']}")


def table(data: dict[str, Any]) -> str:
    head = ("| workers | servers | connect s | of which clients s | push ms | sender's own ms "
            "| sender CPU ms | CPU a server ms | push after 6 s idle ms | close s | threads "
            "| fds | memory MiB |")
    out = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for r in data["rows"]:
        idle = "" if r.get("idle_push_s") is None else ms(r["idle_push_s"])
        out.append(
            f"| {r['workers']} | {r['servers']} | {r['connect_s']:.3f} | {r['clients_s']:.3f} "
            f"| {ms(statistics.median(r['push_s']))} | {ms(statistics.median(r['own_s']))} "
            f"| {ms(statistics.median(r['cpu_s']))} "
            f"| {statistics.median(r['cpu_s']) * 1e3 / r['servers']:.3f} | {idle} | {r['close_s']:.3f} "
            f"| {r['threads']} | {r['fds']} | {r['memory_mib']:.0f} |")
    return "\n".join(out)


def report(data: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    load = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [f"Medians of {data['pushes']} pushes per size; {data['cpus']} CPUs, load average "
             f"(1, 5, 15 min) {load(data['load_start'])} at the start, "
             f"{load(data['load_end'])} at the end.", "", table(data), ""]
    for w in sorted({r["workers"] for r in data["rows"]}):
        parts = [cost_line("this run", data, w)]
        if before is not None:
            parts.insert(0, cost_line("before", before, w))
        lines.append(f"- per-server cost of a push, {w} worker(s) a server: " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "role_fleet":
        role_fleet(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--pushes", type=int, default=20)
    ap.add_argument("--no-idle", action="store_true", help="skip the push after 6 s idle")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "fleet.json")
    ap.add_argument("--report", type=pathlib.Path, help="print the tables of a saved run")
    ap.add_argument("--before", type=pathlib.Path, help="a run to compare the per-server cost with")
    args = ap.parse_args()
    before = json.loads(args.before.read_text()) if args.before else None
    if args.report:
        print(report(json.loads(args.report.read_text()), before))
        return
    data = run(args.sizes, args.workers, args.pushes, not args.no_idle)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(report(data, before))


if __name__ == "__main__":
    main()

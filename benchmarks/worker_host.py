"""The worker's host work per forward, without a model (issue 12): what the Python around a
forward costs when requests join and leave every few forwards.

    python benchmarks/worker_host.py                      # FDFO and sync at 16 and 64 running
    python benchmarks/worker_host.py --profile /tmp/wh    # + a cProfile of each setting
    python benchmarks/worker_host.py --count-ops          # + torch ops per forward
    python benchmarks/worker_host.py --running 16 --modes fdfo --mean-forwards 3 \
        --max-new-tokens 32 --prompts-per-slot 64 --radix-cache --pages-per-slot 1000 \
        --wavefront 2 --gated
        # the held-out problems' shape (~3 forwards a block, short answers), W = 2 as on CUDA,
        # a pool that never evicts (as a GPU's)
    python benchmarks/worker_host.py --messages ...     # + the messages through the wire codec
    python benchmarks/worker_host.py --phases ...       # + us a block of each worker phase

The scheduler and the worker run in one process (tests/local_engine.py's LocalEngine) on the CPU
(with --messages their messages go through the wire codec as between the processes, each side's
encoding and decoding in its own time; no sockets);
the model is a stand-in whose forward returns zero logits (a 16-token vocabulary) after applying
the worker's staged row writes (what a CUDA-graph forward needs from the host: its metadata is
computed on the device from the rows); the algorithm is benchmarks/scheduled_denoise.py's
ScheduledDenoise (each block takes a lognormal number of forwards, mean 12), 32-token blocks, 128
new tokens, 4 prompts per running slot. Reported per setting (the median of --repeats runs): worker
host ms per forward (time inside Worker.iterate over denoise forwards), the same without the
denoise items (applying the staged rows, the stand-in forward and the step, which a GPU runs inside
the forward's CUDA graph: the part of the worker's host work that a GPU host also does), scheduler
ms per forward, forwards, and per committed block the worker's host time without the denoise items
and the scheduler's (the host's work is mostly a cost per block, the same at W = 2 as at W = 1:
results/h200/runtime/README.md, session 17). On a GPU the forward runs asynchronously, so the
worker's host time is what must stay under one forward's device time. Also rows per forward and the
rows whose readout the worker refreshed (Worker._refresh): a machine-independent count of the
per-row host work. With --count-ops also the torch operator calls per forward inside
`ResidentBatch.layout` (the layout changes' row writes and views) and in the whole worker without
the denoise items: each costs tens of microseconds of host time on a GPU (a dispatch, often a
launch), a machine-independent count of that part of the host's work. With --phases also the
worker's and the scheduler's host us per committed block in each of their phases (`PHASES`: the
worker applying the scheduler's changes, joins, the layout patch, collecting a readout and
within it the flags, the refreshes and the retire / open pass, the report; the scheduler taking
a report and within it the cache inserts and finish checks, admitting), timed in --repeats
more runs (medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from local_engine import FakeRunner, LocalEngine  # noqa: E402

from benchmarks.common import write_json  # noqa: E402
from benchmarks.scheduled_denoise import ScheduledConfig, ScheduledDenoise  # noqa: E402
from dllm_serve.dllm.modes import RoundMode, WavefrontConfig  # noqa: E402
from dllm_serve.managers.finish import FinishChecker  # noqa: E402
from dllm_serve.managers.messages import (  # noqa: E402
    BatchOutput,
    ReqOutput,
    WorkerBatch,
    decode,
    encode,
)
from dllm_serve.managers.scheduler import Scheduler  # noqa: E402
from dllm_serve.managers.scheduler_config import SchedulerConfig  # noqa: E402
from dllm_serve.managers.worker import Worker  # noqa: E402
from dllm_serve.model.denoise_run import DenoiseRun  # noqa: E402

K, MASK, EOS, VOCAB = 32, 15, 14, 16


class MetaRunner(FakeRunner):
    """FakeRunner whose forward costs the host what the bucketed path's does: the staged row
    writes (the worker's hook); the forward's metadata is computed on the device from the rows
    (model/denoise_graphs.py), so the host writes none, and its logits are a static buffer's
    first rows (as DenoiseGraphs'), so preparing a layout allocates nothing."""

    def __init__(self, num_pages: int, page_size: int, max_requests: int, wavefront: int) -> None:
        super().__init__(K, num_pages, page_size, VOCAB)
        self.max_requests = self.scratch_slot = max_requests
        self.logits = torch.zeros(max_requests * wavefront * K, VOCAB)  # the worker's rows
        self.runs: dict[int, DenoiseRun] = {}

    def resident_run(self, n: int, block_ids: torch.Tensor) -> DenoiseRun:
        """As the GPU's bucketed forwards: one run per row count, reading no host list."""
        run = self.runs.get(n)
        if run is None:
            run = self.runs[n] = self.prepare_denoise([], [], [1] * n, block_ids)
        return run

    def prepare_denoise(self, slots: list[int], first_starts: list[int], num_blocks: list[int],
                        block_ids: torch.Tensor) -> DenoiseRun:
        t = block_ids.numel()

        def run() -> torch.Tensor:
            self.before()  # the worker's staged row writes
            return self.logits[:t]

        return DenoiseRun(run)


def engine(running: int, fdfo: bool, depth: int, wavefront: int = 1,
           mean_forwards: float = 12.0, radix: bool = False, gated: bool = False,
           pages_per_slot: int = 16) -> LocalEngine:
    pages = running * pages_per_slot
    cfg = SchedulerConfig(block_size=K, mask_id=MASK, fdfo=fdfo, max_running_requests=running,
                          max_queued_requests=None, chunked_prefill_size=4096, num_pages=pages,
                          page_size=K, wavefront_size=wavefront, radix_cache=radix)
    algo = ScheduledDenoise(ScheduledConfig(mean=mean_forwards), K, MASK)
    runner = MetaRunner(pages, K, running, wavefront + (gated and wavefront == 1))
    # W > 1: every masked position counts as ready, so each frontier spawns at once (the
    # wavefront's bookkeeping at its busiest)
    wf = WavefrontConfig(wavefront, token_threshold=0.0 if wavefront > 1 else None,
                         gated=gated and wavefront > 1, standby=gated and wavefront == 1)
    worker = Worker(runner, algo, RoundMode(fdfo, wf),  # type: ignore[arg-type]
                    report_every_s=0.0, max_prefill_tokens=4096, depth=depth)
    return LocalEngine(Scheduler(cfg, FinishChecker({EOS}, None)), worker)


def loaded(running: int, fdfo: bool, depth: int, per_slot: int, new_tokens: int,
           seed: int, wavefront: int = 1, mean_forwards: float = 12.0,
           radix: bool = False, gated: bool = False, pages_per_slot: int = 16,
           messages: bool = False) -> LocalEngine:
    e = engine(running, fdfo, depth, wavefront, mean_forwards, radix, gated, pages_per_slot)
    if messages:
        wire(e)
    rng = np.random.default_rng(seed)
    for i in range(running * per_slot):
        prompt = rng.integers(16, 64, size=int(rng.integers(40, 120)))
        e.submit(f"r{i}", prompt, max_new_tokens=new_tokens, ignore_eos=True, seed=i)
    return e


class OpCounter(TorchDispatchMode):
    """Counts torch operator calls per section: into `calls[section]` while `section` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.section: str | None = None
        self.calls: dict[str, int] = {"layout": 0, "worker": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.section is not None:
            self.calls[self.section] += 1
        return func(*args, **(kwargs or {}))

    def within(self, section: str | None, fn: Any) -> Any:
        """fn, its calls counted under `section` (None: not counted)."""

        def run(*args: Any) -> Any:
            outer, self.section = self.section, section
            try:
                return fn(*args)
            finally:
                self.section = outer

        return run


def op_counts(*args: Any) -> dict[str, float]:
    """Torch operator calls per forward over one whole run: inside ResidentBatch.layout, and
    in the whole Worker.iterate but its denoise items (what a GPU runs in the forward's graph;
    layout's included)."""
    e = loaded(*args)
    counter, w = OpCounter(), e.worker
    w.batch.layout = counter.within("layout", w.batch.layout)  # type: ignore[method-assign]
    w.iterate = counter.within("worker", w.iterate)  # type: ignore[method-assign]
    trace, uncounted = w._trace, counter.within(None, w._trace)

    def traced(kind: str, fn: Any, rows: int = 0) -> Any:
        return (uncounted if kind == "denoise" else trace)(kind, fn, rows)

    w._trace = traced  # type: ignore[method-assign]
    with counter:
        while e.step():
            pass
    forwards = max(1, sum(r.forwards for r in e.reports))
    calls = counter.calls
    return {"layout_ops_per_forward": calls["layout"] / forwards,
            "worker_ops_per_forward": (calls["worker"] + calls["layout"]) / forwards}


# the phases timed by --phases: (name, the object's path in the LocalEngine, method); the
# times are inclusive (the worker's collect holds its readout flags, refresh and advance; the
# scheduler's report holds its commits' cache inserts and finish checks, its admission the
# admitted requests' pages)
PHASES = (("changes", "worker", "apply_all"), ("join", "worker.flow", "join"),
          ("layout", "worker.batch", "layout"), ("collect", "worker", "collect"),
          ("readout flags", "worker", "_notable"), ("refresh", "worker", "_refresh"),
          ("advance", "worker.flow", "advance"), ("report", "worker.report", "take"),
          ("scheduler: report", "sched", "on_report"),
          ("scheduler: cache insert", "sched.pages", "cache"),
          ("scheduler: finish check", "sched.finish", "commit"),
          ("scheduler: admission", "sched", "schedule"),
          ("scheduler: admission pages", "sched.pages", "start"))


def phase_times(*args: Any) -> dict[str, dict[str, float]]:
    """Per committed block, the host us of each phase (PHASES) of the worker and the scheduler
    over one whole run, each method timed where it is called (a timer's own ~0.2 us a call
    included), and their calls per forward: where each process's time a block goes, without a
    profiler's distortion of Python calls."""
    e = loaded(*args)
    spent = {name: [0.0, 0] for name, _, _ in PHASES}
    for name, path, method in PHASES:
        owner = attrgetter(path)(e)
        setattr(owner, method, _timer(getattr(owner, method), spent[name]))
    with torch.inference_mode():  # as the worker process runs its loop (worker_main.py)
        while e.step():
            pass
    blocks = max(1, e.sched.stats["committed_blocks"])
    forwards = max(1, sum(r.forwards for r in e.reports))
    return {"phase_us_per_block": {n: 1e6 * t / blocks for n, (t, _) in spent.items()},
            "phase_calls_per_forward": {n: c / forwards for n, (_, c) in spent.items()}}


def _timer(fn: Any, into: list[Any]) -> Any:
    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into[0] += time.perf_counter() - t0
            into[1] += 1

    return timed


def wire(e: LocalEngine) -> None:
    """The processes' messages through the one codec (messages.encode / decode; not ZMQ's
    sockets), each side's share in its own time: the scheduler encodes its batch of changes and
    its outputs and decodes the worker's reports, the worker decodes the batch (and runs on the
    decoded items) and encodes its report."""
    sched, worker = e.sched, e.worker
    take_items, take_outputs = sched.take_worker_items, sched.take_outputs
    on_report, iterate = sched.on_report, worker.iterate
    batches: list[bytes | None] = []
    reports: list[bytes] = []

    def coded_take_items() -> list[Any]:
        items = take_items()
        batches.append(encode(WorkerBatch(items)) if items else None)  # as scheduler_main
        return items

    def coded_iterate(_: list[Any]) -> Any:
        batch = batches.pop()
        report = iterate(decode(batch).items if batch is not None else [])
        if report is not None:
            reports.append(encode(report))
        return report

    def coded_take_outputs() -> list[Any]:
        outputs = take_outputs()
        if reqs := [o for o in outputs if isinstance(o, ReqOutput)]:
            encode(BatchOutput(reqs))
        return outputs

    sched.take_worker_items = coded_take_items  # type: ignore[method-assign]
    sched.take_outputs = coded_take_outputs  # type: ignore[method-assign]
    sched.on_report = lambda _: on_report(decode(reports.pop()))  # type: ignore[method-assign]
    worker.iterate = coded_iterate  # type: ignore[method-assign]


def measure(running: int, fdfo: bool, depth: int, per_slot: int, new_tokens: int,
            seed: int, wavefront: int = 1, mean_forwards: float = 12.0,
            radix: bool = False, gated: bool = False,
            pages_per_slot: int = 16, messages: bool = False) -> dict[str, Any]:
    e = loaded(running, fdfo, depth, per_slot, new_tokens, seed, wavefront, mean_forwards,
               radix, gated, pages_per_slot, messages)
    sched_s = step_s = 0.0
    worker_t = [0.0, 0]  # the worker's time and iterations (_timer)
    trace = e.worker._trace

    def timed_trace(kind: str, fn: Any, rows: int = 0) -> Any:
        """The denoise item: what a GPU runs in its graph (the inbox, forward, step)."""
        nonlocal step_s
        t0 = time.perf_counter()
        try:
            return trace(kind, fn, rows)
        finally:
            if kind == "denoise":
                step_s += time.perf_counter() - t0

    refreshes = 0
    refresh = e.worker._refresh

    def counted_refresh(*args: Any) -> None:
        nonlocal refreshes
        refreshes += 1
        refresh(*args)

    e.worker.iterate = _timer(e.worker.iterate, worker_t)  # type: ignore[method-assign]
    e.worker._trace = timed_trace  # type: ignore[method-assign]
    e.worker._refresh = counted_refresh  # type: ignore[method-assign]
    t0 = time.perf_counter()
    steps = 0
    with torch.inference_mode():  # as the worker process runs its loop (worker_main.py)
        while e.step():
            steps += 1
    wall = time.perf_counter() - t0
    worker_s = worker_t[0]
    sched_s = wall - worker_s
    forwards = sum(r.forwards for r in e.reports)
    blocks = e.sched.stats["committed_blocks"]
    done = sum(1 for outs in e.outputs.values() if outs and outs[-1].finished)
    return {"running": running, "mode": "fdfo" if fdfo else "sync", "depth": depth,
            "wavefront": wavefront, "gated": gated,
            "requests": running * per_slot, "finished": done, "forwards": forwards,
            "worker_host_ms_per_forward": 1e3 * worker_s / max(forwards, 1),
            # without the denoise items (the staged rows applied, the stand-in forward, the
            # step: on a GPU all inside the forward's CUDA graph)
            "worker_host_ms_per_forward_without_step": 1e3 * (worker_s - step_s) / max(
                forwards, 1),
            "scheduler_ms_per_forward": 1e3 * sched_s / max(forwards, 1),
            # per committed block: the host's work is mostly a cost per block (a block's
            # admission, layout change, refreshes, retirement, commit), the same at W = 2 as
            # at W = 1, which takes more forwards for the same blocks
            "blocks": blocks,
            "worker_host_us_per_block_without_step": 1e6 * (worker_s - step_s) / max(blocks, 1),
            "scheduler_us_per_block": 1e6 * sched_s / max(blocks, 1),
            # machine-independent: rows a forward computes, and rows whose readout the
            # worker looked at (Worker._refresh)
            "rows_per_forward": sum(r.block_steps for r in e.reports) / max(forwards, 1),
            "refreshes_per_forward": refreshes / max(forwards, 1),
            "wall_s": wall}


TIMED = ("worker_host_ms_per_forward", "worker_host_ms_per_forward_without_step",
         "scheduler_ms_per_forward", "worker_host_us_per_block_without_step",
         "scheduler_us_per_block", "wall_s")


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: the first run's counts, each timed figure's median over the runs (the runs'
    values under `repeats`). The same seed each time: the runs do the same work."""
    row = dict(runs[0])
    if len(runs) > 1:
        row["repeats"] = {k: [r[k] for r in runs] for k in TIMED}
        for k in TIMED:
            row[k] = statistics.median(row["repeats"][k])
    return row


def setting(ns: argparse.Namespace, running: int, mode: str) -> dict[str, Any]:
    """One setting measured (under cProfile with --profile), its torch ops counted with
    --count-ops, printed."""
    args = (running, mode == "fdfo", ns.depth, ns.prompts_per_slot, ns.max_new_tokens, ns.seed,
            ns.wavefront, ns.mean_forwards, ns.radix_cache, ns.gated, ns.pages_per_slot,
            ns.messages)
    if ns.profile:
        import cProfile

        prof = cProfile.Profile()
        row = prof.runcall(measure, *args)
        prof.dump_stats(f"{ns.profile}.{mode}.{running}")
    else:
        row = median_of([measure(*args) for _ in range(ns.repeats)])
    ops = ""
    if ns.phases:  # the median of --repeats runs, phase by phase (a run may hold a pause)
        runs = [phase_times(*args) for _ in range(ns.repeats)]
        row.update({key: {n: statistics.median(r[key][n] for r in runs) for n in runs[0][key]}
                    for key in runs[0]})
        ops += "; us a block: " + ", ".join(f"{n} {v:.1f}"
                                            for n, v in row["phase_us_per_block"].items())
    if ns.count_ops:
        row.update(op_counts(*args))
        ops += (f", {row['layout_ops_per_forward']:.2f} torch ops per forward in layout(), "
               f"{row['worker_ops_per_forward']:.2f} in the worker without the step")
    print(f"{row['mode']:5s} running={running:3d} depth={ns.depth} W={ns.wavefront}: worker host "
          f"{row['worker_host_ms_per_forward']:.3f} ms/forward "
          f"({row['worker_host_ms_per_forward_without_step']:.3f} without the step), scheduler "
          f"{row['scheduler_ms_per_forward']:.3f} ms/forward; per block worker "
          f"{row['worker_host_us_per_block_without_step']:.1f} us without the step, scheduler "
          f"{row['scheduler_us_per_block']:.1f} us; {row['forwards']} forwards, "
          f"{row['rows_per_forward']:.1f} rows and {row['refreshes_per_forward']:.1f} "
          f"refreshed a forward, "
          f"{row['finished']}/{row['requests']} finished{ops}", flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--modes", nargs="+", default=["fdfo", "sync"], choices=["fdfo", "sync"])
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--wavefront", type=int, default=1,
                    help="W: most active blocks per request (W > 1: every frontier spawns)")
    ap.add_argument("--mean-forwards", type=float, default=12.0,
                    help="mean forwards per block (lognormal, clamped to 2..32)")
    ap.add_argument("--gated", action="store_true",
                    help="gated spawning (W > 1) / standby (W = 1)")
    ap.add_argument("--radix-cache", action="store_true",
                    help="the scheduler with the radix prefix cache on (as served by default)")
    ap.add_argument("--messages", action="store_true",
                    help="the scheduler's and the worker's messages through the wire codec, "
                         "as between the processes (encode / decode; no sockets)")
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    ap.add_argument("--pages-per-slot", type=int, default=16,
                    help="KV pages per running slot (the default fills the radix cache, which "
                         "then evicts on most admissions; 1000: a GPU's pool, no eviction)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per setting; the timed figures are their medians")
    ap.add_argument("--profile", help="write cProfile stats to PREFIX.<mode>.<running>")
    ap.add_argument("--count-ops", action="store_true",
                    help="also count torch operator calls per forward in layout() (a second run)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the worker's phases per committed block (in --repeats "
                         "more runs: their medians)")
    ap.add_argument("--out", help="JSON results")
    ns = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host path, as one worker thread runs it
    try:
        rows = [setting(ns, running, mode) for running in ns.running for mode in ns.modes]
    finally:
        torch.set_num_threads(threads)
    if ns.out:
        write_json(ns.out, {"benchmark": "worker_host", "config": vars(ns), "rows": rows})
    return rows


if __name__ == "__main__":
    main()

"""The scheduler and the worker in one process, without ZMQ: `LocalEngine.step()` is one loop
iteration of each (the scheduler's changes -> one worker iteration -> its report back). Also a
scripted algorithm and a model-free runner, for bookkeeping tests that need no model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dllm_serve.dllm.algorithms import ALGORITHMS, DllmAlgorithm, StepOutput, build_algorithm
from dllm_serve.dllm.algorithms.base import AlgorithmConfig, State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.modes import RoundMode, WavefrontConfig
from dllm_serve.engine_config import EngineConfig
from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.messages import GenerateReq, ReqOutput, WorkerReport, WorkItem
from dllm_serve.managers.scheduler import Scheduler
from dllm_serve.managers.scheduler_config import SchedulerConfig
from dllm_serve.managers.worker import Worker
from dllm_serve.model.denoise_run import DenoiseRun
from dllm_serve.model.runner import ModelRunner
from dllm_serve.sampling_params import SamplingParams
from dllm_serve.server_args import ServerArgs


class LocalEngine:
    def __init__(self, scheduler: Scheduler, worker: Worker) -> None:
        self.sched, self.worker = scheduler, worker
        self.outputs: dict[str, list[ReqOutput]] = {}
        self.reports: list[WorkerReport] = []
        self.sent: list[WorkItem] = []  # every change sent to the worker, in order

    def submit(self, rid: str, input_ids: list[int] | np.ndarray, **params: Any) -> None:
        self.sched.add_request(GenerateReq(rid, np.asarray(input_ids, dtype=np.int64),
                                           SamplingParams(**params), 0.0))

    @property
    def idle(self) -> bool:
        return self.sched.idle and self.worker.idle and not self.sched.to_worker

    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        if self.idle:
            self._collect()
            return False
        self.sched.schedule()
        items = self.sched.take_worker_items()
        self.sent += items
        report = self.worker.iterate(items)
        if report is not None:
            self.reports.append(report)
            self.sched.on_report(report)
        self._collect()
        return True

    def _collect(self) -> None:
        for out in self.sched.take_outputs():
            if isinstance(out, ReqOutput):
                self.outputs.setdefault(out.rid, []).append(out)

    def run(self, limit: int = 5000, check: bool = True) -> dict[str, list[ReqOutput]]:
        for _ in range(limit):
            if not self.step():
                return self.outputs
            if check:
                self.sched.check_integrity()
        raise AssertionError("the engine did not go idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_ids.tolist()]

    def assert_whole(self) -> dict[str, int]:
        """Idle: references add up, every page free or cached-evictable (nothing locked),
        nothing reserved, every slot free; returns the allocator's stats."""
        self.sched.check_integrity()
        s = self.sched.alloc.stats()
        assert s["free_pages"] + s["evictable_pages"] == s["total_pages"], s
        assert s["evictable_pages"] == s["cached_pages"], s
        assert s["reserved_pages"] == 0 and s["free_slots"] == s["total_slots"], s
        return s


def local_engine(model_dir: Path, algorithm: str, fdfo: bool, wavefront: int = 1,
                 mrr: int = 2, page_size: int | None = None, radix_cache: bool = True,
                 chunked_prefill_size: int = 32, max_total_tokens: int | None = None,
                 depth: int | None = None, multi_step: int = 1, device: str = "cpu",
                 **wavefront_kw: float | bool) -> LocalEngine:
    """The real model runner (CPU, fp32; on CUDA its defaults: Triton kernels, CUDA graphs)
    under a local scheduler + worker. On CUDA the KV pool holds 64k tokens unless
    max_total_tokens says otherwise: sized from free memory, a pool in the test process would
    stay reserved by its caching allocator and leave a later test's engine no room."""
    if device == "cuda" and max_total_tokens is None:
        max_total_tokens = 1 << 16
    args = ServerArgs(model_path=str(model_dir), device=device, dllm_algorithm=algorithm,
                      dllm_fdfo=fdfo, max_running_requests=mrr,
                      chunked_prefill_size=chunked_prefill_size, dllm_wavefront_size=wavefront,
                      page_size=page_size, disable_radix_cache=not radix_cache,
                      max_total_tokens=max_total_tokens)
    cfg = EngineConfig.resolve(args)
    wcfg = cfg.worker()
    mode = RoundMode(fdfo, WavefrontConfig(wavefront, **wavefront_kw))  # type: ignore[arg-type]
    runner = ModelRunner(wcfg.runner)
    worker = Worker(runner, build_algorithm(wcfg.dllm), mode, report_every_s=0.0,
                    max_prefill_tokens=wcfg.runner.chunked_prefill_size, depth=depth,
                    multi_step=multi_step)
    scfg = dataclasses.replace(cfg.scheduler().scheduler, num_pages=runner.num_pages,
                               page_size=runner.page_size)
    return LocalEngine(Scheduler(scfg, FinishChecker(set(), None)), worker)


# ---- without a model ----------------------------------------------------------------------


@dataclass(frozen=True)
class ScriptedConfig(AlgorithmConfig):
    fill: int = 7


@ALGORITHMS.register()
class ScriptedFill(DllmAlgorithm):
    """Fills every mask of a block with `fill` at once, on the step that makes the block take
    exactly need(block_start) forwards (>= 2), its final done-on-entry forward included."""

    Config = ScriptedConfig
    config: ScriptedConfig
    need: Callable[[int], int] = staticmethod(lambda start: 2)  # type: ignore[assignment]

    def step(self, batch: DenoiseBatch, full_logits: torch.Tensor,
             state: State | None) -> StepOutput:
        ids = batch.block_ids
        masked = ids == self.mask_id
        done = ~masked.any(1)
        due = torch.tensor([int(s) + 2 >= self.need(start) for s, start in
                            zip(batch.block_steps, batch.block_starts(), strict=True)])
        ids.copy_(torch.where(masked & due[:, None], self.config.fill, ids))
        return StepOutput(done, torch.ones(ids.shape))

    def converged(self, batch: DenoiseBatch, state: State | None) -> torch.Tensor:
        return ~(batch.block_ids == self.mask_id).any(1)


class FakeRunner:
    """A model runner without a model: logits are zeros; records what it was asked to do."""

    def __init__(self, block_size: int, num_pages: int, page_size: int, vocab: int = 16) -> None:
        self.block_size, self.page_size, self.num_pages = block_size, page_size, num_pages
        self.max_requests, self.graph_max_blocks = 64, 0
        self.scratch_slot = self.max_requests  # pad blocks and holes: their K/V goes nowhere
        self.bucketed = True  # as the GPU runner: holes in the device batch are kept
        self.device = torch.device("cpu")
        self.vocab = vocab
        self.graphs = None
        self.before: Any = None
        # ("prefill", slots, seg_starts, token lists) / ("forward", slots, first_starts, blocks)
        self.log: list[tuple[str, list[int], list[int], list[Any]]] = []
        self.mapped: dict[int, dict[int, int]] = {}  # slot -> entry -> page
        self.page_table = None  # no device page table: the worker maps pages here, at once

    def add_pages(self, slot: int, first: int, pages: np.ndarray) -> None:
        row = self.mapped.setdefault(slot, {})
        if first == 0:
            row.clear()
        row.update({first + i: int(p) for i, p in enumerate(pages)})

    def add_pages_many(self, writes: list[tuple[int, int, np.ndarray]]) -> None:
        for write in writes:
            self.add_pages(*write)

    def prefill(self, slots: list[int], seg_starts: list[int],
                token_ids: list[np.ndarray]) -> None:
        self.log.append(("prefill", list(slots), list(seg_starts), [t.tolist() for t in token_ids]))

    def warm_up(self, ids: Any = None, step: Any = None, width: int = 0,
                before: Any = None, rows: Any = None, replayed: Any = None,
                open_step: Any = None) -> None:
        self.before = before  # as the real runner: run first in every denoise forward

    def resident_run(self, n: int, block_ids: torch.Tensor) -> DenoiseRun | None:
        """None: every run is made from the layout's columns (the log records them)."""
        return None

    def prepare_denoise(self, slots: list[int], first_starts: list[int], num_blocks: list[int],
                        block_ids: torch.Tensor) -> DenoiseRun:
        entry = ("forward", list(slots), list(first_starts), list(num_blocks))

        def run() -> torch.Tensor:
            if self.before is not None:
                self.before()
            self.log.append(entry)
            return torch.zeros(block_ids.numel(), self.vocab)

        return DenoiseRun(run)


def scripted_engine(k: int = 4, mask: int = 15, eos: int = 14, fdfo: bool = True, mrr: int = 4,
                    pages: int = 64, queue: int | None = None, prefill: int = 64,
                    wavefront: int = 1, decode: Callable[[list[int]], str] | None = None,
                    fill: int = 7, need: Callable[[int], int] | None = None,
                    radix_cache: bool = True, page_size: int | None = None,
                    depth: int | None = None, multi_step: int = 1,
                    ahead: int = 0, gated: bool = False, standby: bool = False) -> LocalEngine:
    """ahead: requests the scheduler admits past mrr (the worker's batch holds mrr at most);
    gated / standby: WavefrontConfig's (the device opens a request's next block)."""
    cfg = SchedulerConfig(block_size=k, mask_id=mask, fdfo=fdfo, max_running_requests=mrr,
                          max_queued_requests=queue, chunked_prefill_size=prefill,
                          num_pages=pages, page_size=page_size or k, wavefront_size=wavefront,
                          radix_cache=radix_cache, admit_ahead=ahead)
    algo = ScriptedFill(ScriptedConfig(fill), k, mask)
    if need is not None:
        algo.need = need  # type: ignore[method-assign]
    runner = FakeRunner(k, pages, page_size or k)
    mode = RoundMode(fdfo, WavefrontConfig(wavefront, gated=gated, standby=standby))
    worker = Worker(runner, algo, mode,  # type: ignore[arg-type]
                    report_every_s=0.0, max_prefill_tokens=prefill, depth=depth,
                    multi_step=multi_step)
    worker.flow.max_requests = mrr  # the batch's limit (rows and slots: the fake runner's 64)
    return LocalEngine(Scheduler(cfg, FinishChecker({eos}, decode)), worker)

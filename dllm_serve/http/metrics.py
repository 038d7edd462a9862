"""Prometheus metrics of one server, in a private registry (no global state, no multiprocess dir).

Two sources:
- per request, observed in the HTTP process as updates arrive (one update per committed block):
  time to first block, end-to-end latency, inter-block gaps, per-token latency (each gap divided
  by the block's tokens, counted once per token, as SGLang weights multi-token steps), token
  counters, forwards per committed block;
- the scheduler's state, read at scrape time through the front's server_info(): running and
  queued requests, KV pages, and its round counters (denoise rounds, in-place re-loops, ...),
  and the radix prefix cache (cached pages, prompt tokens taken from it or computed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dllm_serve.http.bridge import Update

logger = logging.getLogger(__name__)

LABELS = ["model_name"]
TTFB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1200, 2400)
BLOCK_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TOKEN_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)
FORWARD_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64, 128)
# Scheduler counters exported at scrape time: stats key -> (metric name, help).
SCHEDULER_COUNTERS = {
    "prefill_rounds": ("dllm:prefill_rounds", "Prefill rounds run by the scheduler."),
    "inplace_reloops": ("dllm:inplace_reloops", "Extra forwards the worker ran in place inside a "
                        "denoise round because no block of the batch had finished (FDFO)."),
    "forwards": ("dllm:forwards", "Model forwards run (prefill and denoise)."),
    "committed_blocks": ("dllm:committed_blocks", "Generation blocks committed."),
    "kernel_compiles_after_ready": ("dllm:kernel_compiles_after_ready", "Triton kernels "
                                    "compiled after the worker was ready (each a serving stall "
                                    "the warm-up should have prevented; the worker logs which)."),
}
# Radix cache counters (server_info's radix_cache): key -> (metric name, help).
CACHE_COUNTERS = {
    "hit_tokens": ("dllm:cache_hit_tokens", "Prompt tokens whose KV came from the radix cache."),
    "miss_tokens": ("dllm:cache_miss_tokens", "Prompt tokens computed (not in the radix cache)."),
}


def held_pages(info: dict[str, Any]) -> int:
    """KV pages that requests hold, from the scheduler's info: in use and not free, less the
    prefix cache's pages that no request uses (free to evict: no load)."""
    kv = info["kv_pool"]
    return (kv["total_pages"] - kv["free_pages"]
            - info.get("radix_cache", {}).get("evictable_pages", 0))


class ServerMetrics:
    def __init__(self, model_name: str, info: Callable[[], dict[str, Any] | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.ttfb = self._histogram("dllm:time_to_first_block_seconds",
                                    "Time from arrival to the first committed block.", TTFB_BUCKETS)
        self.e2e = self._histogram("dllm:e2e_request_latency_seconds",
                                   "Time from arrival to the last output.", E2E_BUCKETS)
        self.inter_block = self._histogram("dllm:inter_block_latency_seconds",
                                           "Gap between consecutive committed blocks of a request.",
                                           BLOCK_BUCKETS)
        self.inter_token = self._histogram(
            "dllm:inter_token_latency_seconds", "Inter-block gap divided by the block's new "
            "tokens, observed once per token.", TOKEN_BUCKETS)
        self.block_forwards = self._histogram("dllm:forwards_per_block",
                                              "Forwards a committed block took (done step "
                                              "included).", FORWARD_BUCKETS)
        self.prompt_tokens = self._counter("dllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self._counter("dllm:generation_tokens", "Tokens generated.")
        self.requests = Counter("dllm:num_requests", "Finished requests by finish reason.",
                                [*LABELS, "finish_reason"], registry=self.registry)
        self.registry.register(SchedulerCollector(model_name, info))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, LABELS, buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, LABELS, registry=self.registry).labels(self.model_name)

    def observer(self) -> RequestObserver:
        """A fresh observer for one HTTP request; its clock starts now."""
        return RequestObserver(self)

    def render(self) -> bytes:
        """The Prometheus text exposition (blocks on the scheduler round trip)."""
        return generate_latest(self.registry)


class RequestObserver:
    """Records the updates of one HTTP request's choices (see bridge.Observer)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self.last: dict[int, float] = {}

    def on_update(self, update: Update) -> None:
        out, tokens = update.out, len(update.out.new_ids)
        if tokens:
            self._timing(update.index, update.at, tokens)
            self.m.generation_tokens.inc(tokens)
        if out.finished:
            self._finished(out.finish_reason or {}, out.meta, update.at)

    def _timing(self, index: int, at: float, tokens: int) -> None:
        previous = self.last.get(index)
        self.last[index] = at
        if previous is None:
            self.m.ttfb.observe(at - self.start)
            return
        gap = at - previous
        self.m.inter_block.observe(gap)
        for _ in range(tokens):
            self.m.inter_token.observe(gap / tokens)

    def _finished(self, reason: dict[str, Any], meta: dict[str, Any], at: float) -> None:
        self.m.requests.labels(self.m.model_name, reason.get("type", "unknown")).inc()
        if reason.get("status_code") is not None:
            return  # rejected or failed: nothing was processed for it
        self.m.e2e.observe(at - self.start)
        self.m.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        for forwards in meta.get("block_forwards", []):
            self.m.block_forwards.observe(forwards)


class SchedulerCollector(Collector):
    """Gauges and counters read from the scheduler's server_info at scrape time."""

    def __init__(self, model_name: str, info: Callable[[], dict[str, Any] | None]) -> None:
        self.model_name = model_name
        self.info = info

    def describe(self) -> list[Metric]:
        return []  # do not call the scheduler when registering

    def collect(self) -> Iterator[Metric]:
        info = self.info()
        if info is None:
            return
        kv, slots = info["kv_pool"], info["req_pool"]
        used_pages = held_pages(info)
        yield self._gauge("dllm:num_running_reqs", "Requests being denoised.",
                          info["num_running_reqs"])
        yield self._gauge("dllm:num_queue_reqs", "Requests waiting for admission.",
                          info["num_waiting_reqs"])
        yield self._gauge("dllm:kv_pages_used", "KV pages held by requests (cached pages "
                          "no request uses are free to evict and not counted).", used_pages)
        yield self._gauge("dllm:kv_pages_total", "KV pages in the pool.", kv["total_pages"])
        yield self._gauge("dllm:token_usage", "Fraction of KV pages in use.",
                          used_pages / max(1, kv["total_pages"]))
        yield self._gauge("dllm:req_slots_used", "Request slots in use.",
                          slots["total_slots"] - slots["free_slots"])
        yield from self._counters(info.get("stats", {}), bool(info.get("dllm_fdfo", True)))
        yield from self._cache(info.get("radix_cache", {}))

    def _counters(self, stats: dict[str, Any], fdfo: bool) -> Iterator[Metric]:
        if "rounds" in stats:
            rounds = CounterMetricFamily(
                "dllm:denoise_rounds", "Denoise rounds (mode=fdfo: a round ends as soon as "
                "one block finished; mode=sync: when all did).", labels=[*LABELS, "mode"])
            rounds.add_metric([self.model_name, "fdfo" if fdfo else "sync"],
                              stats["rounds"] - stats.get("prefill_rounds", 0))
            yield rounds
        for key, (name, doc) in SCHEDULER_COUNTERS.items():
            if key in stats:
                family = CounterMetricFamily(name, doc, labels=LABELS)
                family.add_metric([self.model_name], stats[key])
                yield family

    def _cache(self, cache: dict[str, Any]) -> Iterator[Metric]:
        if "cached_pages" in cache:
            yield self._gauge("dllm:cached_pages", "KV pages held by the radix prefix cache.",
                              cache["cached_pages"])
        for key, (name, doc) in CACHE_COUNTERS.items():
            if key in cache:
                family = CounterMetricFamily(name, doc, labels=LABELS)
                family.add_metric([self.model_name], cache[key])
                yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric([self.model_name], value)
        return family

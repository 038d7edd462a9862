"""`/health_generate`: healthy means the engine makes progress, judged as SGLang does.

- A dead child process or a failed engine: 503 at once.
- A busy engine (requests running or waiting): healthy once its forward counter
  (`stats.forwards` of the scheduler's info) moves past the value read when the probe arrived.
  Nothing is queued behind the running requests, so the answer comes within a round or two.
- An idle engine: a tiny generation (one prompt token, one new token, the algorithm's
  threshold at 0 where it has one, so the block is decided in its first forward) must finish.
Past HEALTH_TIMEOUT_S: 503.
"""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

from dllm_serve.errors import EngineDeadError
from dllm_serve.http.bridge import Choice, Generation
from dllm_serve.http.context import ServerContext
from dllm_serve.http.errors import APIError, unavailable
from dllm_serve.managers.tokenizer_manager import TokenizerManager
from dllm_serve.sampling_params import SamplingParams

HEALTH_TIMEOUT_S = 20.0
POLL_S = 0.05
DEAD = "The engine has died."


async def check_progress(ctx: ServerContext) -> None:
    """Return when the engine shows progress; raise a 503 APIError otherwise."""
    front = ctx.require_front()
    if front.dead is not None or front.procs.dead() is not None:
        raise unavailable(DEAD)
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    first = await _info(front, deadline)
    if first["num_running_reqs"] + first["num_waiting_reqs"] == 0:
        return await _tiny_generation(front, deadline)
    start = first["stats"]["forwards"]
    while (await _info(front, deadline))["stats"]["forwards"] == start:
        await asyncio.sleep(POLL_S)


async def _info(front: TokenizerManager, deadline: float) -> dict[str, Any]:
    left = deadline - time.monotonic()
    if left <= 0:
        raise unavailable("The engine made no progress in time.")
    try:
        return await asyncio.to_thread(front.server_info, left)
    except EngineDeadError:
        raise unavailable(DEAD) from None
    except queue.Empty:
        raise unavailable("The engine did not answer in time.") from None


async def _tiny_generation(front: TokenizerManager, deadline: float) -> None:
    fast = {"threshold": 0.0} if "threshold" in front.algorithm.request_params else {}
    params = SamplingParams(max_new_tokens=1, ignore_eos=True, dllm=fast)
    gen = Generation(front, [Choice([0], params, f"HEALTH_CHECK_{time.time_ns()}")])
    try:
        await asyncio.wait_for(gen.finals(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise unavailable("The engine did not finish a health check in time.") from None
    except APIError as e:
        if e.status >= 500:
            raise unavailable(DEAD) from None
        # a 503 "queue full" or 400 proves the scheduler alive

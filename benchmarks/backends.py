"""Where a benchmark's prompts go: an in-process `dllm_serve.Engine` or a running server's
OpenAI completions API. Both keep `parallel` requests in flight and answer with the same records,
in prompt order.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from benchmarks.common import now


@dataclass
class Completion:
    """One prompt's answer. block_forwards (forwards each committed block needed) and
    denoise_steps (denoise forwards the request sat in) are None where the backend cannot see
    them."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    latency: float
    block_forwards: list[int] | None = None
    denoise_steps: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class GenParams:
    max_tokens: int
    stop: list[str]
    temperature: float = 0.0


def run_parallel(call: Callable[[str], Completion], prompts: list[str], parallel: int,
                 desc: str) -> list[Completion]:
    """call(prompt) for every prompt, `parallel` at a time, with a progress bar."""
    out: list[Completion | None] = [None] * len(prompts)
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {pool.submit(call, p): i for i, p in enumerate(prompts)}
        for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, unit="req"):
            out[futures[fut]] = fut.result()
    return [c for c in out if c is not None]


def engine_call(engine: Any, params: GenParams) -> Callable[[str], Completion]:
    from dllm_serve.errors import RequestError

    sampling = {"max_new_tokens": params.max_tokens, "temperature": params.temperature,
                "stop": params.stop}

    def call(prompt: str) -> Completion:
        t0 = now()
        try:
            out = engine.generate(prompt, sampling)
        except RequestError as e:
            return Completion("", 0, 0, now() - t0, error=str(e))
        meta = out["meta_info"]
        return Completion(out["text"], meta["prompt_tokens"], meta["completion_tokens"],
                          now() - t0, list(meta["block_forwards"]), meta.get("denoise_steps"))

    return call


def openai_call(client: Any, model: str, params: GenParams) -> Callable[[str], Completion]:
    import openai

    def call(prompt: str) -> Completion:
        t0 = now()
        try:
            r = client.completions.create(model=model, prompt=prompt,
                                          max_tokens=params.max_tokens,
                                          temperature=params.temperature, stop=params.stop)
        except openai.APIError as e:
            return Completion("", 0, 0, now() - t0, error=f"{type(e).__name__}: {e}")
        usage = r.usage
        return Completion(r.choices[0].text, usage.prompt_tokens if usage else 0,
                          usage.completion_tokens if usage else 0, now() - t0)

    return call

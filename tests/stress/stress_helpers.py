"""What the stress tests share: the short/long switch, the run report, metric counters, the
engine's child processes, and checks of well-formed answers (OpenAI error JSON, SSE streams).

Short forms run in the normal test command; `DLLM_SERVE_STRESS=long` selects the long forms.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeVar

import httpx
import psutil
from http_helpers import Server
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

LONG = os.environ.get("DLLM_SERVE_STRESS", "short") == "long"
SEED = int(os.environ.get("DLLM_SERVE_STRESS_SEED", "0"))
# Engine flags the soak's server gets on top of its own (a scheduling mode to soak, e.g.
# "--dllm-gated-spawn" or "--dllm-standby --dllm-wavefront-size 1"), split on white space.
EXTRA_FLAGS = tuple(os.environ.get("DLLM_SERVE_STRESS_FLAGS", "").split())
REPORT: list[str] = []  # one line per test, printed in the session summary
# Server log lines that must never appear (a bug, a leak, an unanswered request).
BAD_LOG_LINES = ("Traceback", "memory leak", "Exception in ASGI", "internal error",
                 "without completing response", "without starting response")


def scale(short: T, long: T) -> T:
    """The short (CI) or the long (DLLM_SERVE_STRESS=long) value of a knob."""
    return long if LONG else short


def report(line: str) -> None:
    """Record a measured result; the session summary prints every line."""
    REPORT.append(line)
    print(line)


# ---- metrics ---------------------------------------------------------------------------------


def counters(server: Server) -> dict[str, float]:
    """Every counter and histogram count of /metrics, as `name{label=value,...}` -> value."""
    text = server.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_total", "_count")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# ---- processes -------------------------------------------------------------------------------


def engine_children(server: Server) -> dict[str, psutil.Process]:
    """The scheduler and worker processes of a server, told apart by the ipc socket each binds
    (the scheduler: to_scheduler, the worker: to_worker)."""
    found: dict[str, psutil.Process] = {}
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        paths = {os.path.basename(c.laddr) for c in child.net_connections(kind="unix")
                 if c.laddr}
        for name in ("scheduler", "worker"):
            if f"to_{name}" in paths:
                found[name] = child
    assert set(found) == {"scheduler", "worker"}, found
    return found


def assert_clean_log(server: Server, since: int = 0) -> None:
    """No traceback, leak or unanswered request in the server log after byte `since`."""
    text = server.log_text()[since:]
    bad = [line for line in text.splitlines() if any(b in line for b in BAD_LOG_LINES)]
    assert not bad, "\n".join(bad[:20])


# ---- answers ---------------------------------------------------------------------------------


def assert_openai_error(r: httpx.Response) -> dict[str, Any]:
    """A 4xx/5xx answer must be OpenAI's error JSON; returns its `error` object."""
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    return assert_error_object(r.json())


def assert_error_object(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


def sse_payloads(text: str) -> list[Any]:
    """The JSON payloads of a complete SSE body, checked: `data: ` frames only, each followed
    by a blank line, the last one `[DONE]` (dropped from the result)."""
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    frames = text.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", frames[-3:]
    out = []
    for frame in frames[:-2]:
        assert frame.startswith("data: ") and "\n" not in frame, frame[:200]
        out.append(json.loads(frame[len("data: "):]))
    return out


def check_openai_answer(answer: dict[str, Any], n: int, chat: bool) -> tuple[list[str], list[str]]:
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    assert answer["id"] and isinstance(answer["created"], int) and answer["model"] == "tiny"
    choices = answer["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    reasons = [c["finish_reason"] for c in choices]
    assert set(reasons) <= {"stop", "length"}, reasons
    if chat:
        assert all(c["message"]["role"] == "assistant" for c in choices)
        return [c["message"]["content"] for c in choices], reasons
    return [c["text"] for c in choices], reasons


def check_openai_chunks(events: list[Any], n: int, chat: bool) -> tuple[list[str], list[str]]:
    """One id/created throughout, a role first (chat), exactly one finish_reason per choice and
    nothing after it, then the usage chunk (choices: [])."""
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] is not None
    assert len({(c["id"], c["created"]) for c in events}) == 1
    texts, reasons, started = [""] * n, [""] * n, set()
    for c in chunks:
        assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        (choice,) = c["choices"]
        i = choice["index"]
        assert not reasons[i], "a chunk after the finish_reason"
        if chat:
            assert ("role" in choice["delta"]) == (i not in started), choice
            texts[i] += choice["delta"].get("content") or ""
        else:
            texts[i] += choice["text"]
        reasons[i] = choice["finish_reason"] or ""
        started.add(i)
    assert set(reasons) <= {"stop", "length"}, reasons
    return texts, reasons


def check_generate_stream(events: list[Any]) -> dict[str, Any]:
    """Cumulative text and ids; only the last event is finished; returns it."""
    assert events, "an empty stream"
    for a, b in zip(events, events[1:], strict=False):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    return events[-1]


def check_generate_final(final: dict[str, Any], prompt_len: int, params: dict[str, Any]) -> None:
    meta = final["meta_info"]
    assert meta["prompt_tokens"] == prompt_len
    assert meta["completion_tokens"] == len(final["output_ids"]) <= params["max_new_tokens"]
    if meta["finish_reason"]["type"] == "length":
        assert meta["completion_tokens"] == params["max_new_tokens"]
    assert not any(s in final["text"] for s in params.get("stop", []))

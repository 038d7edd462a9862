"""A failure inside one request fails that request alone (issue 13): non-finite logits, a step
that raises, a block that never converges. The other requests complete, the pools end whole,
the engine stays up."""

from __future__ import annotations

from pathlib import Path

import pytest
from faulty_algorithms import LATE_NAN_SEED, NAN_SEED, RAISE_SEED, STUCK_SEED
from test_engine import assert_pools_whole

from dllm_serve import Engine


@pytest.mark.parametrize(("algorithm", "seed", "message"), [
    ("Poisoned", NAN_SEED, "non-finite logits"),
    ("Raising", RAISE_SEED, "raised an error"),
    ("Stuck", STUCK_SEED, "did not converge"),
])
@pytest.mark.parametrize("fdfo", [True, False])
def test_one_bad_request_fails_alone(tiny_model_dir: Path, algorithm: str, seed: int,
                                     message: str, fdfo: bool) -> None:
    with Engine(model_path=str(tiny_model_dir), device="cpu", log_level="error",
                dllm_algorithm=f"faulty_algorithms:{algorithm}", dllm_fdfo=fdfo,
                max_running_requests=8) as engine:
        params = [{"max_new_tokens": 48, "ignore_eos": True, "seed": s}
                  for s in [1, 2, 3, seed, 4, 5, 6, 7]]
        outs = engine.generate([f"prompt {i}" for i in range(8)], params)
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        bad = reasons.pop(3)
        assert bad["type"] == "error" and message in bad["message"], bad
        assert bad["status_code"] == 500
        assert all(r["type"] == "length" for r in reasons), reasons
        assert all(o["meta_info"]["completion_tokens"] == 48 for i, o in enumerate(outs)
                   if i != 3)
        assert_pools_whole(engine)
        again = engine.generate("still up", {"max_new_tokens": 8, "ignore_eos": True})
        assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_over_http_the_bad_request_gets_a_500_and_the_others_200(tiny_model_dir: Path) -> None:
    """Through the real server: the poisoned request gets a short 500 naming its request id
    (no traceback); a stream that fails after its first block gets an error event then
    [DONE]; the others complete; the server stays healthy with its pools whole."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from http_helpers import REPO, pools_whole, sse_events, start_server

    server = start_server(tiny_model_dir, "--dllm-algorithm", "faulty_algorithms:Poisoned",
                          env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    try:
        body = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            good = [pool.submit(server.post, "/v1/completions", {**body, "seed": s})
                    for s in (1, 2, 3)]
            bad = pool.submit(server.post, "/v1/completions", {**body, "seed": NAN_SEED})
        assert [f.result().status_code for f in good] == [200, 200, 200]
        r = bad.result()
        err = r.json()["error"]
        assert r.status_code == 500 and "request id" in err["message"], err
        assert "Traceback" not in r.text and ".py" not in r.text
        late = {**body, "max_tokens": 120, "seed": LATE_NAN_SEED, "stream": True}
        with httpx.stream("POST", server.url("/v1/completions"), timeout=120, json=late) as s:
            events = sse_events(s.iter_lines())
        assert events[0]["choices"][0]["text"], events[0]  # a block streamed first
        assert events[-1] == "[DONE]" and "request id" in events[-2]["error"]["message"]
        assert server.get("/health").status_code == 200
        pools_whole(server)
    finally:
        server.stop()

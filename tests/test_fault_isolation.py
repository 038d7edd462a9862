"""A failure inside one request fails that request alone (issue 13): non-finite logits, a step
that raises, a block that never converges. The other requests complete, the pools end whole,
the engine stays up."""

from __future__ import annotations

from pathlib import Path

import pytest
from faulty_algorithms import NAN_SEED, RAISE_SEED, STUCK_SEED
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

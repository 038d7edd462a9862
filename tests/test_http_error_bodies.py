"""5xx bodies: a short message with the request id; the details go to the log only."""

from __future__ import annotations

import logging

import pytest

from dllm_serve.errors import EngineDeadError, RequestError
from dllm_serve.http.errors import APIError, as_api_error, from_finish_reason

TRACE = 'Traceback (most recent call last):\n  File "/srv/dllm_serve/worker.py", line 9'


@pytest.mark.parametrize("exc", [
    EngineDeadError(f"the engine failed:\n{TRACE}"), RuntimeError(TRACE),
    from_finish_reason({"type": "abort", "status_code": 500, "message": TRACE}),
    from_finish_reason({"type": "error", "status_code": 500, "message": TRACE}),
])
def test_5xx_carries_the_request_id_and_no_internals(exc: BaseException,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        err = as_api_error(exc, "req-abc")
    assert err.status == 500 and err.message.endswith("(request id req-abc)")
    assert not any(w in err.message for w in ("Traceback", "File ", ".py", "\n"))
    assert "req-abc" in caplog.text and "worker.py" in caplog.text  # the log has the details


def test_a_request_that_failed_alone_says_so() -> None:
    err = as_api_error(from_finish_reason({"type": "error", "status_code": 500,
                                           "message": "non-finite logits"}), "r1")
    assert "this request" in err.message and "died" not in err.message


def test_4xx_keep_their_message() -> None:
    assert as_api_error(RequestError("bad top_k", param="top_k"), "r").message == "bad top_k"
    queue = from_finish_reason({"type": "abort", "status_code": 503, "message": "queue full"})
    assert isinstance(queue, APIError) and queue.status == 503
    assert as_api_error(queue, "r").message.startswith("queue full")

"""The built-in default model: shipped in the package, served by `dllm-serve` with no
arguments on a CPU, answering a GSM8K-style question with the right number."""

from __future__ import annotations

import re
import subprocess
import sys

from http_helpers import REPO, Server, _log_dir, _stop_with_tests, _wait_healthy

from dllm_serve.default_model import PACKAGED, default_model_path

TOM = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


def last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None


def test_default_model_is_the_packaged_checkpoint() -> None:
    assert (PACKAGED / "config.json").is_file() and (PACKAGED / "model.safetensors").is_file()
    assert default_model_path() == PACKAGED


def test_dllm_serve_with_no_arguments_answers_the_apples_question() -> None:
    import tempfile
    from pathlib import Path

    log = Path(tempfile.mkstemp(prefix="default-", suffix=".log", dir=_log_dir())[1])
    proc = subprocess.Popen([sys.executable, "-m", "dllm_serve"], cwd=REPO,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            preexec_fn=_stop_with_tests)
    server = Server(proc, "http://127.0.0.1:30000", log)
    try:
        _wait_healthy(server, timeout=180)
        body = {"model": "default", "prompt": TOM, "max_tokens": 64, "temperature": 0}
        out = server.post("/v1/completions", body).json()
        text = out["choices"][0]["text"]
        assert last_integer(text) == 8, text
        assert text.rstrip().endswith("8."), text
        assert out["choices"][0]["finish_reason"] == "stop"
    finally:
        assert server.stop() == 0

"""A minimal OpenAI-completions front over a real `dllm_serve.Engine`, for the benchmark tests.

Stand-in for the HTTP server while it is being built: `/v1/models`, `/get_server_info`, and
`/v1/completions` (non-streamed, and streamed as SSE with one chunk per committed block and a
usage chunk when `stream_options.include_usage` is set), on a thread of the test process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _params(body: dict[str, Any]) -> dict[str, Any]:
    return {"max_new_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 0),
            "stop": body.get("stop") or [], "ignore_eos": body.get("ignore_eos", False)}


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    p = body["prompt"]
    return {"input_ids": p} if isinstance(p, list) else {"prompt": p}


def _usage(meta: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}


def _handler(engine: Any) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send_json(self, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _event(self, obj: Any) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send_json({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            else:
                self._send_json(engine.get_server_info())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not body.get("stream"):
                out = engine.generate(**_prompt(body), sampling_params=_params(body))
                reason = out["meta_info"]["finish_reason"]["type"]
                self._send_json({"object": "text_completion", "model": "tiny", "choices": [
                    {"index": 0, "text": out["text"], "finish_reason": reason}],
                    "usage": _usage(out["meta_info"])})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            meta: dict[str, Any] = {}
            for part in engine.generate(**_prompt(body), sampling_params=_params(body),
                                        stream=True):
                meta = part["meta_info"]
                reason = meta["finish_reason"]["type"] if meta["finish_reason"] else None
                self._event({"object": "text_completion", "choices": [
                    {"index": 0, "text": part["text"], "finish_reason": reason}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({"object": "text_completion", "choices": [], "usage": _usage(meta)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


@contextmanager
def serve(engine: Any) -> Iterator[str]:
    """Serve `engine` on a free local port; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(engine))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()

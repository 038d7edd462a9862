"""`ServerContext`: what every route needs (args, model name, front, metrics, lifecycle)."""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllm_serve.engine_config import EngineConfig
from dllm_serve.errors import EngineDeadError
from dllm_serve.http.errors import APIError, EngineFailed, unavailable
from dllm_serve.http.lifecycle import NOT_READY_MESSAGES, Lifecycle
from dllm_serve.http.metrics import ServerMetrics
from dllm_serve.managers.messages import FlushCacheResp
from dllm_serve.managers.tokenizer_manager import TokenizerManager
from dllm_serve.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "default"  # SGLang's default `model`; always accepted
# sglang-router's `model` for a request that names none (it fills the field in): no name given
ROUTER_NO_MODEL = "unknown"
INFO_TIMEOUT_S = 10.0


@dataclass
class ServerContext:
    args: ServerArgs  # model_path resolved (never None)
    model_name: str
    context_length: int
    life: Lifecycle
    metrics: ServerMetrics | None = None
    front: TokenizerManager | None = None
    architecture: str = ""
    config: EngineConfig | None = None

    @staticmethod
    def create(config: EngineConfig) -> ServerContext:
        """config: the engine's configuration, resolved once (the front reuses it)."""
        args = config.args
        name = args.served_model_name or Path(str(args.model_path)).resolve().name or str(
            args.model_path)  # "--model-path ." names the folder
        ctx = ServerContext(args, name, config.context_length, Lifecycle(args.shutdown_timeout),
                            architecture=config.model.architecture, config=config)
        if args.enable_metrics:
            ctx.metrics = ServerMetrics(name, ctx.scheduler_info_or_none)
        return ctx

    def require_front(self) -> TokenizerManager:
        if self.front is None:
            raise unavailable(NOT_READY_MESSAGES[self.life.phase])
        return self.front

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent, "default", sglang-router's "unknown" (a request that
        named none), the served name or the --model-path as given (vLLM's and SGLang's
        default name)."""
        path = str(self.args.model_path).rstrip("/")
        if model not in (None, DEFAULT_MODEL_ALIAS, ROUTER_NO_MODEL, self.model_name) and (
                model.rstrip("/") != path):
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'.", param="model", code="model_not_found")

    def scheduler_info(self) -> dict[str, Any]:
        """The front's server_info (scheduler state, kv_pool, req_pool); blocking."""
        try:
            return self.require_front().server_info(timeout=INFO_TIMEOUT_S)
        except EngineDeadError as e:
            raise EngineFailed(str(e)) from None
        except queue.Empty:
            raise unavailable("The scheduler did not answer in time.") from None

    def flush_cache(self) -> FlushCacheResp:
        """Ask the scheduler to empty its prefix cache; blocking."""
        try:
            return self.require_front().flush_cache(timeout=INFO_TIMEOUT_S)
        except EngineDeadError as e:
            raise EngineFailed(str(e)) from None
        except queue.Empty:
            raise unavailable("The scheduler did not answer in time.") from None

    def scheduler_info_or_none(self) -> dict[str, Any] | None:
        try:
            return self.scheduler_info()
        except APIError as e:
            logger.debug("no scheduler metrics: %s", e.message)
            return None

    def server_info(self) -> dict[str, Any]:
        """GET /server_info: the server args (API key hidden), the scheduler's state, and
        SGLang's `internal_states` (one entry per data-parallel rank: the scheduler's)."""
        from dllm_serve import __version__

        args = dict(self.args.__dict__)
        if args.get("api_key") is not None:
            args["api_key"] = "<hidden>"
        args["tokenizer_path"] = args["tokenizer_path"] or str(args["model_path"])  # as used
        scheduler = self.scheduler_info()
        rank = {**scheduler,  # what SGLang's clients read from a data-parallel rank
                "effective_max_running_requests_per_dp": self.args.max_running_requests}
        return {**args, "served_model_name": self.model_name, "dp_size": 1,
                "context_length": self.context_length, "version": __version__, **scheduler,
                "internal_states": [rank]}

    def model_info(self) -> dict[str, Any]:
        """GET /model_info (SGLang's keys)."""
        assert self.args.model_path is not None
        return {"model_path": self.args.model_path, "served_model_name": self.model_name,
                "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
                "is_generation": True, "context_length": self.context_length,
                "preferred_sampling_params": None, "weight_version": "default",
                "architectures": [self.architecture]}

"""dllm-serve: a serving engine for block-diffusion language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dllm_serve.engine import Engine
    from dllm_serve.server_args import ServerArgs


def __getattr__(name: str) -> Any:
    # Lazy, so that `import dllm_serve` (e.g. for the CLI's --help) does not import torch.
    if name == "Engine":
        from dllm_serve.engine import Engine

        return Engine
    if name == "ServerArgs":
        from dllm_serve.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)


__all__ = ["Engine", "ServerArgs", "__version__"]

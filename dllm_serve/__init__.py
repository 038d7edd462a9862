"""dllm-serve: a serving engine for block-diffusion language models."""

__version__ = "0.1.0"

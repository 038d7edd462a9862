"""`ServerArgs`: every flag of `dllm-serve` and every keyword of `dllm_serve.Engine`, in one place.

The CLI is generated from the fields below (name, default and `help` metadata), so a flag exists
exactly when a field does. Values are checked in `__post_init__`; a bad value raises
`ValueError` with a message meant for the user (the CLI prints it as one line and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# The backends' registry names (layers.attention.ATTENTION_BACKENDS, layers.moe.MOE_BACKENDS:
# torch-importing modules the front never loads; tests/test_http_cli.py keeps them equal)
ATTENTION_BACKEND_NAMES = ("auto", "torch", "triton")
MOE_BACKEND_NAMES = ("auto", "dense", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
LOG_LEVELS = ("debug", "info", "warning", "error")


# the worker's pacing knobs (--dllm-pipeline-depth, --dllm-multi-step; managers/pacing.py)
PACING = ("1", "2", "auto")


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _f(
        None, "Checkpoint folder (config.json, *.safetensors, tokenizer files). "
        "Default: the built-in small model.")
    tokenizer_path: str | None = _f(None, "Tokenizer folder; default: --model-path.")
    served_model_name: str | None = _f(
        None, "Model id shown by /v1/models and accepted in requests; default: the folder name.")
    host: str = _f("127.0.0.1", "HTTP host to bind.")
    port: int = _f(30000, "HTTP port to bind.")
    dllm_algorithm: str = _f(
        "LowConfidence", "Decoding algorithm, by class name (LowConfidence, JointThreshold, ...).")
    dllm_algorithm_config: str | None = _f(
        None, "YAML file with the algorithm's settings (see configs/algorithms/).")
    dllm_fdfo: bool = _f(
        True, "First-done-first-out scheduling: a finished block leaves the batch at once and a "
        "new one takes its place. --no-dllm-fdfo runs every batch until all its blocks are done.",
        boolean=True)
    dllm_wavefront_size: int = _f(
        2, "FlowBlock wavefront: most blocks per request denoised at once (1 = block by block).")
    dllm_pipeline_depth: str = _f(
        "auto", "Forwards the worker keeps queued on the GPU while it reads the oldest back: 1, "
        "2, or auto (2 while the host's work takes most of each forward, its wait for a "
        "readout under 0.25 ms, as with a small model and many requests, and blocks take 16 "
        "forwards or more; 1 once it waits over 1 ms; 1 on the CPU). With 2 a finished block "
        "takes one extra, no-op forward.",
        choices=PACING)
    dllm_multi_step: str = _f(
        "1", "Forwards the worker launches over one batch layout per pass of its bookkeeping "
        "(as vLLM's multi-step scheduling): 1, 2, or auto (2 while the host is the bottleneck, "
        "1 when the device is; 1 on the CPU). With 2 a block that finishes inside a pass leaves "
        "after it (at most one extra, no-op forward) and new blocks join at the next pass.",
        choices=PACING)
    dllm_spawn_threshold: float = _f(
        0.6, "Wavefront: open the next block when this share of the frontier block's masked "
        "positions is confident.")
    dllm_spawn_token_threshold: float | None = _f(
        None, "Wavefront: confidence a masked position needs to count as ready "
        "(default: the algorithm's threshold).")
    dllm_gated_spawn: bool | None = _f(
        None, "Wavefront: the next block waits ahead in the batch, in a row of its own, and the "
        "GPU opens it in the first step after its frontier is ready (no round trip through the "
        "host: fewer forwards per request, more rows per forward). Off: the host opens it once "
        "it has read the readiness back. Default: on on CUDA (the host reads each step back a "
        "forward or two after launching the next), off on the CPU (it reads each step before "
        "the next: a block placed ahead would only cost rows).", boolean=True)
    dllm_gate_arm_forwards: float = _f(
        6.0, "With --dllm-gated-spawn or --dllm-standby: place blocks ahead only while the "
        "blocks retired lately took at most this many forwards on average (a waiting row costs "
        "a row of every forward it waits and saves one forward); past it blocks open as without "
        "gating. inf: always.")
    dllm_standby: bool = _f(
        False, "Block by block (--dllm-wavefront-size 1) with FDFO: each request's next block "
        "waits in a row of its own and the GPU starts it in its predecessor's final forward "
        "(one forward less per block; twice the rows a forward).", boolean=True)
    dllm_wavefront_lockstep: bool = _f(
        False, "Baseline for benchmarks: every request opens and retires blocks together "
        "(needs --no-dllm-fdfo).", boolean=True)
    max_running_requests: int = _f(16, "Most requests denoised together in one batch.")
    dllm_admit_ahead: int | None = _f(
        None, "Requests admitted past --max-running-requests (slot, KV pages, prefill) that "
        "wait on the worker and join its batch in the forward after a request leaves it, "
        "without a round trip through the scheduler; they count as queued (--max-queued-requests "
        "bounds them with the queue). Default: --max-running-requests (short requests leave a "
        "slot every forward or two, and the round trip takes several forwards).")
    max_queued_requests: int | None = _f(
        None, "Most requests waiting for admission; more are rejected with 503. Default: no limit.")
    max_total_tokens: int | None = _f(
        None, "KV pool size in tokens. Default: from --mem-fraction-static on a GPU, "
        "max_running_requests x context length (capped at 262144) on a CPU.")
    page_size: int | None = _f(
        None, "KV page size in tokens; a multiple of the model's block size. Default: block size.")
    context_length: int | None = _f(
        None, "Longest prompt + output in tokens. Default: the model's max_position_embeddings; a "
        "longer value needs DLLM_SERVE_ALLOW_LONGER_CONTEXT_LEN=1.")
    chunked_prefill_size: int = _f(
        4096, "Most prompt tokens prefilled in one forward (rounded down to whole blocks).")
    disable_radix_cache: bool = _f(
        False, "Turn off the radix prefix cache. By default requests share the KV pages of a "
        "common prompt prefix (whole pages of committed blocks: few-shot examples, system "
        "prompts, earlier chat turns) and prefill only the rest; unused cached pages are "
        "evicted, least recently used first, when the pool runs short.", boolean=True)
    device: str = _f("auto", "cpu, cuda or auto (cuda when available).", choices=DEVICES)
    dtype: str = _f(
        "auto", "Weight and activation dtype; auto = bfloat16 on cuda, float32 on cpu.",
        choices=DTYPES)
    mem_fraction_static: float = _f(
        0.85, "GPU only: fraction of GPU memory for weights + KV pool.")
    attention_backend: str = _f(
        "auto", "Attention implementation: auto (triton on CUDA, torch on the CPU), torch (the "
        "reference) or triton (the block-diffusion paged attention kernel, with fused RMSNorm, "
        "q/k norm + RoPE and KV store kernels; CUDA).", choices=ATTENTION_BACKEND_NAMES)
    moe_backend: str = _f(
        "auto", "MoE experts implementation: auto (triton on CUDA, torch on the CPU), torch (the "
        "reference), dense (every expert over every token, no host sync: the training path) or "
        "triton (device routing, expert-sorted grouped GEMMs; CUDA).", choices=MOE_BACKEND_NAMES)
    disable_cuda_graph: bool = _f(
        False, "Run forwards eagerly. By default, on CUDA with the triton attention and MoE "
        "backends, each prefill and denoise forward replays a CUDA graph captured at startup "
        "for its size bucket. With the triton attention backend every forward is padded to its "
        "bucket and every bucket's kernels are compiled before the server is ready, graphs or "
        "not.", boolean=True)
    cuda_graph_max_bs: int | None = _f(
        None, "Largest denoise batch, in active blocks, replayed from a CUDA graph (larger ones "
        "run eagerly, padded to their bucket). Default: max_running_requests x "
        "dllm_wavefront_size, at most 256.")
    load_format: str = _f(
        "auto", "auto: read the checkpoint's *.safetensors; dummy: random weights built from "
        "config.json alone (speed tests at real shapes without the weights on disk).",
        choices=LOAD_FORMATS)
    random_seed: int = _f(0, "Seed for weights-independent randomness (sampling noise).")
    api_key: str | None = _f(
        None, "If set, every HTTP route but /health, /health_generate, /ready and /metrics "
        "needs 'Authorization: Bearer KEY'.")
    log_level: str = _f("info", "Logging level.", choices=LOG_LEVELS)
    gc_warning_threshold_secs: float = _f(
        0.0, "Log a warning whenever one cyclic garbage collection pauses the scheduler, the "
        "worker or the HTTP front longer than this many seconds (SGLang's flag; 0: off). Each "
        "process moves its startup objects out of the collector's reach, so pauses are short.")
    startup_timeout: float = _f(600.0, "Seconds to wait for the model to load before giving up.")
    enable_metrics: bool = _f(
        True, "Serve Prometheus metrics at /metrics (--no-enable-metrics turns it off).",
        boolean=True)
    incremental_streaming_output: bool = _f(
        False, "A /generate stream sends each chunk's new text and output_ids only (SGLang's "
        "flag); by default every chunk carries the whole text and output_ids so far. The "
        "OpenAI routes stream deltas either way.", boolean=True)
    max_payload_size: int = _f(
        32 * 1024 * 1024, "Largest HTTP request body in bytes; larger ones get 413.")
    request_timeout: float | None = _f(
        None, "HTTP server: seconds a request may take from arrival to its last byte (reading "
        "the body, queueing, generating, streaming). Past it the request is aborted (its KV "
        "freed) and the client gets 408, or an error event if its stream had started. "
        "Default: no limit.")
    shutdown_timeout: float = _f(
        300.0, "On SIGTERM or SIGINT: seconds to let in-flight requests finish (new ones get "
        "503) before aborting them; a second signal aborts them at once.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # Engine(**kwargs) values come unparsed
            _check_type(f.name, f.type, getattr(self, f.name))
        _check(self.port > 0 and self.port < 65536, f"--port must be in 1..65535, got {self.port}")
        _check(0 <= self.random_seed < 2**63,
               f"--random-seed must be in 0..2**63-1, got {self.random_seed}")
        _check(self.max_running_requests >= 1,
               f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        _check(self.dllm_admit_ahead is None or self.dllm_admit_ahead >= 0,
               f"--dllm-admit-ahead must be >= 0, got {self.dllm_admit_ahead}")
        _check(self.max_queued_requests is None or self.max_queued_requests >= 0,
               f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        _check(self.max_total_tokens is None or self.max_total_tokens > 0,
               f"--max-total-tokens must be > 0, got {self.max_total_tokens}")
        _check(self.page_size is None or self.page_size > 0,
               f"--page-size must be > 0, got {self.page_size}")
        _check(self.context_length is None or self.context_length > 0,
               f"--context-length must be > 0, got {self.context_length}")
        _check(self.chunked_prefill_size > 0,
               f"--chunked-prefill-size must be > 0, got {self.chunked_prefill_size}")
        _check(self.gc_warning_threshold_secs >= 0.0,  # NaN fails too
               f"--gc-warning-threshold-secs must be >= 0, got {self.gc_warning_threshold_secs}")
        _check(self.startup_timeout > 0,
               f"--startup-timeout must be > 0, got {self.startup_timeout}")
        _check(self.max_payload_size > 0,
               f"--max-payload-size must be > 0, got {self.max_payload_size}")
        _check(self.request_timeout is None or self.request_timeout > 0,
               f"--request-timeout must be > 0, got {self.request_timeout}")
        _check(self.shutdown_timeout >= 0,
               f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        _check(0.0 < self.mem_fraction_static < 1.0,
               f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        _check(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
               f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        _check(self.dllm_wavefront_size >= 1,
               f"--dllm-wavefront-size must be >= 1, got {self.dllm_wavefront_size}")
        _check(0.0 <= self.dllm_spawn_threshold <= 1.0,
               f"--dllm-spawn-threshold must be in [0, 1], got {self.dllm_spawn_threshold}")
        tau = self.dllm_spawn_token_threshold
        _check(tau is None or 0.0 <= tau <= 1.0,
               f"--dllm-spawn-token-threshold must be in [0, 1], got {tau}")
        _check(self.dllm_gate_arm_forwards >= 0.0,  # NaN fails too
               f"--dllm-gate-arm-forwards must be >= 0 (inf: always), got "
               f"{self.dllm_gate_arm_forwards}")
        _check(not (self.dllm_wavefront_lockstep and self.dllm_fdfo),
               "--dllm-wavefront-lockstep advances all requests together; use it with "
               "--no-dllm-fdfo")
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES), ("log_level", LOG_LEVELS),
                              ("load_format", LOAD_FORMATS),
                              ("attention_backend", ATTENTION_BACKEND_NAMES),
                              ("moe_backend", MOE_BACKEND_NAMES),
                              ("dllm_pipeline_depth", PACING), ("dllm_multi_step", PACING)):
            value = getattr(self, name)
            _check(value in allowed, f"--{name.replace('_', '-')} must be one of "
                   f"{', '.join(allowed)}, got {value!r}")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_gated_spawn(self) -> bool:
        """--dllm-gated-spawn, resolved: on on CUDA unless set."""
        if self.dllm_gated_spawn is not None:
            return self.dllm_gated_spawn
        return self.resolved_device == "cuda"

    @property
    def resolved_attention_backend(self) -> str:
        return _resolve_backend(self.attention_backend, self.resolved_device)

    @property
    def resolved_moe_backend(self) -> str:
        return _resolve_backend(self.moe_backend, self.resolved_device)

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device == "cuda" else "float32"

    @property
    def admit_ahead(self) -> int:
        """--dllm-admit-ahead, resolved: max_running_requests by default, at most
        --max-queued-requests (requests admitted ahead take places of the queue)."""
        ahead = self.dllm_admit_ahead
        if ahead is None:
            ahead = self.max_running_requests
        if self.max_queued_requests is not None:
            ahead = min(ahead, self.max_queued_requests)
        return ahead

    @property
    def graph_max_blocks(self) -> int:
        """The largest CUDA-graph bucket, in active blocks (--cuda-graph-max-bs)."""
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        per_request = self.dllm_wavefront_size + (self.dllm_standby and self.dllm_fdfo
                                                  and self.dllm_wavefront_size == 1)
        return min(self.max_running_requests * per_request, 256)

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field: `model_path` -> `--model-path`."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            if meta.get("boolean"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                    default=f.default, help=meta["help"])
                continue
            kind = _cli_type(f.type)
            parser.add_argument(flag, type=kind, default=f.default, choices=meta.get("choices"),
                                help=f"{meta['help']} (default: {f.default})")

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})


def _resolve_backend(name: str, device: str) -> str:
    """"auto": the Triton kernels on CUDA (where Triton is installed), the PyTorch reference
    elsewhere; any other name is kept (the backend registries reject unknown ones)."""
    if name != "auto":
        return name
    import importlib.util

    return "triton" if device == "cuda" and importlib.util.find_spec("triton") else "torch"


def _cli_type(annotation: object) -> type:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# a field's declared type -> what its value may be (bool is no int; a float field takes ints)
_TYPES: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "float": (int, float),
                                       "str": (str,)}


def _check_type(name: str, declared: Any, value: Any) -> None:
    """ValueError naming the flag unless value has the field's declared type ("int",
    "float | None", ...)."""
    base, _, optional = str(declared).partition(" | ")
    if value is None and optional == "None":
        return
    kinds = _TYPES[base]
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    _check(ok, f"--{name.replace('_', '-')} must be {'a' if base != 'int' else 'an'} {base}"
           f"{' or None' if optional else ''}, got {value!r}")

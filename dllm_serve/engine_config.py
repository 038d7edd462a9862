"""Configuration resolved once, in the parent process, into one frozen config per process.

`EngineConfig.resolve` reads config.json (and the algorithm YAML) once; the scheduler and the
worker receive `SchedulerProcConfig` / `WorkerConfig` and never re-read the checkpoint's
configuration or take the whole `ServerArgs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_serve.default_model import resolve_model_path
from dllm_serve.dllm.config import DllmConfig, arch_defaults
from dllm_serve.dllm.modes import RoundMode, WavefrontConfig
from dllm_serve.managers.scheduler_config import SchedulerConfig
from dllm_serve.model.config import ModelConfig, RunnerConfig
from dllm_serve.server_args import ServerArgs
from dllm_serve.tokenizer import Tokenizer


@dataclass(frozen=True)
class WorkerConfig:
    runner: RunnerConfig
    dllm: DllmConfig
    mode: RoundMode
    log_level: str = "info"
    gc_warning_s: float = 0.0  # log collections that pause the process longer (0: off)
    depth: int | None = None  # the worker's pipeline depth; None: adaptive on CUDA
    multi_step: int | None = 1  # forwards per pass of the worker; None: adaptive on CUDA


@dataclass(frozen=True)
class SchedulerProcConfig:
    scheduler: SchedulerConfig  # num_pages / page_size: 0 until the worker reports its pool
    tokenizer_path: str
    eos_ids: tuple[int, ...]
    log_level: str = "info"
    gc_warning_s: float = 0.0  # log collections that pause the process longer (0: off)


@dataclass(frozen=True)
class EngineConfig:
    args: ServerArgs  # model_path resolved (never None)
    model: ModelConfig
    dllm: DllmConfig
    eos_ids: tuple[int, ...]

    @staticmethod
    def resolve(args: ServerArgs) -> EngineConfig:
        """Read the checkpoint's config.json, the algorithm YAML and the tokenizer's
        end-of-turn tokens (they stop generation too), once."""
        args = args.replace(model_path=resolve_model_path(args.model_path))
        assert args.model_path is not None
        model = ModelConfig.load(args.model_path)
        model.context_length(args.context_length)  # a longer one than the model's raises
        dllm = DllmConfig.build(model, args.dllm_algorithm, args.dllm_algorithm_config,
                                args.dllm_fdfo)
        if args.page_size is not None and args.page_size % dllm.block_size:
            raise ValueError(f"--page-size ({args.page_size}) must be a multiple of the "
                             f"model's block size ({dllm.block_size})")
        eos = set(model.eos_token_ids()) or {arch_defaults(model.architecture).eos_id}
        extra = Tokenizer.load(args.tokenizer_path or args.model_path).extra_stop_token_ids
        return EngineConfig(args, model, dllm, tuple(sorted(eos | set(extra))))

    @property
    def tokenizer_path(self) -> str:
        return self.args.tokenizer_path or str(self.args.model_path)

    @property
    def context_length(self) -> int:
        return self.model.context_length(self.args.context_length)

    @property
    def mode(self) -> RoundMode:
        a = self.args
        return RoundMode(fdfo=a.dllm_fdfo, wavefront=WavefrontConfig(
            a.dllm_wavefront_size, a.dllm_spawn_threshold, a.dllm_spawn_token_threshold,
            a.dllm_wavefront_lockstep, a.resolved_gated_spawn, a.dllm_standby,
            a.dllm_gate_arm_forwards))

    def worker(self) -> WorkerConfig:
        a = self.args
        runner = RunnerConfig(
            model=self.model, block_size=self.dllm.block_size, mask_id=self.dllm.mask_id,
            device=a.resolved_device, dtype=a.resolved_dtype,
            attention_backend=a.resolved_attention_backend, moe_backend=a.resolved_moe_backend,
            load_format=a.load_format, random_seed=a.random_seed, page_size=a.page_size,
            context_length=a.context_length, max_total_tokens=a.max_total_tokens,
            mem_fraction_static=a.mem_fraction_static,
            max_running_requests=a.max_running_requests, admit_ahead=a.admit_ahead,
            cuda_graphs=not a.disable_cuda_graph, graph_max_blocks=a.graph_max_blocks,
            chunked_prefill_size=a.chunked_prefill_size)
        return WorkerConfig(runner, self.dllm, self.mode, a.log_level,
                            a.gc_warning_threshold_secs, _pacing(a.dllm_pipeline_depth),
                            _pacing(a.dllm_multi_step))

    def scheduler(self) -> SchedulerProcConfig:
        a = self.args
        cfg = SchedulerConfig(
            block_size=self.dllm.block_size, mask_id=self.dllm.mask_id, fdfo=a.dllm_fdfo,
            max_running_requests=a.max_running_requests,
            max_queued_requests=a.max_queued_requests,
            chunked_prefill_size=a.chunked_prefill_size, num_pages=0, page_size=0,
            random_seed=a.random_seed, wavefront_size=a.dllm_wavefront_size,
            radix_cache=not a.disable_radix_cache, admit_ahead=a.admit_ahead)
        return SchedulerProcConfig(cfg, self.tokenizer_path, self.eos_ids, a.log_level,
                                   a.gc_warning_threshold_secs)


def _pacing(value: str) -> int | None:
    """A pacing flag's value ("1", "2" or "auto") -> the worker's int, None for auto."""
    return None if value == "auto" else int(value)

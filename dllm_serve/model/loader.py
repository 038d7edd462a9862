"""Strict loading of HF checkpoints (config.json + *.safetensors) into our model classes.

The model class is chosen by `architectures[0]`. The class is built on the meta device (no
memory), materialised once on the target device in the target dtype, then filled from the
checkpoint through the model's `weight_map` (models/weights.py). Loading is strict: every
expected tensor must appear exactly once with the expected shape, and nothing else may appear
(except names the map ignores and tied aliases); any violation raises a ValueError naming the
tensor. `random_model` (`--load-format dummy`) builds the same model from config.json alone,
with random weights, for speed tests at real shapes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from dllm_serve.model.config import ModelConfig
from dllm_serve.models import get_model_class
from dllm_serve.models.weights import PackedWeight, WeightMap

logger = logging.getLogger(__name__)

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lands: `param[index]` (index () = the whole parameter)."""

    param: str
    index: Index = ()


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model for `config.architecture` and load every tensor of the checkpoint."""
    start = time.perf_counter()
    cls = get_model_class(config.architecture)
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(config.hf)
    wmap: WeightMap = model.weight_map
    materialize(model, dtype, torch.device(device), wmap)
    count = load_weights(model, Path(config.path), wmap)
    logger.info("loaded %s: %d tensors in %.1f s", config.architecture, count,
                time.perf_counter() - start)
    return model.eval()


def random_model(hf: dict[str, Any], dtype: torch.dtype, device: torch.device,
                 seed: int = 0, std: float | None = None) -> nn.Module:
    """The model for config.json `hf`, allocated like `load_model` does, with random weights:
    norms 1, biases 0, matrices N(0, std) (default: initializer_range), and an expert bias
    spread like a trained router's (N(0, 0.05)), so that expert choices vary."""
    cls = get_model_class(hf["architectures"][0])
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(hf)
    materialize(model, dtype, torch.device(device), model.weight_map)
    gen = torch.Generator(device).manual_seed(seed)
    std = float(hf.get("initializer_range", 0.02)) if std is None else std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("expert_bias"):
                p.normal_(0.0, 0.05, generator=gen)
            elif p.dim() > 1:
                p.normal_(0.0, std, generator=gen)
            else:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    logger.info("built %s with random weights (--load-format dummy)", hf["architectures"][0])
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device,
                wmap: WeightMap) -> None:
    """Allocate the meta-built model on `device` (uninitialised), fp32 where `wmap` says so.

    Modules with computed buffers rebuild them in `reset_buffers(device)`.
    """
    shared = _shared_parameters(model)
    model.to_empty(device=device)  # allocates fresh parameters: ties are restored below
    for alias, source in shared:
        module, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(module), leaf, model.get_parameter(source))
    for name, param in model.named_parameters():  # tied parameters appear once
        param.requires_grad_(False)
        wanted = torch.float32 if wmap.is_fp32(name) else dtype
        if param.dtype != wanted:
            param.data = torch.empty(param.shape, dtype=wanted, device=device)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device)


def _shared_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, source) for every parameter registered under more than one name."""
    first: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return pairs


def expected_tensors(model: nn.Module, wmap: WeightMap) -> dict[str, Slot]:
    """Every checkpoint tensor name the model needs -> where it lands."""
    aliases = {alias for alias, _ in wmap.tied}
    expected: dict[str, Slot] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in aliases:
            continue
        rule = wmap.rule_for(name)
        expected.update({name: Slot(name)} if rule is None
                        else packed_slots(name, tuple(tensor.shape), rule))
    return expected


def packed_slots(name: str, shape: tuple[int, ...], rule: PackedWeight) -> dict[str, Slot]:
    """The HF sources of packed parameter `name` (shape `shape`) and their slices."""
    prefix = name[: len(name) - len(rule.param)]
    dim = 1 if rule.per_expert else 0
    sizes = rule.sizes or (shape[dim] // len(rule.sources),) * len(rule.sources)
    if sum(sizes) != shape[dim]:
        raise ValueError(f"{name}: packed sizes {list(sizes)} do not add up to {shape[dim]}")
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    experts: list[int | None] = list(range(shape[0])) if rule.per_expert else [None]
    slots: dict[str, Slot] = {}
    for expert in experts:
        for source, start, size in zip(rule.sources, offsets, sizes, strict=True):
            index: Index = (slice(start, start + size),)
            if expert is not None:
                index = (expert, *index)
            slots[prefix + source.format(e=expert)] = Slot(name, index)
    return slots


@torch.no_grad()
def load_weights(model: nn.Module, folder: Path, wmap: WeightMap) -> int:
    """Copy every tensor of `folder/*.safetensors` into the model; returns the count loaded."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in model folder {str(folder)!r}")
    expected = expected_tensors(model, wmap)
    params = model.state_dict(keep_vars=True)
    tied = dict(wmap.tied)
    aliases: dict[str, torch.Tensor] = {}
    filled: set[str] = set()
    for file in files:
        with _opened(file) as f:
            for name in f.keys():
                if wmap.is_ignored(name):
                    continue
                if name in tied:
                    aliases[name] = f.get_tensor(name)
                    continue
                target = _target(params, expected, filled, name, file)
                _check_shape(name, tuple(f.get_slice(name).get_shape()), tuple(target.shape))
                target.copy_(f.get_tensor(name))
                filled.add(name)
    _check_complete(expected, filled)
    for alias, source in wmap.tied:
        if params[alias] is not params[source]:
            raise RuntimeError(f"{alias!r} is declared tied to {source!r} but is a separate "
                               "parameter; it would stay uninitialised")
    for alias, tensor in aliases.items():
        _check_tied(params, alias, tied[alias], tensor)
    return len(filled)


def _opened(file: Path) -> Any:
    """safe_open(file); a file that is no safetensors checkpoint (truncated, corrupted) is a
    ValueError naming it."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{file}: not a readable safetensors file "
                         f"({' '.join(str(e).split())})") from None


def _target(params: dict[str, torch.Tensor], expected: dict[str, Slot], filled: set[str],
            name: str, file: Path) -> torch.Tensor:
    slot = expected.get(name)
    if slot is None:
        raise ValueError(f"unexpected tensor {name!r} in {file.name}: the model has no such weight")
    if name in filled:
        raise ValueError(f"tensor {name!r} appears twice in the checkpoint (again in {file.name})")
    return params[slot.param].data[slot.index]


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"tensor {name!r} has shape {list(got)} in the checkpoint, "
                         f"the model expects {list(want)}")


def _check_tied(params: dict[str, torch.Tensor], alias: str, source: str,
                tensor: torch.Tensor) -> None:
    """A tied alias present in the checkpoint must equal its (loaded) source."""
    ref = params[source].data
    _check_shape(alias, tuple(tensor.shape), tuple(ref.shape))
    if not torch.equal(tensor.to(ref.device, ref.dtype), ref):
        raise ValueError(f"tensor {alias!r} is tied to {source!r} (tie_word_embeddings) but the "
                         "checkpoint holds different values")


def _check_complete(expected: dict[str, Slot], filled: set[str]) -> None:
    missing = sorted(set(expected) - filled)
    if missing:
        shown = ", ".join(f"{m!r} (-> {expected[m].param})" for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")

"""Saving: the trained model as a standard LLaDA2 HF checkpoint, and the resumable train state.

`save_hf_checkpoint` inverts the loader's name mapping (model/loader.expected_tensors: every HF
tensor name -> a parameter or a slice of a packed one), so per-expert tensors, the separate
gate/up projections and the fused query_key_value come out under the real HF names; expert_bias
stays fp32, everything else takes config["dtype"]. The names and shapes are then checked
against llada2_format.llada2_tensor_specs, which spells the format out independently, so the
folder loads through the strict loader exactly like a real LLaDA2 checkpoint.

The train state (a folder) holds train_state.pt (fp32 weights, optimizer, step, progress, RNG
states, the config) and tokenizer.json, so that a run can stop and continue bit-compatibly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from dllm_serve.model.loader import expected_tensors
from dllm_serve.tools.llada2_format import llada2_tensor_specs, write_metadata_files
from dllm_serve.tools.tiny_checkpoint import DTYPES

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"


def hf_tensors(model: nn.Module, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's weights under LLaDA2's HF tensor names, on the CPU, contiguous."""
    dtype = DTYPES[config["dtype"]]
    params = model.state_dict()
    out = {}
    for name, slot in expected_tensors(model, model.weight_map).items():
        value = params[slot.param][slot.index] if slot.index else params[slot.param]
        keep_fp32 = name.endswith("expert_bias")
        out[name] = value.detach().to("cpu", torch.float32 if keep_fp32 else dtype).contiguous()
    _check_format(out, config)
    return out


def _check_format(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    want = {name: shape for name, shape, _ in llada2_tensor_specs(config)}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        shapes = sorted(n for n in set(want) & set(got) if want[n] != got[n])
        raise ValueError(f"exported tensors differ from the LLaDA2 format: missing {missing[:4]}"
                         f", unexpected {extra[:4]}, mis-shaped {shapes[:4]}")


def save_hf_checkpoint(out: Path, model: nn.Module, tok: Tokenizer,
                       config: dict[str, Any]) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model, config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_metadata_files(out, tok, config)
    size = (out / "model.safetensors").stat().st_size
    logger.info("wrote HF checkpoint %s (%d tensors, %.1f MB)", out, len(tensors), size / 1e6)
    return out


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def save_train_state(folder: Path, state: dict[str, Any], tok: Tokenizer) -> None:
    """Atomically replace folder/train_state.pt; `state` holds tensors and plain values only."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(folder / STATE_FILE)
    tok.save(str(folder / "tokenizer.json"))
    logger.info("saved train state at step %d to %s", state["step"], folder)


def load_train_state(folder: Path) -> tuple[dict[str, Any], Tokenizer]:
    file = folder / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"--resume {str(folder)!r}: no {STATE_FILE} there")
    state = torch.load(file, map_location="cpu", weights_only=True)
    return state, Tokenizer.from_file(str(folder / "tokenizer.json"))

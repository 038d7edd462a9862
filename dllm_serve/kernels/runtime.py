"""What every kernel wrapper needs: interpreter detection, device checks, launch sizes.

Under `TRITON_INTERPRET=1` (CPU tests) the kernels run on CPU tensors through Triton's numpy
interpreter. That interpreter multiplies bf16/fp16 `tl.dot` operands as raw bits, so kernels
take a `DOT_F32` flag that upcasts dot operands there; on the GPU the dot stays bf16 with fp32
accumulation.
"""

from __future__ import annotations

import os

import torch

CPU_NUM_SMS = 2  # a stand-in SM count under the interpreter (only shapes the launch grid)


def interpreted() -> bool:
    """True when Triton kernels run in the numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(t: torch.Tensor, what: str) -> None:
    """Raise with a readable message when `t` cannot feed a Triton kernel."""
    if t.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"{what}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 to "
                           f"test them on the CPU); got a tensor on {t.device}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., dim) -> (R, dim) with unit stride in dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def floor_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << (max(1, n).bit_length() - 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

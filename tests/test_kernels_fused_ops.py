"""The fused elementwise kernels equal their plain-PyTorch oracles: RMSNorm (with and without
the residual add), q/k RMSNorm + partial RoPE (in place, on the fused QKV buffer and on
separate tensors), the SwiGLU activation, and the K/V store into a paged cache. Small shapes
run in the interpreter on the CPU; `gpu` tests run LLaDA2.0-mini's shapes in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dllm_serve.kernels.kv_store import store_kv
from dllm_serve.kernels.norm import fused_rms_norm
from dllm_serve.kernels.rope import fused_qk_norm_rope
from dllm_serve.kernels.silu_mul import MAX_BLOCK, fused_silu_mul
from dllm_serve.layers.attention import KvTarget
from dllm_serve.layers.fused import set_kernel_backend
from dllm_serve.layers.mlp import SwiGLUMLP, silu_and_mul
from dllm_serve.layers.norm import RMSNorm, rms_norm
from dllm_serve.layers.rotary import RotaryEmbedding, apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rand(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0
         ) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: rounding of the reduction order only; bf16: one or two bf16 ulps."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def check_norm(rows: int, dim: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, res = rand(rows, dim, gen=gen, dtype=dtype), rand(rows, dim, gen=gen, dtype=dtype)
    w = rand(dim, gen=gen, dtype=dtype, scale=0.1) + 1
    close(fused_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype)
    out, h = fused_rms_norm(x, w, 1e-6, residual=res)
    if DEVICE.type == "cuda" or dtype == torch.float32:
        torch.testing.assert_close(h, res + x, rtol=0, atol=0)
    else:  # the interpreter rounds fp32 -> bf16 towards zero
        close(h, res + x, dtype)
    close(out, rms_norm(res + x, w, 1e-6), dtype)


@pytest.mark.parametrize("rows,dim,dtype", [(1, 64, torch.float32), (37, 48, torch.float32),
                                            (20, 64, torch.bfloat16)])
def test_rms_norm(rows: int, dim: int, dtype: torch.dtype) -> None:
    check_norm(rows, dim, dtype, seed=rows)


def test_rms_norm_module_switches_to_the_kernel() -> None:
    norm = RMSNorm(32, 1e-5).to(DEVICE)
    x, res = torch.randn(5, 32, device=DEVICE), torch.randn(5, 32, device=DEVICE)
    ref, ref_h = norm(x, residual=res)
    norm.kernel_backend = "triton"
    out, h = norm(x, residual=res)
    close(out, ref, torch.float32)
    torch.testing.assert_close(h, ref_h)


def reference_norm_rope(q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor | None,
                        kw: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    if qw is not None and kw is not None:
        q, k = rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def check_qk_rope(tokens: int, heads: int, kv_heads: int, head_dim: int, rotary: int,
                  dtype: torch.dtype, norm: bool, fused_buffer: bool, seed: int,
                  store: bool = False, cache_dtype: torch.dtype | None = None) -> None:
    """In place, equal to the oracle, v untouched; with `store` the caches (of `cache_dtype`,
    default `dtype`) hold the returned k and v at each token's slot cast to their dtype, bit
    for bit (as AttentionBackend.store writes them), and nothing else changed."""
    gen = torch.Generator().manual_seed(seed)
    qkv = rand(tokens, heads + 2 * kv_heads, head_dim, gen=gen, dtype=dtype)
    if fused_buffer:
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q, k, v = (qkv[:, :heads].clone(), qkv[:, heads:heads + kv_heads].clone(),
                   qkv[:, heads + kv_heads:])
    qw = rand(head_dim, gen=gen, dtype=dtype, scale=0.1) + 1 if norm else None
    kw = rand(head_dim, gen=gen, dtype=dtype, scale=0.1) + 1 if norm else None
    positions = torch.randint(0, 4000, (tokens,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(rotary, 10000.0).to(DEVICE)(positions, dtype)
    ref_q, ref_k = reference_norm_rope(q.clone(), k.clone(), qw, kw, cos, sin)
    v_before = v.clone()
    target = None
    if store:
        slots = 3 * tokens
        target = KvTarget(rand(slots, kv_heads, head_dim, gen=gen, dtype=cache_dtype or dtype),
                          rand(slots, kv_heads, head_dim, gen=gen, dtype=cache_dtype or dtype),
                          torch.randperm(slots, generator=gen)[:tokens].to(DEVICE))
        caches = target.k_cache.clone(), target.v_cache.clone()
    out_q, out_k = fused_qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, v, target)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)  # v heads untouched
    if target is not None:
        caches[0][target.loc] = out_k.to(caches[0].dtype)
        caches[1][target.loc] = v.to(caches[1].dtype)
        torch.testing.assert_close(target.k_cache, caches[0], rtol=0, atol=0)
        torch.testing.assert_close(target.v_cache, caches[1], rtol=0, atol=0)


@pytest.mark.parametrize("fused_buffer", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_stores_kv(fused_buffer: bool, norm: bool) -> None:
    """The store rides along the launch that holds k (one launch on the fused buffer, the
    second of two on separate q and k), with three kv heads (a padded head tile)."""
    check_qk_rope(13, 6, 3, 16, 8, torch.float32, norm, fused_buffer, seed=5, store=True)


def test_qk_norm_rope_stores_into_a_cache_of_another_dtype() -> None:
    """bf16 q/k/v into an fp32 cache: the rounded bf16 k and v, widened (as store's .to)."""
    check_qk_rope(7, 4, 2, 16, 16, torch.bfloat16, True, True, seed=8, store=True,
                  cache_dtype=torch.float32)


def test_qk_norm_rope_store_checks_shapes() -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v = rand(4, 8, 16, gen=gen, dtype=torch.float32).split([4, 2, 2], dim=1)
    cos, sin = RotaryEmbedding(16, 10000.0).to(DEVICE)(torch.arange(4, device=DEVICE),
                                                       torch.float32)
    cache = torch.zeros(8, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="give v"):
        fused_qk_norm_rope(q, k, None, None, 1e-6, cos, sin, None,
                           KvTarget(cache, cache, torch.arange(4, device=DEVICE)))
    with pytest.raises(ValueError, match="must hold 2 heads of 16"):
        fused_qk_norm_rope(q, k, None, None, 1e-6, cos, sin, v,
                           KvTarget(cache[:, :1], cache[:, :1], torch.arange(4, device=DEVICE)))


@pytest.mark.parametrize("fused_buffer", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope(fused_buffer: bool, norm: bool) -> None:
    check_qk_rope(19, 4, 2, 16, 8, torch.float32, norm, fused_buffer, seed=int(norm))


def test_qk_norm_rope_bf16_full_rotary() -> None:
    check_qk_rope(9, 2, 1, 32, 32, torch.bfloat16, True, True, seed=3)


def silu_mul_as_interpreted(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16 gate_up (N, 2I) -> what the kernel computes in Triton's CPU interpreter: numpy's
    fp32 exp and division, then each cast to bf16 toward zero (the GPU, like PyTorch, rounds
    to nearest even): silu rounded, then the product rounded."""
    def toward_zero(x: torch.Tensor) -> torch.Tensor:
        return (x.view(torch.int32) & -65536).view(torch.float32).bfloat16()

    gate, up = gate_up.float().chunk(2, dim=-1)
    e = torch.from_numpy(np.exp((-gate).numpy()))
    return toward_zero(toward_zero(gate / (1 + e)).float() * up)


def check_silu_mul(gate_up: torch.Tensor) -> None:
    """On CUDA: the oracle's bits (bf16 and fp32). In the interpreter: fp32 within numpy's
    exp against PyTorch's (an ulp or two); bf16 exactly the interpreter's roundings, which
    puts it within a few bf16 steps of the oracle."""
    out, ref = fused_silu_mul(gate_up), silu_and_mul(gate_up)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if DEVICE.type == "cuda":
        assert torch.equal(out, ref)
    elif gate_up.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(out, silu_mul_as_interpreted(gate_up.view(-1, gate_up.shape[-1]))
                           .view(out.shape))
        torch.testing.assert_close(out, ref, rtol=2 ** -5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 16), (37, 80), (5, MAX_BLOCK + 76)])
def test_silu_mul(rows: int, inter: int, dtype: torch.dtype) -> None:
    """A masked row tail, and columns past one program's MAX_BLOCK."""
    gen = torch.Generator().manual_seed(rows)
    check_silu_mul(rand(rows, 2 * inter, gen=gen, dtype=dtype, scale=3.0))


def test_silu_mul_strided_rows_and_leading_dims() -> None:
    """Rows with a stride past 2I (a view into a wider buffer), and (B, T, 2I) input."""
    gen = torch.Generator().manual_seed(7)
    wide = rand(9, 2 * 24 + 8, gen=gen, dtype=torch.bfloat16, scale=3.0)
    check_silu_mul(wide[:, :48])
    check_silu_mul(rand(2, 3, 40, gen=gen, dtype=torch.bfloat16, scale=3.0))


def test_set_kernel_backend_switches_the_swiglu_activation() -> None:
    """set_kernel_backend switches SwiGLUMLP (with the norms) to the kernel and back; the
    MLP's output follows its activation's; unknown names raise listing the known ones."""
    gen = torch.Generator().manual_seed(8)
    model = nn.Sequential(RMSNorm(32, 1e-6), SwiGLUMLP(32, 48)).to(DEVICE)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(rand(*param.shape, gen=gen, dtype=torch.float32, scale=0.3))
    x = rand(6, 32, gen=gen, dtype=torch.float32)
    mlp = model[1]
    ref = mlp(x)
    set_kernel_backend(model, "triton")
    assert mlp.kernel_backend == "triton" and model[0].kernel_backend == "triton"
    close(mlp(x), ref, torch.float32)
    set_kernel_backend(model, "torch")
    assert torch.equal(mlp(x), ref)
    with pytest.raises(KeyError, match="known: triton"):
        set_kernel_backend(model, "cuda")


def check_store(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    qkv = rand(tokens, 2 + 2 * kv_heads, head_dim, gen=gen, dtype=dtype)
    k, v = qkv[:, 2:2 + kv_heads], qkv[:, 2 + kv_heads:]  # strided views, like the model's
    slots = 3 * tokens
    k_cache = rand(slots, kv_heads, head_dim, gen=gen, dtype=dtype)
    v_cache = rand(slots, kv_heads, head_dim, gen=gen, dtype=dtype)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k[loc], ref_v[loc] = k, v
    store_kv(k, v, k_cache, v_cache, loc)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0)


@pytest.mark.parametrize("tokens,kv_heads,head_dim", [(1, 1, 16), (45, 2, 16), (8, 3, 24)])
def test_store_kv(tokens: int, kv_heads: int, head_dim: int) -> None:
    check_store(tokens, kv_heads, head_dim, torch.float32, seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 2048])
def test_llada2_mini_shapes(tokens: int) -> None:
    check_norm(tokens, 2048, torch.bfloat16, seed=tokens)
    check_qk_rope(tokens, 16, 4, 128, 64, torch.bfloat16, True, True, seed=tokens)
    check_qk_rope(tokens, 16, 4, 128, 64, torch.bfloat16, True, True, seed=tokens, store=True)
    check_store(tokens, 4, 128, torch.bfloat16, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    for inter in (512, 5120):  # the shared expert's and the dense layer's
        check_silu_mul(rand(tokens, 2 * inter, gen=gen, dtype=torch.bfloat16, scale=3.0))

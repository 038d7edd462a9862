"""`to_device`: every copy lands intact, on the CPU directly and on CUDA through the pinned
staging ring, including laps around the ring while copies are still queued behind work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dllm_serve.utils.device import PinnedRing, copy_to_device, to_device


def test_cpu_copies_are_plain() -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = to_device(a, torch.device("cpu"))
    assert t.dtype == torch.int64 and torch.equal(t, torch.from_numpy(a))
    assert torch.equal(to_device([1.5, 2.0], torch.device("cpu"), torch.float64),
                       torch.tensor([1.5, 2.0], dtype=torch.float64))


def test_copy_into_an_existing_tensor_on_the_cpu() -> None:
    dst = torch.zeros(6, dtype=torch.int64)
    copy_to_device(dst[2:], np.arange(4, dtype=np.int64))
    assert dst.tolist() == [0, 0, 0, 1, 2, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("size,whole", [(1000, False), (50_000, True)])
def test_copies_into_one_reused_buffer_are_read_in_stream_order(size: int, whole: bool) -> None:
    """What the worker does per forward: copy into one fixed device buffer (RowStorage's
    upload rows, a prefix of varying length; the bucketed forwards' metadata, whole), then
    read it, many times while work is queued; each read sees its own copy."""
    dev = torch.device("cuda")
    buf = torch.empty(size, dtype=torch.int64, device=dev)
    big = torch.randn(4096, 4096, device=dev)
    seen, sizes = [], [size if whole else 1 + i % (size - 3) for i in range(300)]
    for i, n in enumerate(sizes):
        big = big @ big
        big /= big.norm()
        copy_to_device(buf[:n], np.full(n, i, dtype=np.int64))
        seen.append(buf[:n].sum())  # read in stream order, before the next copy
    torch.cuda.synchronize()
    assert [int(x) for x in seen] == [i * n for i, n in enumerate(sizes)]


@pytest.mark.gpu
def test_ring_copies_survive_laps_behind_queued_work() -> None:
    """A small ring lapped many times while a long kernel keeps the copies queued: no copy
    reads bytes a later array overwrote (the per-part fences hold the host back)."""
    dev = torch.device("cuda")
    ring = PinnedRing(dev, size=4096)
    rng = np.random.default_rng(0)
    big = torch.randn(4096, 4096, device=dev)
    outs, wants = [], []
    for i in range(200):
        if i % 50 == 0:
            big = big @ big  # keeps the stream busy while the host stages more copies
            big /= big.norm()
        n = int(rng.integers(1, 200))
        dtype = (np.int64, np.float32, np.int32, np.bool_)[i % 4]
        a = (rng.integers(0, 100, size=n) if dtype != np.float32
             else rng.standard_normal(n)).astype(dtype)
        outs.append(ring.stage(a).to(dev, non_blocking=True))
        wants.append(a.copy())
    big_copy = ring.stage(np.arange(5000, dtype=np.int64))  # larger than a part: own block
    outs.append(big_copy.to(dev, non_blocking=True))
    wants.append(np.arange(5000, dtype=np.int64))
    torch.cuda.synchronize()
    for got, want in zip(outs, wants, strict=True):
        assert np.array_equal(got.cpu().numpy(), want)


@pytest.mark.gpu
def test_to_device_on_cuda_matches_the_array() -> None:
    dev = torch.device("cuda")
    for n in (0, 1, 7, 100_000, 2_500_000):  # the last: larger than a ring part
        a = np.arange(n, dtype=np.int64)
        assert np.array_equal(to_device(a, dev).cpu().numpy(), a)

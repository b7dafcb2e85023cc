"""Issue 52's memory goal, counted here: the bytes the chunked loss keeps alive at the GPU table's bf16 sizes (meta
tensors under benchmarks/live_bytes.py), at or below Liger-Kernel's H100 figures; the accountant itself checked
against the plain loss's H100 measurement and on small cases it must count right."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_ce_bytes  # noqa: E402
from live_bytes import LiveBytes  # noqa: E402

pytestmark = pytest.mark.stack_independent


def test_the_accountant_counts_new_storage_once_and_frees_it():
    x = torch.empty(1000, device="meta")  # before: not counted
    with LiveBytes() as acct:
        y = x * 2  # 4000 bytes
        v = y.view(10, 100)  # a view: nothing new
        y.add_(1)  # in place: nothing new
        z = torch.empty(500, dtype=torch.float64, device="meta")  # 4000 more
        assert acct.now == 8000
        del y
        assert acct.now == 8000  # the view keeps the storage
        del v, z
        assert acct.now == 0 and acct.peak == 8000


def test_the_accountant_counts_what_autograd_saves():
    w = torch.empty(100, 100, device="meta", requires_grad=True)
    with LiveBytes() as acct:
        a = w * 2
        out = a.sin()  # sin saves its input
        del a
        assert acct.now == 2 * 40000
        out.sum().backward()
        del out
        assert acct.now == 40000  # w.grad
        assert acct.peak >= 3 * 40000


def test_the_plain_loss_counts_what_the_h100_measured():
    plain = bench_ce_bytes.variants()["plain"]
    for (n, h, v), gpu in bench_ce_bytes.GPU_ROWS:
        got = bench_ce_bytes.count(plain, n, h, v)
        assert round(got["peak_mib"]) == gpu["plain"], (n, v, got)


@pytest.mark.slow  # every variant at the three GPU sizes: 40 s of Python bookkeeping, the full tier's
def test_the_chunked_loss_keeps_at_most_liger_kernels_bytes_at_every_gpu_size():
    fns = bench_ce_bytes.variants()
    fns.pop("_torch")
    fns.pop("plain")
    for (n, h, v), gpu in bench_ce_bytes.GPU_ROWS:
        grads = (v * h + n * h) * 2 / 2**20
        for name, fn in fns.items():
            got = bench_ce_bytes.count(fn, n, h, v)
            # the accurate policy's float32 weight-gradient buffer is 2x the weight's bytes, by design (issue 70)
            # (+ 0.5: the H100's figures are rounded to the MiB; the fused path follows Liger's chunk rule, its bytes)
            allowed = gpu["liger"] + 0.5 + (2 * v * h * 2 / 2**20 if name.endswith("accurate") else 0)
            assert got["peak_mib"] <= allowed, (n, v, name, got)
            assert abs(got["end_mib"] - grads) < 1, (n, v, name, got)  # only the two gradients are left

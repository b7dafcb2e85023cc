"""Where the fused elementwise kernel (``zerofix.losses.triton_rows``) runs, and its launch: on CUDA wherever Triton
imports; on a CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first use, as the tests
do). Triton is imported on first use, never by ``import zerofix`` or by the CPU paths."""
from __future__ import annotations

import os

import torch

_MODULE = []  # the imported kernel module, once; [None] where Triton does not import


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def module():
    """``zerofix.losses.triton_rows``, or None where Triton does not import (a CUDA torch without it, Windows)."""
    if not _MODULE:
        try:
            from zerofix.losses import triton_rows
        except ImportError:
            triton_rows = None
        _MODULE.append(triton_rows)
    return _MODULE[0]


def runs_on(device_type: str) -> bool:
    """Whether the kernel can run on tensors of this device type here."""
    if device_type == "cuda":
        return module() is not None
    return device_type == "cpu" and interpreting() and module() is not None


def launch_shape(rows: int, vocab: int, device_type: str) -> tuple[int, int, int]:
    """(rows per program, vocabulary entries per tile, warps). On a GPU one row per program with the widest tile
    Liger-Kernel's kernel takes (32768 entries, 32 warps: a row's tiles stream through one SM while others run
    the other rows); under the interpreter, 16 rows x 128 entries (each tile is NumPy calls: fewer, larger ones)."""
    width = 1 << max(4, (vocab - 1).bit_length())
    if device_type == "cuda":
        return 1, min(32768, width), 32 if width >= 32768 else max(4, min(32, width // 1024))
    return 16, min(128, width), 1


def rows_loss_and_dlogits(z, y, row_weight, bias, opt, want_grad: bool, stats: bool, shape=None, impl=None):
    """Per row of the raw GEMM block ``z`` (rows x V, any float dtype, contiguous rows): the loss and log-sum-exp in
    float32, the argmax hit (int32) and entropy where ``stats``, and with ``want_grad`` the gradient of
    ``sum_i row_weight_i loss_i`` with respect to ``z`` written in place of ``z`` (its dtype). ``shape``: the
    launch's (rows per program, tile, warps), else ``launch_shape``'s; ``impl``: the kernel's module (the tests'
    mutants of it), else ``module()``."""
    rows, vocab = z.shape
    if z.stride(1) != 1:
        raise ValueError("the fused kernel reads rows of contiguous logits")
    block_r, block_v, warps = shape or launch_shape(rows, vocab, z.device.type)
    f32 = dict(dtype=torch.float32, device=z.device)
    loss, lse = torch.empty(rows, **f32), torch.empty(rows, **f32)
    hit = torch.empty(rows, dtype=torch.int32, device=z.device) if stats else loss
    entropy = torch.empty(rows, **f32) if stats else loss
    if rows == 0 or z.device.type == "meta":  # meta: benchmarks/bench_ce_bytes.py accounts bytes, runs nothing
        return loss, lse, (hit, entropy) if stats else None
    weights = row_weight if want_grad else loss
    extra = {} if interpreting() else {"num_warps": warps}
    (impl or module()).ce_rows_kernel[(-(-rows // block_r),)](
        z, z.stride(0), y, weights, bias if bias is not None else loss, loss, lse, hit, entropy, rows, vocab,
        float(opt.logit_scale), float(opt.logit_softcap or 1.0), float(opt.label_smoothing), float(opt.z_loss),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=opt.logit_softcap is not None, SMOOTH=bool(opt.label_smoothing),
        ZLOSS=bool(opt.z_loss), STATS=stats, WANT_GRAD=want_grad, BLOCK_R=block_r, BLOCK_V=block_v, **extra)
    return loss, lse, (hit, entropy) if stats else None

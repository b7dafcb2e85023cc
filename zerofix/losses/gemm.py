"""The GEMMs of the chunked loss in low precision: on CUDA, tensor cores in the input dtype with float32
accumulation and output (``torch.mm(..., out_dtype=torch.float32)``), and the in-place accumulation into a float32
buffer where the release's overload adds right (measured once, not assumed); the CPU keeps float32 accumulation."""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def lowp_gemm(tensor, acc) -> bool:
    """Whether GEMMs on ``tensor`` run in its low-precision dtype with float32 accumulation and output (CUDA, where
    ``torch.mm`` takes ``out_dtype``); else the CPU path: float32 accumulation of the weight gradient."""
    return tensor.device.type == "cuda" and tensor.dtype in LOW_PRECISION and acc == torch.float32


def mm_f32(a, b):
    """``a @ b`` of two low-precision matrices on tensor cores, accumulated and returned in float32."""
    return torch.mm(a, b, out_dtype=torch.float32)


# (device type, input dtype) -> whether torch.addmm(acc, a, b, out_dtype=float32, out=acc) adds in place, measured once
ADDMM_IN_PLACE: dict = {}


def add_mm_f32_(acc, a, b) -> None:
    """``acc`` (float32) += ``a @ b`` of two low-precision matrices: in place where the release's cuBLAS overload
    takes ``out=acc`` (no ``V x H`` float32 temporary per chunk: on an H100 that temporary and its add were most
    of the chunked loss's time), else through ``mm_f32``. Whether the in-place form is right is measured once per
    device type and input dtype on small matrices, not assumed from the signature."""
    kind = (acc.device.type, a.dtype)
    if kind not in ADDMM_IN_PLACE:
        ADDMM_IN_PLACE[kind] = addmm_adds_in_place(acc.device, a.dtype)
    if ADDMM_IN_PLACE[kind]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += mm_f32(a, b)


def addmm_adds_in_place(device, dtype) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    acc = torch.randn(64, 32, generator=g, device=device)
    a = torch.randn(64, 48, generator=g, device=device).to(dtype)
    b = torch.randn(48, 32, generator=g, device=device).to(dtype)
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-4))

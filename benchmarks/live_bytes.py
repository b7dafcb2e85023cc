"""A tensor accountant: the bytes of tensor storage alive while a piece of code runs, current and peak.

    with LiveBytes() as acct:
        loss_fn(hidden, weight, labels).backward()
    acct.peak  # bytes, over what was alive before (the inputs are not counted)

Every tensor an operation returns under the mode is charged its storage's bytes once (a view or an in-place result
shares its input's storage and is not charged again), and released when that storage is freed. On the ``meta``
device nothing is allocated and nothing computed, so a loss can be accounted at a GPU's sizes on any machine; what
the count leaves out is the allocator's own (rounding to blocks, cuBLAS workspaces, fragmentation). The plain loss's
count at the issue's three sizes equals its ``torch.cuda.max_memory_allocated`` growth measured on an H100 to the MiB
(``tests/test_ce_bytes.py``).

Needs torch; only benchmarks and tests import it.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_keys(values) -> set:
    return {t.untyped_storage()._cdata for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)}


class LiveBytes(TorchDispatchMode):
    """Counts live tensor storage created under it: ``now`` and ``peak`` in bytes, ``peak_at`` the operation that
    reached the peak."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.now = 0
        self.peak = 0
        self.peak_at = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live:
                continue
            if inputs is None:
                inputs = _storage_keys((args, kwargs))
            if key in inputs:  # a view of, or written into, a tensor that existed before: no new bytes
                continue
            self._live[key] = storage.nbytes()
            self.now += storage.nbytes()
            if self.now > self.peak:
                self.peak, self.peak_at = self.now, str(func)
            # The storage's Python object lives exactly as long as the storage (torch keeps it for C++ owners).
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.now -= self._live.pop(key, 0)

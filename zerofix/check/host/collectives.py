"""Every torch.distributed collective, counted at the torch level: ``install()`` wraps them once per process,
before DeepSpeed is imported (it may keep references to these functions). ``take()`` hands over (and forgets)
the ``"name:elements"`` calls seen since the last take: ds_accumulation's probes read the collectives of each
op. ``install(record)`` also sends every call to ``record(name, elements)`` (the benchmark's counter)."""
from __future__ import annotations

NAMES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
         "_reduce_scatter_base", "all_gather", "all_gather_into_tensor", "_all_gather_base",
         "broadcast", "all_to_all_single", "barrier")
_seen: list[str] = []
_sinks: list = []
_installed = False


def install(record=None) -> None:
    global _installed
    if record is not None and record not in _sinks:
        _sinks.append(record)
    if _installed:  # a second wrapping would count every call twice
        return
    _installed = True
    import torch
    import torch.distributed as dist

    def counting(name, fn):
        def counted(*args, **kwargs):
            tensor = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            numel = tensor.numel() if tensor is not None else 0
            _seen.append(f"{name}:{numel}")
            for sink in _sinks:
                sink(name, numel)
            return fn(*args, **kwargs)
        return counted

    # torch.distributed re-exports distributed_c10d's functions, which call each other through their module: both
    # names are wrapped, each call is counted once (by the name it was reached through)
    for name in NAMES:
        for module in (dist, dist.distributed_c10d):
            if hasattr(module, name):
                setattr(module, name, counting(name, getattr(module, name)))


def take() -> list[str]:
    seen = list(_seen)
    _seen.clear()
    return seen

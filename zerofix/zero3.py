"""``gathered(*params)``: make ZeRO-3-partitioned parameters whole for the duration of a direct read.

Under ZeRO-3 a parameter outside the forward of the module that owns it holds a 0-element tensor; code that
reads it directly (``x @ lm_head.weight.T``) then crashes with a size mismatch, on some ranks only. DeepSpeed
gathers a parameter automatically only when the owning module's hooks run, or (DeepSpeed >= 0.16) when it is
read by attribute inside ``engine.forward``. Everything else has to gather explicitly.

Rules, all chosen so that several ranks stay in lock-step (a gather is a collective):
- only parameters DeepSpeed reports ``NOT_AVAILABLE`` are gathered, and only those are released on exit.
  A parameter DeepSpeed already made whole (inside a module's forward, or gathered by an outer block) is
  left to DeepSpeed: releasing it under its feet would break the module's own backward.
- duplicates are dropped by identity (tied embeddings, a reference model sharing the head), and the rest
  are gathered in ``ds_id`` order, the same on every rank.
- without DeepSpeed, below ZeRO-3, or for ordinary tensors it is a no-op and imports nothing.

Importing this module imports no torch or deepspeed.
"""
from __future__ import annotations

import contextlib

__all__ = ["gathered", "is_zero3_param", "partitioned", "gather", "release", "Hold"]


def is_zero3_param(tensor) -> bool:
    """True for a parameter that ``deepspeed.zero.Init`` / ZeRO-3 partitions."""
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


def _flatten(params):
    for item in params:
        if item is None:
            continue
        if hasattr(item, "shape") and hasattr(item, "dtype"):  # a tensor (torch is not imported here)
            yield item
        elif isinstance(item, (list, tuple, set, frozenset)) or hasattr(item, "__next__"):
            yield from _flatten(item)
        else:
            raise TypeError(f"zerofix.gathered() takes parameters (or lists of them), got {type(item).__name__}; "
                            f"pass module.weight or list(module.parameters()), not the module itself")


def partitioned(*params) -> list:
    """The distinct ZeRO-3 parameters among ``params`` that are not available now, in ``ds_id`` order."""
    seen, out = set(), []
    for p in _flatten(params):
        if id(p) in seen or not is_zero3_param(p):
            continue
        seen.add(id(p))
        if getattr(p.ds_status, "name", str(p.ds_status)) == "NOT_AVAILABLE":
            out.append(p)
    return sorted(out, key=lambda p: p.ds_id)


def gather(*params) -> list:
    """Gather the parameters that need it (a collective); returns them, for ``release``."""
    todo = partitioned(*params)
    if todo and all(p.ds_tensor.device.type == "cuda" for p in todo):
        todo[0].all_gather(param_list=todo)
    else:
        # One parameter per call elsewhere: for several parameters DeepSpeed 0.15.4 - 0.18.9 start
        # one async all-gather each and wait for the last one only (0.19.8 no longer does), enough on a CUDA stream but
        # not with gloo on CPU, where the others may still be writing when the call returns. Measured on
        # 0.18.9: a head with a bias, gathered together, gave garbage updates in 1-2 of 12-17 cells a run.
        for p in todo:
            p.all_gather(param_list=[p])
    return todo


def release(todo: list) -> None:
    """Partition again exactly what ``gather`` gathered (no collective: each rank keeps its own shard)."""
    if todo:
        todo[0].partition(param_list=todo, has_been_updated=False)


@contextlib.contextmanager
def gathered(*params):
    """Context manager: the ZeRO-3 parameters among ``params`` are whole inside the block.

    Read-only: changes made inside the block are discarded (use ``deepspeed.zero.GatheredParameters`` with
    ``modifier_rank`` to modify). Every rank must enter the block, with the same parameters, even a rank
    with nothing to compute, because gathering is a collective.
    """
    todo = gather(*params)
    try:
        yield
    finally:
        release(todo)


class Hold:
    """Keeps ZeRO-3 parameters gathered in backward until autograd has accumulated their gradient (the chunked losses'
    backward, ``zerofix.losses``, ``zerofix.divergence``: a gradient cannot be accumulated into a 0-element parameter).

    The release runs as a post-hook of each parameter's AccumulateGrad node: those hooks run after
    DeepSpeed's own reduction hook on the same node (registered earlier, at engine construction), so
    DeepSpeed reduces the gradient of a whole parameter and zerofix partitions it afterwards.
    """

    def __init__(self, params_needing_grad, params_read):
        import torch  # the losses that use it import it already; this module itself stays free of it

        self.todo = gather(*params_read, *params_needing_grad)
        self.pending = {id(p) for p in self.todo if p.requires_grad}
        self.handles = []
        with torch.enable_grad():  # backward runs with grad mode off; the node is reached through a view
            for p in self.todo:
                if id(p) in self.pending:
                    node = p.view_as(p).grad_fn.next_functions[0][0]
                    self.handles.append(node.register_hook(self._accumulated(p)))

    def _accumulated(self, p):
        def hook(*_):
            self.pending.discard(id(p))
            if not self.pending:
                self.release()
        return hook

    def release_if_no_grad(self):
        if not self.pending:
            self.release()

    def release(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        todo, self.todo = self.todo, []
        # Partition only what is still whole and not in use by a module DeepSpeed is running (a tied
        # embedding's own backward may hold it too; DeepSpeed releases it then).
        still = [p for p in todo if getattr(p.ds_status, "name", "") == "AVAILABLE"
                 and not getattr(p, "ds_active_sub_modules", None)]
        release(still)

"""``DeepSpeedEngine.backward(self, loss, ..., scale_wrt_gas=True)``: the signature the DeepSpeed fixes that
wrap it rely on, checked once, and the caller's ``scale_wrt_gas`` read from a call's arguments."""
from __future__ import annotations

from zerofix.fixes._inspect import parameter_names
from zerofix.fixes.contract import Check, drifted, found

QUALNAME = "DeepSpeedEngine.backward"
POSITION = "scale_wrt_gas_at"  # the fact check() finds: scale_wrt_gas's index in args (after self)


def check(func, **facts) -> Check:
    """Found (with ``POSITION``, and ``facts``) when backward is ``(self, loss, ..., scale_wrt_gas, ...)``,
    else drifted with what differs."""
    params = parameter_names(func, QUALNAME)
    if params[:2] != ["self", "loss"] or "scale_wrt_gas" not in params:
        return drifted(f"{QUALNAME}{tuple(params)} is not (self, loss, ..., scale_wrt_gas)")
    return found(**{POSITION: params.index("scale_wrt_gas") - 1}, **facts)


def scale_wrt_gas(args, kwargs, position: int) -> bool:
    """The caller's scale_wrt_gas (args without self, as a wrapt wrapper gets them)."""
    return kwargs.get("scale_wrt_gas", args[position] if len(args) > position else True)

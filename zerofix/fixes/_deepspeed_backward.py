"""``DeepSpeedEngine.backward(self, loss, ..., scale_wrt_gas=True)``: the signature the DeepSpeed fixes that
wrap it rely on, checked once, and the caller's ``scale_wrt_gas`` read from a call's arguments."""
from __future__ import annotations

from zerofix.fixes._inspect import parameter_names

QUALNAME = "DeepSpeedEngine.backward"
_position = 2  # index of scale_wrt_gas in backward's positional args (after self), set by check()


def check(func) -> str | None:
    """None when backward is ``(self, loss, ..., scale_wrt_gas, ...)``, else what differs."""
    global _position
    params = parameter_names(func, QUALNAME)
    if params[:2] != ["self", "loss"] or "scale_wrt_gas" not in params:
        return f"{QUALNAME}{tuple(params)} is not (self, loss, ..., scale_wrt_gas)"
    _position = params.index("scale_wrt_gas") - 1
    return None


def scale_wrt_gas(args, kwargs) -> bool:
    """The caller's scale_wrt_gas (args without self, as a wrapt wrapper gets them)."""
    return kwargs.get("scale_wrt_gas", args[_position] if len(args) > _position else True)

"""What the loss does with ``num_items_in_batch``: divided by it, independent of it, or unknown.

The Trainer hands ``num_items_in_batch`` to the model (a loss kwarg), to ``compute_loss_func`` or to a subclass's
``compute_loss``. Whether the loss that comes back is per window (a sum over the window's counted items divided
by their number) or a micro-batch mean decides how it must be scaled, and the Trainer only guesses it from the
forward's signature. This module decides it from behaviour, per Trainer step, in one of three states:

- ``DIVIDED``: the loss scales as one over the count (``sum / n``, after any moves, casts, ``clamp(min=1)``,
  constant factors). Multiplying the count by 0, comparing it, or adding a small term divided by it is not;
- ``INDEPENDENT``: the count never reached the loss, and no part of it left the watch (see below);
- ``UNKNOWN``: anything else. The count became a Python number, a NumPy array, a pickle, a raw memory read, or was
  read where torch shows nothing to Python (``torch.tensor(n)``, TorchScript, a C++ extension, a ``torch.compile``
  region); a count kept from an earlier step was read; or the loss is computed from the count without scaling as
  one over it (``mean + 0 * n``, ``mean * (n > 0)``, ``mean + reg / n``: a divided and an undivided term).

How: ``watch(n)`` starts a step and returns a tensor equal to ``n`` whose torch operations run on the plain
values (bitwise the results ``n`` gives) while their results are followed, each with what it is as a function
of the count: ``n ** p`` times something independent of it (a *power* p), a sum of such terms of different powers
(``Mixed``), or anything else (``None``). ``decide(loss)`` reads the loss's power and the escapes recorded on the
way; ``close()`` ends the step: every tensor the step marked is plain again (a buffer filled from the count, a
running sum, a deep copy the user keeps), and the count object itself, should the user keep it, answers every
operation as a plain tensor would (its class is ``SpentCount``; its reads in a later step are a route the watch
cannot follow: unknown).

What user code sees during a step: the count is an instance of a ``torch.Tensor`` subclass (``isinstance(n,
torch.Tensor)`` holds; ``type(n) is torch.Tensor`` does not), and so is every tensor computed from it until the
step ends. Values, dtypes, devices and autograd graphs are those of plain tensors.

Plain code, no patching: tests/test_num_items_watch.py.
"""
from __future__ import annotations

import weakref
from fractions import Fraction
from typing import NamedTuple

import torch

DIVIDED, INDEPENDENT, UNKNOWN = "divided", "independent", "unknown"


class Verdict(NamedTuple):
    state: str  # DIVIDED, INDEPENDENT or UNKNOWN
    route: str = ""  # for UNKNOWN: what the watch saw that it cannot follow


# ---------------------------------------------------------------------------------------------------------------
# The algebra: what an operation's result is as a function of the count, from what its operands are. Pure.
# A power is a Fraction (the result is count ** power times something independent of the count), a Mixed (a sum of
# such terms with different powers), or None (any other function of the count: a comparison, a log, a rounding).

class Mixed(NamedTuple):
    powers: frozenset  # the powers of the terms
    constants: tuple  # the operands of power 0 (None for a Python number), for decide()'s accountant


ZERO, ONE, MINUS_ONE = Fraction(0), Fraction(1), Fraction(-1)
# The result is its first operand, moved, cast, viewed, reduced or clamped: the same power (a count clamped to at
# least 1 is the count: transformers and TRL guard a division with it).
_SAME = frozenset({
    "to", "type", "float", "double", "half", "bfloat16", "long", "int", "cpu", "cuda", "clone", "detach", "detach_",
    "contiguous", "view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "broadcast_to", "squeeze",
    "unsqueeze", "squeeze_", "unsqueeze_", "flatten", "ravel", "sum", "mean", "nansum", "nanmean", "__getitem__",
    "select", "narrow", "t", "transpose", "permute", "repeat", "abs", "__abs__", "neg", "__neg__", "negative",
    "positive", "__pos__", "clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_", "__get__", "requires_grad_",
    "type_as", "split", "chunk", "unbind", "amax", "amin", "copy_", "new_tensor",
})
_PRODUCT = frozenset({"mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply", "multiply_", "matmul",
                      "__matmul__", "__rmatmul__", "mm", "bmm", "outer", "dot"})
_QUOTIENT = frozenset({"div", "div_", "divide", "divide_", "true_divide", "true_divide_", "__truediv__",
                       "__itruediv__", "__div__", "__idiv__"})
_REVERSE_QUOTIENT = frozenset({"__rtruediv__", "__rdiv__"})
_SUM = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
                  "__isub__", "subtract", "subtract_", "stack", "cat", "concat", "concatenate"})
_POW = frozenset({"pow", "pow_", "__pow__", "__ipow__", "float_power"})
_SCALAR_POWER = {"sqrt": Fraction(1, 2), "rsqrt": Fraction(-1, 2), "reciprocal": Fraction(-1),
                 "reciprocal_": Fraction(-1), "square": Fraction(2)}
# Conversions that take the count's value out of torch: the watch cannot follow it any further.
_ESCAPES = {
    **dict.fromkeys(("item", "tolist", "__float__", "__int__", "__index__", "__bool__", "__complex__"),
                    "a Python number (.item(), float(), int(), .tolist(), a comparison used as a bool)"),
    **dict.fromkeys(("numpy", "__array__", "__array_wrap__"), "a NumPy array"),
    **dict.fromkeys(("data_ptr", "untyped_storage", "storage", "_typed_storage", "__dlpack__"),
                    "a raw read of its memory (data_ptr, storage, DLPack)"),
    "__reduce_ex__": "a pickle",
}
CPP_READ = "a read torch does not show to Python (torch.tensor(n), TorchScript, a C++ extension)"
COMPILED = "an input of a torch.compile region"
KEPT = "a count kept from an earlier step"


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Constant(NamedTuple):
    """An operand that is no function of the count: a tensor the step did not mark (``ref``: the tensor, held until
    the step ends: a sum's term is often a temporary), or a Python number (``ref`` None). Power 0; kept apart in a
    sum for ``decide``'s accountant."""
    ref: object = None


OTHER = "other"  # an argument that is no value: a dtype, a device, a dimension, a string


def combine(name: str, operands: list):
    """What ``name``'s result is as a function of the count, from its operands in call order. Each operand is a
    power (Fraction), a Mixed, None (some other function of the count), a Constant or OTHER; so is the result (a
    Constant result is no function of the count: ``x.to(n)``, ``x.type_as(n)``)."""
    if not operands:
        return None
    if name in _SAME:
        return operands[0]
    if name in _SCALAR_POWER:
        return _scaled(operands[0], _SCALAR_POWER[name])
    if name in _POW:
        exponent = operands[1] if len(operands) > 1 else None
        return _scaled(operands[0], exponent) if isinstance(exponent, Fraction) else None
    terms = [t for t in operands if t is not OTHER]
    if name in _PRODUCT or name in _QUOTIENT or name in _REVERSE_QUOTIENT:
        if len(terms) != 2:
            return None
        a, b = terms
        if name in _QUOTIENT:
            b = _scaled(b, Fraction(-1))
        elif name in _REVERSE_QUOTIENT:  # other / self
            a, b = b, _scaled(a, Fraction(-1))
        return _product(a, b)
    if name in _SUM:
        return _sum(terms)
    return None


def _scaled(power, k: Fraction):
    """count ** (power * k): a monomial's power times k; a constant stays one; a mixed sum only times 1."""
    if isinstance(power, Constant):
        return power
    if isinstance(power, Fraction):
        return power * k
    if isinstance(power, Mixed) and k == 1:
        return power
    return None


def _product(a, b):
    if isinstance(a, Constant) and isinstance(b, Constant):
        return a
    a = ZERO if isinstance(a, Constant) else a
    b = ZERO if isinstance(b, Constant) else b
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a + b
    if isinstance(a, Mixed) and b == ZERO:  # a sum of terms times something independent: the same terms
        return a
    if isinstance(b, Mixed) and a == ZERO:
        return b
    return None


def _sum(terms):
    if any(t is None or t is OTHER for t in terms):
        return None
    if all(isinstance(t, Constant) for t in terms):
        return terms[0]
    powers, constants = set(), []
    for t in terms:
        if isinstance(t, Mixed):
            powers |= t.powers
            constants.extend(t.constants)
        elif isinstance(t, Constant):
            powers.add(ZERO)
            constants.append(t.ref)
        else:
            powers.add(t)
    if len(powers) == 1:
        return next(iter(powers))
    return Mixed(frozenset(powers), tuple(constants))


# ---------------------------------------------------------------------------------------------------------------
# The watch: one per Trainer step.

class _Counter:
    n = 0


# Reads of a watched tensor that torch.compile traced: an attribute of an instance, a side effect Dynamo records and
# replays at every call of the compiled function (measured with the eager backend, fullgraph=True)
_COMPILED_READS = _Counter()


class _Step:
    def __init__(self):
        self.marks: dict[int, tuple] = {}  # id(tensor) -> (weak reference, what it is as a function of the count)
        self.escapes: list[str] = []
        self.open = True  # until decide(): reads after the verdict (the backward's saved count) change nothing
        self.compiled_before = _COMPILED_READS.n


_live: _Step | None = None
_inside = 0  # > 0 while the watch runs an operation itself (its kernels' reads of the count are no escape)
_UNMARKED = object()
_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def _escape(route: str) -> None:
    if _live is not None and _live.open and route not in _live.escapes:
        _live.escapes.append(route)


def _power(tensor):
    """What the step knows ``tensor`` to be as a function of the count, or _UNMARKED."""
    if _live is None or not isinstance(tensor, torch.Tensor):
        return _UNMARKED
    entry = _live.marks.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else _UNMARKED


def _mark(tensor, power) -> None:
    """Follow ``tensor`` from now on *as the same object*: its class changes, no alias is made (an alias is a view in
    autograd's eyes, and the Trainer's ``loss *= ...`` on a view of DDP's output raises). A tensor of another subclass
    (a Parameter, a DTensor) keeps its class and is followed by identity."""
    if type(tensor) is torch.Tensor:
        tensor.__class__ = _Watched
    _live.marks[id(tensor)] = (weakref.ref(tensor), power)


def _operand(x):
    if isinstance(x, torch.Tensor):
        p = _power(x)
        return Constant(x) if p is _UNMARKED else p
    if _is_number(x):
        return Constant(None)
    return OTHER


def _operands(name, args, kwargs):
    """The operands of an operation in call order, a list or tuple argument flattened (torch.stack, torch.cat); a
    Python exponent of pow as the Fraction it is."""
    flat = []
    for a in list(args) + [v for k, v in kwargs.items() if k != "out"]:
        flat.extend(a if isinstance(a, (list, tuple)) else (a,))
    out = [_operand(x) for x in flat]
    if name in _POW and len(flat) > 1 and _is_number(flat[1]):
        out[1] = Fraction(flat[1]).limit_denominator(64)
    return out


def _result(name, args, kwargs):
    if name == "__get__":  # .data, .T, .mT, .real: the tensor read from
        return _operand(args[0]) if args else None
    if name == "copy_" and len(args) > 1:  # the target takes the source's value
        return _operand(args[1])
    if name == "new_tensor":
        return _operand(args[1]) if len(args) > 1 else None
    return combine(name, _operands(name, args, kwargs))


class _Watched(torch.Tensor):
    """A tensor computed from the count during a step: its operations are followed."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        global _inside
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # traced by Dynamo: nothing here can be followed; this side effect replays
            _COMPILED_READS.n += 1
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        live = _live is not None and _live.open
        if name in _ESCAPES:
            if live:
                _escape(_ESCAPES[name])
            args = tuple(_plain(a) if isinstance(a, _Count) else a for a in args)  # NumPy refuses a dispatch key
        _inside += 1
        try:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
        finally:
            _inside -= 1
        if not live or not isinstance(result, (torch.Tensor, tuple, list)):
            return result  # .shape, .device, .dtype, .requires_grad, a Python value: nothing to follow
        power = _result(name, args, kwargs)
        if isinstance(power, Constant) or power is OTHER:
            return result  # x.to(n), x.type_as(n): no function of the count
        for target in _in_place_targets(name, args, kwargs):
            _mark(target, power)
        if isinstance(result, torch.Tensor):
            return _follow(result, power)
        if any(isinstance(t, torch.Tensor) for t in result):
            return type(result)([_follow(t, power) if isinstance(t, torch.Tensor) else t for t in result])
        return result

    @staticmethod
    def zerofix_value(tensor):
        """The value as a Python number, for a read that only validates (zerofix's own chunked loss checks the count
        it then divides by as a tensor): no route into the loss, so no escape."""
        return _run_plain(torch.ops.aten._local_scalar_dense.default, (tensor,), {})

    # A copy stays followed for the rest of the step (a deep copy handed to the model divides as the count does);
    # pickling takes the value out of torch.
    def __deepcopy__(self, memo):
        copied = _plain(self).__deepcopy__(memo)
        power = _power(self)
        if _live is not None and _live.open and power is not _UNMARKED:
            return _follow(copied, power)
        return copied

    def __reduce_ex__(self, protocol):
        _escape(_ESCAPES["__reduce_ex__"])
        return _plain(self).__reduce_ex__(protocol)


def _follow(tensor, power):
    """``tensor`` followed, as the same object (its class changes back at ``close``)."""
    if not isinstance(tensor, _Spent):
        _mark(tensor, power)
    return tensor


def _in_place_targets(name, args, kwargs):
    """``loss.div_(n)``, ``loss /= n`` and ``torch.div(loss, n, out=loss)`` change a tensor the caller keeps: it is
    followed from then on (a Parameter keeps its class)."""
    in_place = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
    target = kwargs.get("out") if "out" in kwargs else (args[0] if in_place and args else None)
    return [t for t in (target if isinstance(target, (tuple, list)) else (target,)) if isinstance(t, torch.Tensor)]


class _Count(_Watched):
    """The count itself, during its step: every read of it reaches the watch, also a read from C++ that torch does not
    show to Python (its dispatch key makes the dispatcher call ``__torch_dispatch__``)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if not _inside:
            _escape(CPP_READ)
        return _run_plain(func, args, kwargs)


class _Spent(torch.Tensor):
    """A count whose step has ended (``SpentCount``): plain in every operation. Its dispatch key cannot be taken off,
    so the dispatcher still calls ``__torch_dispatch__``, which runs the plain kernel; a read of it during a later
    step is a route that step cannot follow."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _ESCAPES:  # NumPy refuses a dispatch key: a plain copy converts
            args = tuple(_plain(a) if isinstance(a, _Spent) else a for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if not _inside:
            _escape(KEPT)
        return _run_plain(func, args, kwargs)

    def __deepcopy__(self, memo):
        return _plain(self).__deepcopy__(memo)

    def __reduce_ex__(self, protocol):
        return _plain(self).__reduce_ex__(protocol)


SpentCount = _Spent


def _run_plain(func, args, kwargs):
    global _inside
    _inside += 1
    try:
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS), torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    finally:
        _inside -= 1


def _plain(tensor):
    """A plain tensor with ``tensor``'s value (an alias; a copy for the count, whose dispatch key an alias keeps)."""
    if isinstance(tensor, (_Count, _Spent)):
        return _run_plain(torch.ops.aten.clone.default, (tensor,), {})
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


# ---------------------------------------------------------------------------------------------------------------
# The step's API.

def watch(num_items):
    """Start a step: a tensor equal to ``num_items`` whose results are followed (the Trainer's own count stays
    plain); ``num_items`` itself when it is not a tensor (``None``; an int: see ``as_tensor_like_release``)."""
    global _live
    close()
    if not isinstance(num_items, torch.Tensor):
        return num_items
    root = torch.Tensor._make_subclass(_Count, num_items.detach())  # shares the storage: no copy, no graph
    _live = _Step()
    _live.marks[id(root)] = (weakref.ref(root), ONE)
    return root


def decide(loss, accounted=lambda tensor: False) -> Verdict:
    """This step's verdict on ``loss``; reads after it change nothing. ``accounted(t)``: whether an undivided term
    ``t`` of the loss is handled by another fix (the MoE router term: transformers-moe-aux-loss), so that a loss of
    divided terms plus such terms is still divided."""
    step = _live
    if step is None:
        return Verdict(UNKNOWN, "not watched")
    step.open = False
    if _COMPILED_READS.n != step.compiled_before:
        step.escapes.append(COMPILED)
    power = _power(loss)
    if step.escapes:
        return Verdict(UNKNOWN, "the count left the watch as " + " and ".join(step.escapes))
    if power is _UNMARKED:
        return Verdict(INDEPENDENT)
    if power == MINUS_ONE:
        return Verdict(DIVIDED)
    if isinstance(power, Mixed) and power.powers == frozenset({MINUS_ONE, ZERO}) and power.constants and all(
            term is not None and accounted(term) for term in power.constants):
        return Verdict(DIVIDED)
    return Verdict(UNKNOWN, "the loss is computed from the count but does not scale as one over it "
                   f"({_describe(power)})")


def _describe(power) -> str:
    if isinstance(power, Mixed):
        return "a sum of terms in count ** " + ", ".join(str(p) for p in sorted(power.powers))
    if isinstance(power, Fraction):
        return f"count ** {power}"
    return "a comparison, rounding or other function of it"


def close() -> None:
    """End the step: every tensor it marked is plain again; the count itself, if kept, is a SpentCount."""
    global _live
    step, _live = _live, None
    if step is None:
        return
    for ref, _ in step.marks.values():
        tensor = ref()
        if type(tensor) is _Count:
            tensor.__class__ = _Spent
        elif type(tensor) is _Watched:
            tensor.__class__ = torch.Tensor


def unwatched(value):
    """``value`` itself, a plain tensor again (the same object: storage and autograd history untouched); anything
    else as it is."""
    if type(value) is _Watched:
        value.__class__ = torch.Tensor
    elif isinstance(value, (_Count, _Spent)):  # a result without a graph, followed as an alias: its plain copy
        return _plain(value)
    return value


def as_tensor_like_release(num_items):
    """transformers 4.46-4.48 hand an int to the loss: watch it as a 0-dim int64 tensor (dividing a float tensor by
    it gives bitwise the same value; tests/test_num_items_watch.py)."""
    if isinstance(num_items, int) and not isinstance(num_items, bool):
        return torch.tensor(num_items, dtype=torch.int64)
    return num_items

"""What the loss does with ``num_items_in_batch``: divided by it, independent of it, or unknown.

The Trainer hands ``num_items_in_batch`` to the model (a loss kwarg), to ``compute_loss_func`` or to a subclass's
``compute_loss``. Whether the loss that comes back is per window (a sum over the window's counted items divided
by their number) or a micro-batch mean decides how it must be scaled, and the Trainer only guesses it from the
forward's signature. This module decides it from behaviour, per Trainer step, in one of three states:

- ``DIVIDED``: the loss scales as one over the count (``sum / n``, after any moves, casts, ``clamp(min=1)``,
  constant factors), also through the identities real code writes (below). Multiplying the count by 0, comparing it,
  or adding a small term divided by it is not;
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

The identities of a division (issue 51): a term that adds nothing is no term, so a sum started from a Python ``0``
(``tot = 0; tot += c / n``, Python's ``sum``), from ``n.new_zeros(())`` or plus ``torch.zeros_like(n)`` has the power of
its other terms (a zero built *from the count's shape*, ``new_zeros`` / ``zeros_like``, holds no function of its
value); a count bounded below (``clamp(min=1)``, ``torch.maximum(n, ones)``) is the count; a count plus a Python
constant of at most 1e-3 (``n + 1e-8``) is the count to within 1e-3 of a count of at least one; ``nan_to_num`` is the
identity on a finite value; ``torch.where(n > 0, s / n, other)`` (also ``n >= 1``, ``n != 0``, and ``if n > 0:``) is
its divided branch wherever the count is positive. What stays unknown: a term computed from the count whose value is
not a constant zero (``mean + 0 * n``: a function of the count, even if it is zero), a product with a comparison
(``mean * (n > 0)``), and a small term divided by the count added to an undivided mean (``mean + reg / n``): a sum of
terms of two powers. Each monomial also carries its Python-number factor (``s / n * 4`` is ``4 * n ** -1``, so is
``s / (n / 4)``): the Trainer entry reads a factor of exactly ``gradient_accumulation_steps`` as a hand fix of a
double division (issue 51, item 3).

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

from zerofix.count_terms import (GUARD, MINUS_ONE, ONE, OTHER, POW, SUM, ZERO, Constant, Mixed, Term, combine_terms,
                                 fraction, is_number)

DIVIDED, INDEPENDENT, UNKNOWN = "divided", "independent", "unknown"


class Verdict(NamedTuple):
    state: str  # DIVIDED, INDEPENDENT or UNKNOWN
    route: str = ""  # for UNKNOWN: what the watch saw that it cannot follow
    factor: object = None  # for DIVIDED: the Python-number factor of ``n ** -1`` (a Fraction; None: unknown)


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
        # escapes of a value that was already the loss (a compute_loss that logs float(loss)): (route, the tensor's
        # weak reference, its autograd node then), dropped by decide() where that tensor is on the loss's last chain
        self.read_out: list[tuple] = []
        self.open = True  # until decide(): reads after the verdict (the backward's saved count) change nothing
        self.compiled_before = _COMPILED_READS.n


_live: _Step | None = None
_inside = 0  # > 0 while the watch runs an operation itself (its kernels' reads of the count are no escape)
_UNMARKED = object()
_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def _escape(route: str, tensor=None) -> None:
    if _live is None or not _live.open:
        return
    if tensor is not None:  # kept aside: decide() knows whether it was the loss itself
        _live.read_out.append((route, weakref.ref(tensor), tensor.grad_fn))
    elif route not in _live.escapes:
        _live.escapes.append(route)


def _on_the_loss(loss, ref, node, depth: int = 4) -> bool:
    """Whether a tensor whose value left the watch is the loss itself, or its value before the loss's last scalings
    (the Trainer's ``loss / gas``: operations of one tensor input): the value it read out was computed from the loss's
    own last value, so it cannot have entered it."""
    if ref() is loss:
        return True
    current = getattr(loss, "grad_fn", None)
    for _ in range(depth):
        if current is None or node is None:
            return False
        if current is node:
            return True
        inputs = [n for n, _ in current.next_functions if n is not None]
        current = inputs[0] if len(inputs) == 1 else None
    return False


def _power(tensor):
    """What the step knows ``tensor`` to be as a function of the count (a Term), or _UNMARKED."""
    if _live is None or not isinstance(tensor, torch.Tensor):
        return _UNMARKED
    entry = _live.marks.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else _UNMARKED


def _mark(tensor, term: Term) -> None:
    """Follow ``tensor`` from now on *as the same object*: its class changes, no alias is made (an alias is a view in
    autograd's eyes, and the Trainer's ``loss *= ...`` on a view of DDP's output raises). A tensor of another subclass
    (a Parameter, a DTensor) keeps its class and is followed by identity."""
    if type(tensor) is torch.Tensor:
        tensor.__class__ = _Watched
    _live.marks[id(tensor)] = (weakref.ref(tensor), term)


def _operand(x, summed: bool = False) -> Term:
    """``x`` as a Term. ``summed``: an operand of a sum, whose constants are asked whether they are exactly zero (a
    term that adds nothing); read before the operation runs, so an in-place sum asks of the value it starts from. A
    constant's factor is its value where it has one: a Python number, or a one-element tensor without a gradient
    (``torch.tensor(4.0)`` is read as ``4`` is, issue 69); anything else is part of what is independent of the
    count (factor 1)."""
    if isinstance(x, torch.Tensor):
        term = _power(x)
        if term is not _UNMARKED:
            return term
        value = constant_value(x)
        return Term(Constant(x, zero=summed and _is_zero(x)), ONE if value is None else fraction(value))
    if is_number(x):
        return Term(Constant(None, zero=x == 0, value=x), fraction(x))
    return Term(OTHER, None)


def constant_value(value) -> float | None:
    """The number a constant stands for: a Python number, or the value of a one-element tensor without a gradient
    (what ``loss / 4``, ``loss * torch.tensor(4.0)`` and the Trainer's ``loss *= num_processes`` save); None for
    anything else. The one reading of a constant factor: the watch's factor of a divided loss and the Trainer entry's
    last scalings of an independent one both use it, so ``* 4`` and ``* torch.tensor(4.0)`` are one coincidence
    (``zerofix.decision``)."""
    global _inside
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or value.device.type == "meta" or value.is_complex():
            return None
        _inside += 1
        try:
            with torch._C.DisableTorchFunctionSubclass():
                value = value.detach().item()
        finally:
            _inside -= 1
    return float(value) if is_number(value) else None


def _is_zero(tensor) -> bool:
    global _inside
    _inside += 1
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return not bool(tensor.detach().count_nonzero())
    finally:
        _inside -= 1


def _operands(name, args, kwargs):
    """The operands of an operation in call order, a list or tuple argument flattened (torch.stack, torch.cat); a
    Python exponent of pow as the Fraction it is."""
    flat = []
    for a in list(args) + [v for k, v in kwargs.items() if k != "out"]:
        flat.extend(a if isinstance(a, (list, tuple)) else (a,))
    summed = name in SUM
    out = [_operand(x, summed) for x in flat]
    if name in POW and len(flat) > 1 and is_number(flat[1]):
        out[1] = Term(Fraction(flat[1]).limit_denominator(64), None)
    return out


def _result(name, args, kwargs) -> Term:
    if name == "__get__":  # .data, .T, .mT, .real: the tensor read from
        return _operand(args[0]) if args else Term(None, None)
    if name == "copy_" and len(args) > 1:  # the target takes the source's value
        return _operand(args[1])
    if name == "new_tensor":
        return _operand(args[1]) if len(args) > 1 else Term(None, None)
    return combine_terms(name, _operands(name, args, kwargs))


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
            # ``if n > 0:`` reads a comparison true wherever the count is positive: it picks a branch, no value leaves
            if live and not (name == "__bool__" and args and _power(args[0]) is not _UNMARKED
                             and _power(args[0]).power is GUARD):
                # a value already divided by the count (the loss logged as a number) may be the loss itself: kept aside
                read = args[0] if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], _Count) and \
                    _power(args[0]) is not _UNMARKED and _power(args[0]).power == MINUS_ONE else None
                _escape(_ESCAPES[name], read)
            args = tuple(_plain(a) if isinstance(a, _Count) else a for a in args)  # NumPy refuses a dispatch key
        # what the result is, from the operands as they are before the operation (an in-place sum changes its first)
        term = _result(name, args, kwargs) if live and name not in _ESCAPES else None
        _inside += 1
        try:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
        finally:
            _inside -= 1
        if term is None or not isinstance(result, (torch.Tensor, tuple, list)):
            return result  # .shape, .device, .dtype, .requires_grad, a Python value: nothing to follow
        if isinstance(term.power, Constant) or term.power is OTHER:
            return result  # x.to(n), x.type_as(n), torch.zeros_like(n): no function of the count
        for target in _in_place_targets(name, args, kwargs):
            _mark(target, term)
        if isinstance(result, torch.Tensor):
            return _follow(result, term)
        if any(isinstance(t, torch.Tensor) for t in result):
            return type(result)([_follow(t, term) if isinstance(t, torch.Tensor) else t for t in result])
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
        term = _power(self)
        if _live is not None and _live.open and term is not _UNMARKED:
            return _follow(copied, term)
        return copied

    def __reduce_ex__(self, protocol):
        _escape(_ESCAPES["__reduce_ex__"])
        return _plain(self).__reduce_ex__(protocol)


def _follow(tensor, term: Term):
    """``tensor`` followed, as the same object (its class changes back at ``close``)."""
    if not isinstance(tensor, _Spent):
        _mark(tensor, term)
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
    _live.marks[id(root)] = (weakref.ref(root), Term(ONE, ONE))
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
    term = _power(loss)
    for route, ref, node in step.read_out:
        if not _on_the_loss(loss, ref, node) and route not in step.escapes:
            step.escapes.append(route)
    if step.escapes:
        return Verdict(UNKNOWN, "the count left the watch as " + " and ".join(step.escapes))
    if term is _UNMARKED:
        return Verdict(INDEPENDENT)
    power = term.power
    if power == MINUS_ONE:
        return Verdict(DIVIDED, factor=term.factor)
    if isinstance(power, Mixed) and power.powers == frozenset({MINUS_ONE, ZERO}) and power.constants and all(
            t is not None and accounted(t) for t in power.constants):
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

"""The algebra of the count (issue 68: out of ``zerofix.num_items_watch``, which applies it): what an operation's result
is as a function of ``num_items_in_batch``, from what its operands are. Pure Python, no torch: a tensor operand that is
no function of the count is only carried (``Constant.ref``), never read.

A power is a Fraction (the result is count ** power times something independent of the count), a Mixed (a sum of
such terms with different powers), GUARD (a comparison that is true wherever the count is positive), or None (any
other function of the count: a comparison, a log, a rounding). Beside its power, a monomial carries its factor: the
product of the Python numbers it was multiplied or divided by (None where unknown: a sum of unequal factors).
"""
from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple


class Mixed(NamedTuple):
    powers: frozenset  # the powers of the terms
    constants: tuple  # the operands of power 0 (None for a Python number), for decide()'s accountant


ZERO, ONE, MINUS_ONE = Fraction(0), Fraction(1), Fraction(-1)
GUARD = "positive"  # n > 0, n >= 1, n != 0: selects the same branch wherever the count is positive
# The result is its first operand, moved, cast, viewed, reduced or clamped: the same power (a count clamped to at
# least 1 is the count: transformers and TRL guard a division with it; nan_to_num is the identity on a finite value).
_SAME = frozenset({
    "to", "type", "float", "double", "half", "bfloat16", "long", "int", "cpu", "cuda", "clone", "detach", "detach_",
    "contiguous", "view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "broadcast_to", "squeeze",
    "unsqueeze", "squeeze_", "unsqueeze_", "flatten", "ravel", "sum", "mean", "nansum", "nanmean", "__getitem__",
    "select", "narrow", "t", "transpose", "permute", "repeat", "abs", "__abs__", "neg", "__neg__", "negative",
    "positive", "__pos__", "clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_", "__get__", "requires_grad_",
    "type_as", "split", "chunk", "unbind", "amax", "amin", "copy_", "new_tensor", "nan_to_num", "nan_to_num_",
})
_NEGATING = frozenset({"neg", "__neg__", "negative"})
# A count bounded below by a constant (torch.maximum(n, torch.ones_like(n))): the count, as clamp(min=...) is.
_BOUND = frozenset({"maximum", "fmax"})
# Results that hold no function of the count's value: built from its shape, dtype and device only.
_VALUE_FREE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                         "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"})
_PRODUCT = frozenset({"mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply", "multiply_", "matmul",
                      "__matmul__", "__rmatmul__", "mm", "bmm", "outer", "dot"})
_QUOTIENT = frozenset({"div", "div_", "divide", "divide_", "true_divide", "true_divide_", "__truediv__",
                       "__itruediv__", "__div__", "__idiv__"})
_REVERSE_QUOTIENT = frozenset({"__rtruediv__", "__rdiv__"})
SUM = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
                  "__isub__", "subtract", "subtract_", "stack", "cat", "concat", "concatenate"})
POW = frozenset({"pow", "pow_", "__pow__", "__ipow__", "float_power"})
_SCALAR_POWER = {"sqrt": Fraction(1, 2), "rsqrt": Fraction(-1, 2), "reciprocal": Fraction(-1),
                 "reciprocal_": Fraction(-1), "square": Fraction(2)}
# Comparisons of the count with a constant that hold wherever the count is positive: (name, constant) -> test.
_GUARDS = {**dict.fromkeys(("gt", "__gt__", "greater"), lambda c: c == 0),
           **dict.fromkeys(("ge", "__ge__", "greater_equal"), lambda c: 0 < c <= 1),
           **dict.fromkeys(("ne", "__ne__", "not_equal"), lambda c: c == 0)}
# A Python constant added to a positive power of the count (a count of at least one) that moves it by at most this
# fraction: ``n + 1e-8``, ``n + eps`` is the count.
NEGLIGIBLE = 1e-3


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Constant(NamedTuple):
    """An operand that is no function of the count: a tensor the step did not mark (``ref``: the tensor, held until
    the step ends: a sum's term is often a temporary), or a Python number (``ref`` None, ``value`` the number).
    Power 0; kept apart in a sum for ``decide``'s accountant. ``zero``: its value is exactly zero (a term that adds
    nothing; read only for a sum's operands)."""
    ref: object = None
    zero: bool = False
    value: object = None


OTHER = "other"  # an argument that is no value: a dtype, a device, a dimension, a string


class Term(NamedTuple):
    """What a result is as a function of the count (``power``: see ``combine``) and its Python-number factor (a
    Fraction, or None where unknown)."""
    power: object
    factor: Fraction | None = ONE


def combine(name: str, operands: list):
    """What ``name``'s result is as a function of the count, from its operands in call order. Each operand is a
    power (Fraction), a Mixed, GUARD, None (some other function of the count), a Constant or OTHER; so is the result
    (a Constant result is no function of the count: ``x.to(n)``, ``x.type_as(n)``, ``torch.zeros_like(n)``)."""
    return combine_terms(name, [t if isinstance(t, Term) else Term(t, _factor_of(t)) for t in operands]).power


def _factor_of(operand):
    if isinstance(operand, Constant):
        return fraction(operand.value) if operand.ref is None and operand.value is not None else ONE
    return ONE if isinstance(operand, (Fraction, Mixed)) else None


def fraction(x) -> Fraction | None:
    try:
        return Fraction(x).limit_denominator(10 ** 6)
    except (TypeError, ValueError, OverflowError):  # inf, nan
        return None


def combine_terms(name: str, operands: list) -> Term:
    """``combine`` with factors: each operand a Term, the result a Term."""
    if not operands:
        return Term(None, None)
    if name in _VALUE_FREE:
        return Term(Constant(), ONE)
    first = operands[0]
    if name in _SAME:
        factor = first.factor
        if factor is not None and name in _NEGATING:
            factor = -factor
        elif name in ("abs", "__abs__") and factor is not None:
            factor = abs(factor)
        return Term(first.power, factor)
    if name in _BOUND:
        rest = [t.power for t in operands[1:] if t.power is not OTHER]
        if all(isinstance(p, Constant) for p in rest):
            return first
        return Term(None, None)
    if name in _GUARDS:
        if (len(operands) > 1 and isinstance(first.power, Fraction) and first.power > 0
                and first.factor is not None and first.factor > 0 and isinstance(operands[1].power, Constant)
                and is_number(operands[1].power.value) and _GUARDS[name](operands[1].power.value)):
            return Term(GUARD, None)
        return Term(None, None)
    if name == "where":
        return _where(operands)
    if name in _SCALAR_POWER:
        k = _SCALAR_POWER[name]
        factor = 1 / first.factor if k == MINUS_ONE and first.factor else None
        return Term(_scaled(first.power, k), factor)
    if name in POW:
        exponent = operands[1].power if len(operands) > 1 else None
        if not isinstance(exponent, Fraction):
            return Term(None, None)
        factor = first.factor ** int(exponent) if first.factor and exponent.denominator == 1 else None
        return Term(_scaled(first.power, exponent), factor)
    terms = [t for t in operands if t.power is not OTHER]
    if name in _PRODUCT or name in _QUOTIENT or name in _REVERSE_QUOTIENT:
        if len(terms) != 2:
            return Term(None, None)
        (a, fa), (b, fb) = terms
        if name in _QUOTIENT:
            b, fb = _scaled(b, MINUS_ONE), (1 / fb if fb else None)
        elif name in _REVERSE_QUOTIENT:  # other / self
            a, fa, b, fb = b, fb, _scaled(a, MINUS_ONE), (1 / fa if fa else None)
        return Term(_product(a, b), fa * fb if fa is not None and fb is not None else None)
    if name in SUM:
        return _sum(terms)
    return Term(None, None)


def _where(operands) -> Term:
    """torch.where(n > 0, a, b) (also Tensor.where(a, n > 0, b)): the branch taken wherever the count is positive."""
    powers = [t.power for t in operands]
    if len(operands) == 3 and powers[0] is GUARD:
        return operands[1]
    if len(operands) == 3 and powers[1] is GUARD:
        return operands[0]
    return Term(None, None)


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


def _negligible(term: Term, others) -> bool:
    """A Python constant of at most NEGLIGIBLE added to positive powers of the count only (``n + 1e-8``)."""
    c = term.power
    return (c.ref is None and is_number(c.value) and abs(c.value) <= NEGLIGIBLE and bool(others)
            and all(isinstance(t.power, Fraction) and t.power > 0 for t in others))


def _sum(terms) -> Term:
    if any(not isinstance(t.power, (Fraction, Mixed, Constant)) for t in terms):
        return Term(None, None)
    if all(isinstance(t.power, Constant) for t in terms):
        return terms[0]
    # a term that adds nothing is no term: a constant zero, or a negligible constant added to the count
    marked = [t for t in terms if not isinstance(t.power, Constant)]
    terms = marked + [t for t in terms if isinstance(t.power, Constant)
                      and not t.power.zero and not _negligible(t, marked)]
    powers, constants = set(), []
    for t in terms:
        if isinstance(t.power, Mixed):
            powers |= t.power.powers
            constants.extend(t.power.constants)
        elif isinstance(t.power, Constant):
            powers.add(ZERO)
            constants.append(t.power.ref)
        else:
            powers.add(t.power)
    if len(powers) == 1:
        factors = {t.factor for t in terms}
        return Term(next(iter(powers)), factors.pop() if len(factors) == 1 else None)
    return Term(Mixed(frozenset(powers), tuple(constants)), None)

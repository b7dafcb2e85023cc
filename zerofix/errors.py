"""zerofix's own exception types. A leaf, so that every place that must recognise one (the import hooks,
the start-up bootstrap, activation) tests ``isinstance`` against the same class."""
from __future__ import annotations


class StrictError(RuntimeError):
    """A fix was not applied (its target changed, or applying it failed) while ``strict=True`` /
    ``ZEROFIX_STRICT=1`` asked for an error instead of a warning. Raised from ``patch()``, and from the import
    that triggered the fix: the one exception zerofix's import hooks let through."""

"""zerofix: numerically correct distributed training on the library versions people pin.

``import zerofix`` is cheap: it imports no torch, deepspeed, transformers, accelerate or trl. The
public functions load their modules on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "status", "StrictError", "__version__"]


def patch(fixes=None, exclude=(), *, strict=None):
    """Enable zerofix's fixes (all by default; ``fixes``/``exclude`` take lists of fix ids).

    Each fix is applied only where its library is installed and its version is in the affected range;
    fixes for libraries not imported yet are applied when their defining submodule is imported.
    Returns the status records. Calling it twice is a no-op. Unknown ids raise ``ValueError``.
    """
    from zerofix import patching

    patching.patch(fixes, exclude, strict=strict)
    return patching.status()


def unpatch(fixes=None):
    """Disable fixes (all by default) and restore exactly the attributes that were there."""
    from zerofix import patching

    patching.unpatch(fixes)
    return patching.status()


def status():
    """One record per known fix: id, state, dist, installed version, affected range, reason."""
    from zerofix import patching

    return patching.status()


def __getattr__(name):
    if name == "StrictError":
        from zerofix.patching import StrictError

        return StrictError
    raise AttributeError(f"module 'zerofix' has no attribute {name!r}")

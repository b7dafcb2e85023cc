"""zerofix bootstrap, put first on PYTHONPATH by ``zerofix run``.

Its presence on PYTHONPATH is the activation: every Python process below the launcher (torchrun,
deepspeed and accelerate ranks, on other nodes too, since launchers forward PYTHON* variables) is
patched even where ZEROFIX itself was not forwarded. ``ZEROFIX=0`` still turns it off. Afterwards
it runs the sitecustomize module it shadows, if there is one.
"""
import os
import sys


def _activate():
    try:
        from zerofix.activation import autopatch
        from zerofix.errors import StrictError
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
        sys.stderr.write(f"zerofix: warning: bootstrap could not import zerofix: {exc!r}\n")
        return
    try:
        autopatch(default_on=True)
    except StrictError:
        raise
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
        sys.stderr.write(f"zerofix: warning: bootstrap could not activate zerofix: {exc!r}\n")


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    positions = [i for i, p in enumerate(sys.path) if os.path.abspath(p or os.curdir) == here]
    mine = sys.modules.pop("sitecustomize", None)
    for i in reversed(positions):
        del sys.path[i]
    try:
        import sitecustomize  # noqa: F401 - the module this one shadows
    except ImportError as exc:
        if exc.name != "sitecustomize":
            sys.stderr.write(f"zerofix: warning: the chained sitecustomize failed: {exc!r}\n")
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    finally:
        for i in positions:
            sys.path.insert(min(i, len(sys.path)), here)


_activate()
_chain()

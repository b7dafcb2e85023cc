"""Post-import hooks: run a callback right after a named module finishes importing.

Why not ``wrapt.register_post_import_hook``: wrapt 2.x imports asyncio and costs ~80 ms, which every
Python process would pay at start-up when ``ZEROFIX=1`` activates zerofix through the ``.pth`` file.
This finder costs nothing until a watched module is imported; wrapt itself is imported only when a fix
is applied, by which time the ML library being patched has taken seconds to import.
"""
from __future__ import annotations

import sys
import threading

_hooks: dict[str, list] = {}
_reload_hooks: dict[str, list] = {}  # persistent: importlib.reload re-runs a module, these run after
_lock = threading.RLock()
_resolving: set[str] = set()


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (at once if it already is).

    Hooks cannot be unregistered (an import may be under way in another thread); callbacks re-check
    whatever live state decides whether they still apply.
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(callback)
            _install_finder()
            return
    _run(callback, module)


def when_reloaded(name: str, callback) -> None:
    """Call ``callback(module)`` each time ``importlib.reload`` re-executes ``name``. Reload finds the
    module's spec again through ``sys.meta_path`` with the old module as ``target``: that is the cue."""
    with _lock:
        _reload_hooks.setdefault(name, []).append(callback)
        _install_finder()


def _run(callback, module) -> None:
    try:
        callback(module)
    except Exception as exc:  # a hook never breaks the user's import; the callback records its failure
        from zerofix.errors import StrictError

        if isinstance(exc, StrictError):  # ... unless the user asked for that (strict mode)
            raise


def _fire(name: str, module) -> None:
    with _lock:
        callbacks = _hooks.pop(name, [])
    for callback in callbacks:
        _run(callback, module)


class _HookedLoader:
    """Delegates to the real loader and fires the hooks once the module body has run."""

    def __init__(self, loader, name: str, reload: bool = False):
        self._loader = loader
        self._name = name
        self._reload = reload

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # Put the real loader back first, so inspect/pkgutil/linecache see the usual object.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if self._reload:
            with _lock:
                callbacks = list(_reload_hooks.get(self._name, ()))
            for callback in callbacks:
                _run(callback, module)
        else:
            _fire(self._name, sys.modules.get(self._name, module))


class _PostImportFinder:
    def find_spec(self, fullname, path=None, target=None):
        reload = target is not None and fullname in _reload_hooks and sys.modules.get(fullname) is target
        if (fullname not in _hooks and not reload) or fullname in _resolving:
            return None
        _resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            _resolving.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname, reload=reload)
        return spec


_finder = _PostImportFinder()


def _install_finder() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)

"""Looking at upstream functions without running them: shared by the fixes' structural checks."""
from __future__ import annotations

import ast
import inspect
import textwrap


def undecorated(func, qualname: str):
    """The function named ``qualname`` under ``func``'s decorators, including DeepSpeed's
    ``instrument_w_nvtx``, which does not use functools.wraps (its signature reads ``(*args, **kwargs)``)."""
    for _ in range(4):
        inner = getattr(func, "__wrapped__", None)
        if inner is None:
            cells = []
            for cell in getattr(func, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # empty cell
                    continue
                if inspect.isfunction(value) and value.__qualname__ == qualname:
                    cells.append(value)
            inner = cells[0] if len(cells) == 1 else None
        if inner is None:
            return func
        func = inner
    return func


def parameter_names(func, qualname: str) -> list[str]:
    return list(inspect.signature(undecorated(func, qualname)).parameters)


_sources: dict = {}  # code object -> source text: a function's source does not change while its code object lives


def source(func) -> str:
    """``inspect.getsource(func)``, read once per code object: the structural checks run at every ``patch()``, and
    ``zerofix check`` patches and unpatches around each of its runs (0.5 s of each rank's default run was spent
    re-reading the same few functions). OSError or TypeError when it cannot be read."""
    code = getattr(inspect.unwrap(func) if callable(func) else func, "__code__", None)
    if code is None:
        return inspect.getsource(func)
    if code not in _sources:
        _sources[code] = inspect.getsource(func)
    return _sources[code]


_trees: dict = {}  # source text -> its parse, shared: every caller only reads it


def source_tree(func) -> ast.AST:
    """The parsed source of ``func`` (never run), parsed once per source text (DeepSpeedZeroOptimizer.__init__'s
    parse was the largest part of a ``patch()`` after the first). OSError, TypeError or SyntaxError when it cannot be
    read."""
    text = textwrap.dedent(source(func))
    if text not in _trees:
        _trees[text] = ast.parse(text)
    return _trees[text]


def self_attributes(func) -> set[str]:
    """The ``self.<name>`` attributes ``func``'s source refers to (empty when it cannot be read)."""
    try:
        tree = source_tree(func)
    except (OSError, TypeError, SyntaxError):
        return set()
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}

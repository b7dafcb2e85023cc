"""The package's shape, read from its source: imports go one way, and every implementation module meets the
contract of ``zerofix.fixes.contract``. Pure reading (ast): no ML library is imported."""
from __future__ import annotations

import ast
import functools
import importlib.util

import pytest

from conftest import ROOT
from zerofix import catalogue
from zerofix.fixes import contract

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)

PACKAGE = ROOT / "zerofix"
# Used only by the package face, environment activation and the CLI (benchmarks live outside the package).
PATCHING_USERS = {"zerofix", "zerofix.activation", "zerofix.cli"}
# What fixes/ and check/ may never reach into: the machinery that loads them.
MACHINERY = {"zerofix.patching", "zerofix.activation", "zerofix.cli"}


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)  # read once per session: the package does not change while the tests run
def package_modules() -> dict[str, tuple[str, str]]:
    """Every zerofix module -> (its source, the package its relative imports start from)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "_bootstrap" not in path.parts:
            name = module_name(path)
            out[name] = (path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])
    return out


def import_base(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, a relative one resolved against ``package``."""
    base = node.module or ""
    if not node.level:
        return base
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))


@functools.lru_cache(maxsize=1)
def modules() -> dict[str, set[str]]:
    """Every zerofix module -> the zerofix modules it imports, at module level or inside a function (a lazy
    import is a dependency too). ``from zerofix import x`` names the submodule x when there is one."""
    names = package_modules()
    graph = {}
    for name, (text, package) in names.items():
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = import_base(node, package)
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def test_the_import_graph_is_read():
    graph = modules()
    assert "zerofix.applied" in graph["zerofix.patching"]
    assert "zerofix.fixes.contract" in graph["zerofix.fixes.trainer_scaling"]
    assert "zerofix.patching" in graph["zerofix.activation"]  # a lazy import, inside a function


def find_cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_imports_have_no_circle():
    cycle = find_cycle(modules())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_fixes_and_check_never_import_the_machinery_that_loads_them():
    graph = modules()
    for name, deps in graph.items():
        if name.startswith(("zerofix.fixes", "zerofix.check")):
            assert not deps & MACHINERY, f"{name} imports {sorted(deps & MACHINERY)}"
    users = {name for name, deps in graph.items() if "zerofix.patching" in deps}
    assert users <= PATCHING_USERS, sorted(users - PATCHING_USERS)


@pytest.mark.parametrize("leaf", ["zerofix.versions", "zerofix.applied", "zerofix.errors", "zerofix.catalogue",
                                  "zerofix.envvalues", "zerofix.identity", "zerofix.fixes.contract", "zerofix.counter", "zerofix.scaling", "zerofix._log"])
def test_leaves_import_no_zerofix_module(leaf):
    assert modules()[leaf] == set(), leaf


MAX_LINES = 600  # issue 68: a module a reader can hold; past it, a module has more than one job


def oversized(root) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]


def test_no_module_is_over_the_line_limit(tmp_path):
    assert oversized(PACKAGE) == []
    (tmp_path / "small.py").write_text("x = 1\n" * MAX_LINES)  # the check itself: at the limit, and one line over
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized(tmp_path) == [f"big.py: {MAX_LINES + 1} lines"]


def private_reaches(sources: dict[str, tuple[str, str]]) -> list[str]:
    """Where a zerofix module (``sources``: as ``package_modules``) uses another zerofix module's private name
    (``from m import _x`` or ``m._x`` through an imported module): a sibling's private name is a promise nobody made
    (issue 68 found three fixes reaching into the Trainer entry's ``_unwrap_peft``, ``_STEP`` and ``_warn_main``). A
    private *module* (``fixes._inspect``, shared helpers of one package) is imported by its name and allowed."""
    out = []
    for name, (text, package) in sorted(sources.items()):
        tree = ast.parse(text)
        local = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = import_base(node, package)
                if not base.startswith("zerofix"):
                    continue
                for alias in node.names:
                    if f"{base}.{alias.name}" in sources:
                        local[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        out.append(f"{name}: from {base} import {alias.name}")
            elif isinstance(node, ast.Import):
                local.update({a.asname: a.name for a in node.names if a.name.startswith("zerofix") and a.asname})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in local
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                out.append(f"{name}: {local[node.value.id]}.{node.attr}")
    return out


def test_no_module_uses_another_modules_private_names():
    assert private_reaches(package_modules()) == []


def test_the_private_name_check_finds_both_ways_of_reaching_in():
    sources = {"zerofix.a": ("_STEP = 1\n", "zerofix"), "zerofix.fixes": ("", "zerofix.fixes"),
               "zerofix.fixes._inspect": ("", "zerofix.fixes"),
               "zerofix.fixes.b": ("from zerofix.a import _STEP\nfrom zerofix.fixes import _inspect\n", "zerofix.fixes"),
               "zerofix.fixes.c": ("from zerofix import a\nfrom . import _inspect\nx = a._STEP + _inspect._y\n",
                                   "zerofix.fixes")}
    assert private_reaches(sources) == ["zerofix.fixes.b: from zerofix.a import _STEP",
                                        "zerofix.fixes.c: zerofix.a._STEP", "zerofix.fixes.c: zerofix.fixes._inspect._y"]


# ----------------------------------------------------------------------------- the implementation contract
def implementation_source(module: str) -> ast.Module:
    # Read, not imported: an implementation imports the library it patches.
    return ast.parse(open(importlib.util.find_spec(module).origin).read())


def declared(tree: ast.Module) -> tuple[set[str], tuple[str, ...] | None]:
    """(top-level functions, the FIX_IDS tuple as literal strings or names resolved in the module)."""
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FIX_IDS" for t in node.targets):
            items = getattr(node.value, "elts", None)
            if items is None:
                return functions, None
            return functions, tuple(e.value if isinstance(e, ast.Constant) else constants.get(e.id) for e in items)
    return functions, None


def contract_breaches(fix: catalogue.Fix) -> list[str]:
    functions, ids = declared(implementation_source(fix.implementation))
    out = []
    if "structural_check" not in functions:
        out.append(f"{fix.implementation} has no structural_check")
    if ids is None or fix.id not in ids:
        out.append(f"{fix.implementation} does not name {fix.id} in FIX_IDS ({ids})")
    for target in fix.targets:
        module, function = contract.split_wrapper(target.wrapper)
        if function not in declared(implementation_source(module))[0]:
            out.append(f"{target.wrapper} is not defined")
    if fix.acts_when and "acted_in" not in functions:  # the Trainer's log names it only where it acted (issue 58)
        out.append(f"{fix.implementation} has no acted_in for {fix.id}, which acts only when used")
    return out


@pytest.mark.parametrize("fix", catalogue.FIXES, ids=catalogue.ids())
def test_every_implementation_meets_the_contract(fix):
    assert contract_breaches(fix) == []


def test_every_implementation_names_only_entries_that_name_it():
    for module in {f.implementation for f in catalogue.FIXES}:
        _, ids = declared(implementation_source(module))
        assert ids and all(catalogue.by_id(i).implementation == module for i in ids), (module, ids)


def test_the_contract_test_fails_on_a_module_without_check_or_with_another_id(tmp_path, monkeypatch):
    (tmp_path / "zf_nocheck.py").write_text("FIX_IDS = ('fake-fix',)\ndef step(wrapped, instance, args, kwargs): pass\n")
    (tmp_path / "zf_otherid.py").write_text("FIX_IDS = ('other-fix',)\n"
                                            "def structural_check(fix_id, targets): pass\n"
                                            "def step(wrapped, instance, args, kwargs): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, expected in (("zf_nocheck", "has no structural_check"), ("zf_otherid", "does not name fake-fix")):
        fix = catalogue.Fix("fake-fix", "t", "fakelib", ">=1", (catalogue.Target("m", "A.b", f"{module}:step"),),
                            module)
        breaches = contract_breaches(fix)
        assert len(breaches) == 1 and expected in breaches[0], breaches
        imported = importlib.import_module(module)
        assert contract.violations(imported, "fake-fix")  # the run-time check patching makes agrees


def test_wrapper_references_are_module_colon_function():
    assert contract.split_wrapper("a.b:c") == ("a.b", "c")
    for bad in ("c", "a.b:", ":c", "a:b.c"):
        with pytest.raises(ValueError, match="module:function"):
            contract.split_wrapper(bad)


# ----------------------------------------------------------------------------- the repository stands alone
def tracked_files():
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def test_nothing_refers_to_design_notes_outside_the_repository():
    outside = "DESIGN" + ".md"  # spelled apart so that this file does not find itself
    hits = [str(p.relative_to(ROOT)) for p in tracked_files()
            if p.suffix in (".py", ".md", ".txt", ".toml", ".cfg", "") and outside in p.read_text(errors="ignore")]
    assert hits == []


def test_every_docs_link_resolves():
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(((?!https?://)[^)#]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)
    for path in tracked_files():  # code and constraints that point into docs/
        if path.suffix in (".py", ".txt"):
            for target in re.findall(r"docs/[\w.-]+\.md", path.read_text(errors="ignore")):
                assert (ROOT / target).exists(), (path.name, target)


def test_the_changelog_has_one_section_of_each_kind_per_release():
    """Keep a Changelog: under a release heading, one Added, one Changed, one Fixed ... (issue 42 found Unreleased
    with several of each, appended by successive changes)."""
    import re

    text = (ROOT / "CHANGELOG.md").read_text()
    for release in re.split(r"^## ", text, flags=re.M)[1:]:
        kinds = re.findall(r"^### (\w+)", release, flags=re.M)
        assert len(kinds) == len(set(kinds)), (release.splitlines()[0], kinds)

"""Contract tests of patch()/unpatch()/status(), each in a fresh interpreter, against a fake library.

``fakelib`` (version 1.0, with real dist-info metadata) defines ``fakelib.core.Engine.step(self, x)``;
``fakefix`` is a fix implementation whose wrapper doubles the result. The fake fix is appended to the
catalogue inside the subprocess, so the real patching code runs unmodified.
"""
from __future__ import annotations

import textwrap

import pytest

from conftest import run_python

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)

FAKELIB_CORE = """
class Engine:
    def step(self, x):
        return x + 1

class SubEngine(Engine):
    pass
"""
FAKELIB_DRIFTED = FAKELIB_CORE.replace("def step(self, x):", "def step(self, x, y=0):")
FAKEFIX = """
import inspect

from zerofix.fixes.contract import drifted, found

FIX_IDS = ("fake-fix",)

def structural_check(fix_id, targets):
    for name, fn in targets.items():
        if list(inspect.signature(fn).parameters) != ["self", "x"]:
            return drifted(f"{name} signature changed to {inspect.signature(fn)}")
    return found()

def step(wrapped, instance, args, kwargs):
    return 2 * wrapped(*args, **kwargs)
"""


def make_fakelib(tmp_path, core=FAKELIB_CORE):
    (tmp_path / "fakelib").mkdir()
    (tmp_path / "fakelib" / "__init__.py").write_text("")
    (tmp_path / "fakelib" / "core.py").write_text(core)
    info = tmp_path / "fakelib-1.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n")
    (tmp_path / "fakefix.py").write_text(FAKEFIX)
    (tmp_path / "brokenfix.py").write_text("raise RuntimeError('implementation exploded')\n")
    return tmp_path


def preamble(tmp_path, *, affected=">=1.0,<2", dist="fakelib", attribute="Engine.step",
             implementation="fakefix", extra_targets=()):
    targets = [f"Target('fakelib.core', {attribute!r}, '{implementation}:step')"]
    targets += [f"Target('fakelib.core', {a!r}, '{implementation}:step')" for a in extra_targets]
    return textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import zerofix
        from zerofix import catalogue
        from zerofix.catalogue import Fix, Target
        catalogue.FIXES = (Fix(id="fake-fix", title="fake", dist={dist!r}, affected={affected!r},
                               targets=({", ".join(targets)},), implementation={implementation!r}),)
        def state():
            return zerofix.status()[0].state
    """)


def check(tmp_path, body, env=None, **kw):
    return run_python(preamble(tmp_path, **kw) + textwrap.dedent(body), env=env)


@pytest.fixture
def lib(tmp_path):
    return make_fakelib(tmp_path)


def test_import_then_patch_covers_existing_instances(lib):
    check(lib, """
        import fakelib.core as core
        engine = core.Engine()
        assert state() == "inactive"
        zerofix.patch()
        assert state() == "applied", zerofix.status()
        assert engine.step(1) == 4
    """)


def test_patch_then_import_applies_on_import(lib):
    check(lib, """
        zerofix.patch()
        assert state() == "pending-import", zerofix.status()
        assert "fakelib.core" not in sys.modules
        import fakelib.core as core
        assert state() == "applied"
        assert core.Engine().step(1) == 4
        assert core.__loader__.__class__.__name__ != "_HookedLoader"
    """)


def test_patch_twice_is_a_no_op(lib):
    check(lib, """
        import fakelib.core as core
        zerofix.patch()
        wrapped = vars(core.Engine)["step"]
        zerofix.patch()
        assert vars(core.Engine)["step"] is wrapped
        assert core.Engine().step(1) == 4
    """)


def test_patch_unpatch_patch_restores_the_identical_object(lib):
    check(lib, """
        import fakelib.core as core
        raw = vars(core.Engine)["step"]
        zerofix.patch(); assert vars(core.Engine)["step"] is not raw
        zerofix.unpatch(); assert vars(core.Engine)["step"] is raw
        assert state() == "inactive" and core.Engine().step(1) == 2
        zerofix.patch(); assert core.Engine().step(1) == 4
        zerofix.unpatch(); assert vars(core.Engine)["step"] is raw
    """)


def test_unpatch_without_patch_changes_nothing(lib):
    check(lib, """
        import fakelib.core as core
        raw = vars(core.Engine)["step"]
        zerofix.unpatch()
        assert vars(core.Engine)["step"] is raw and state() == "inactive"
    """)


def test_unpatch_before_import_keeps_the_hook_from_applying(lib):
    check(lib, """
        zerofix.patch(); zerofix.unpatch()
        import fakelib.core as core
        assert core.Engine().step(1) == 2 and state() == "inactive"
    """)


def test_inherited_target_is_removed_again_on_unpatch(lib):
    check(lib, """
        import fakelib.core as core
        zerofix.patch()
        assert "step" in vars(core.SubEngine) and core.SubEngine().step(1) == 4
        assert core.Engine().step(1) == 2
        zerofix.unpatch()
        assert "step" not in vars(core.SubEngine)
    """, attribute="SubEngine.step")


def test_target_library_absent(lib):
    check(lib, """
        zerofix.patch()
        record = zerofix.status()[0]
        assert record.state == "not-installed" and "nolib is not installed" in record.reason, record
    """, dist="nolib")


def test_version_out_of_range_changes_nothing(lib):
    check(lib, """
        import fakelib.core as core
        raw = vars(core.Engine)["step"]
        zerofix.patch()
        record = zerofix.status()[0]
        assert record.state == "not-affected" and record.installed == "1.0", record
        assert "outside the affected range >=2" in record.reason
        assert vars(core.Engine)["step"] is raw
    """, affected=">=2")


def test_prereleases_are_inside_the_range(lib):
    check(lib, """
        import fakelib.core as core
        zerofix.patch()
        assert state() == "applied"
    """, affected=">=1.0.dev0,<1.0.1")


def test_structural_drift_is_skipped_with_a_reason(tmp_path):
    lib = make_fakelib(tmp_path, core=FAKELIB_DRIFTED)
    check(lib, """
        import fakelib.core as core
        raw = vars(core.Engine)["step"]
        zerofix.patch()
        record = zerofix.status()[0]
        assert record.state == "target-changed" and "signature changed" in record.reason, record
        assert vars(core.Engine)["step"] is raw
    """)


def test_structural_drift_raises_in_strict_mode(tmp_path):
    lib = make_fakelib(tmp_path, core=FAKELIB_DRIFTED)
    check(lib, """
        zerofix.patch()
        try:
            import fakelib.core
        except zerofix.StrictError as exc:
            assert "signature changed" in str(exc) and "ZEROFIX_STRICT" in str(exc)
        else:
            raise AssertionError("no StrictError")
    """, env={"ZEROFIX_STRICT": "1"})


def test_hook_failure_is_contained_and_reported(lib):
    check(lib, """
        zerofix.patch()
        import fakelib.core as core   # the implementation module raises on import
        record = zerofix.status()[0]
        assert record.state == "failed" and "implementation exploded" in record.reason, record
        assert core.Engine().step(1) == 2
    """, implementation="brokenfix")


def test_a_missing_second_target_leaves_no_half_applied_patch(lib):
    check(lib, """
        import fakelib.core as core
        raw = vars(core.Engine)["step"]
        zerofix.patch()
        record = zerofix.status()[0]
        assert record.state == "target-changed" and "Engine.nothing" in record.reason, record
        assert vars(core.Engine)["step"] is raw
    """, extra_targets=("Engine.nothing",))


def test_unknown_ids_raise_listing_the_valid_ones_and_patch_nothing(lib):
    check(lib, """
        import fakelib.core as core
        for kwargs in ({"fixes": ["nope"]}, {"exclude": ["nope"]}, {"fixes": ["fake-fix", "nope"]}):
            try:
                zerofix.patch(**kwargs)
            except ValueError as exc:
                assert "nope" in str(exc) and "fake-fix" in str(exc), exc
            else:
                raise AssertionError(kwargs)
        assert state() == "inactive" and core.Engine().step(1) == 2
    """)


def test_exclude_reports_disabled(lib):
    check(lib, """
        import fakelib.core as core
        zerofix.patch(exclude=["fake-fix"])
        assert state() == "disabled" and core.Engine().step(1) == 2
    """)


def test_environment_activation_logs_each_applied_fix_once(lib):
    proc = check(lib, """
        import zerofix.activation
        zerofix.activation.autopatch(); zerofix.activation.autopatch()
        import fakelib.core as core
        assert core.Engine().step(1) == 4
    """, env={"ZEROFIX": "1", "ZEROFIX_LOG": "info"})
    assert proc.stderr.count("[zerofix] INFO fake-fix: applied") == 1, proc.stderr


def test_two_fixes_on_one_attribute_layer_in_any_order(lib):
    """The DeepSpeed fixes share DeepSpeedEngine.backward: layers compose, and removing either one
    leaves the other, innermost first in catalogue order; removing both restores the raw function."""
    (lib / "plusfix.py").write_text(FAKEFIX.replace("return 2 * wrapped(*args, **kwargs)",
                                                    "return wrapped(*args, **kwargs) + 10")
                                    .replace('FIX_IDS = ("fake-fix",)', 'FIX_IDS = ("plus-fix",)'))
    check(lib, """
        plus = tuple(t._replace(wrapper="plusfix:step") for t in catalogue.FIXES[0].targets)
        catalogue.FIXES += (catalogue.FIXES[0]._replace(id="plus-fix", implementation="plusfix", targets=plus),)
        import fakelib.core as core
        raw = vars(core.Engine)["step"]
        zerofix.patch()
        assert [r.state for r in zerofix.status()] == ["applied", "applied"]
        assert core.Engine().step(1) == 2 * 2 + 10  # fake-fix (first in the catalogue) is inside
        zerofix.unpatch(["fake-fix"])
        assert core.Engine().step(1) == 2 + 10
        zerofix.patch(["fake-fix"])
        assert core.Engine().step(1) == 2 * 2 + 10  # the order follows the catalogue, not the calls
        zerofix.unpatch(["plus-fix"])
        assert core.Engine().step(1) == 4
        zerofix.unpatch()
        assert vars(core.Engine)["step"] is raw
    """)


def test_a_fix_waits_for_a_target_module_still_importing_the_other(tmp_path):
    """fakelib.trainer imports fakelib.core half-way through its body (transformers.trainer importing
    accelerate): core's hook fires while trainer is incomplete; the fix must wait for trainer's own hook,
    not report it target-changed or failed on the way."""
    lib = make_fakelib(tmp_path)
    (lib / "fakelib" / "trainer.py").write_text("import fakelib.core\n\nclass Trainer:\n    def step(self, x):\n"
                                                "        return x + 10\n")
    proc = run_python(f"""
        import sys
        sys.path.insert(0, {str(lib)!r})
        import zerofix
        from zerofix import catalogue
        from zerofix.catalogue import Fix, Target
        catalogue.FIXES = (Fix(id="fake-fix", title="fake", dist="fakelib", affected=">=1.0",
                               targets=(Target("fakelib.trainer", "Trainer.step", "fakefix:step"),
                                        Target("fakelib.core", "Engine.step", "fakefix:step")),
                               implementation="fakefix"),)
        import zerofix.activation
        zerofix.activation.autopatch()
        import fakelib.trainer as t, fakelib.core as c
        assert zerofix.status()[0].state == "applied", zerofix.status()
        assert t.Trainer().step(1) == 22 and c.Engine().step(1) == 4
    """, env={"ZEROFIX": "1", "ZEROFIX_LOG": "info"})
    assert proc.stderr.count("fake-fix: applied") == 1, proc.stderr
    assert "target-changed" not in proc.stderr and "failed" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("first", ["patch()", "env"])
def test_an_explicit_exclude_wins_over_an_earlier_patch_or_the_environment(lib, first):
    """The README: explicit arguments > environment. patch(exclude=[...]) after patch() or ZEROFIX=1
    unpatches the excluded fix (it used to stay applied)."""
    check(lib, f"""
        import fakelib.core as core
        if {first == "patch()"}:
            zerofix.patch()
        else:
            import zerofix.activation
            zerofix.activation.autopatch()
        assert state() == "applied" and core.Engine().step(1) == 4
        zerofix.patch(exclude=["fake-fix"])
        assert state() == "disabled" and core.Engine().step(1) == 2, zerofix.status()
        assert "step" in vars(core.Engine) and not hasattr(vars(core.Engine)["step"], "__wrapped__")
    """, env={"ZEROFIX": "1"} if first == "env" else None)


def test_exclude_none_means_nothing_excluded(lib):
    check(lib, """
        import fakelib.core as core
        zerofix.patch(exclude=None)
        assert state() == "applied" and core.Engine().step(1) == 4
    """)


def test_a_reloaded_target_module_is_patched_again(lib):
    """importlib.reload defines new classes: they must be wrapped too, not reported 'applied' while bare."""
    check(lib, """
        import importlib
        import fakelib.core as core
        zerofix.patch()
        old = core.Engine
        importlib.reload(core)
        assert core.Engine is not old
        assert state() == "applied" and core.Engine().step(1) == 4, zerofix.status()
        zerofix.unpatch()
        assert core.Engine().step(1) == 2 and not hasattr(vars(core.Engine)["step"], "__wrapped__")
    """)

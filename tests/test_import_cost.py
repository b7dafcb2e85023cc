import pytest
from conftest import run_python

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)

ML = ("torch", "deepspeed", "transformers", "accelerate", "trl", "wrapt")


def test_import_zerofix_imports_no_ml_library():
    out = run_python(f"""
        import sys, zerofix
        print(sorted(m for m in {ML!r} if m in sys.modules))
    """).stdout
    assert out.strip() == "[]"


def test_zerofix_env_at_startup_imports_no_ml_library_and_waits_for_the_target():
    out = run_python(f"""
        import sys
        print(sorted(m for m in {ML!r} if m in sys.modules))
        print(sys.modules["zerofix.patching"].status()[0].state in ("pending-import", "not-installed", "not-affected"))
    """, env={"ZEROFIX": "1"}).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True"


def test_unset_variable_loads_nothing_at_startup():
    out = run_python("import sys; print([m for m in sys.modules if m.startswith('zerofix')])").stdout
    assert out.strip() == "[]"

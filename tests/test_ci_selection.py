"""How CI spreads the tests over the stacks (issue 68): every stack but latest runs only its own tests (``--own``),
an entry's home stack is the first in CI's order with the entry in range, and .ci/run's two lanes run every stack of
CI's order once."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from conftest import CI_ORDER, ROOT, home_stack

pytestmark = pytest.mark.stack_independent


def test_ci_runs_every_stack_of_ci_order_once():
    """.ci/run's two lanes run every stack of CI_ORDER once (CI_ORDER is the order in which an entry's tests find their
    home stack, not the order in which the lanes run them), latest first in its lane (the fast tier, then the rest),
    every other stack its own tests only; every stack has a constraints file."""
    script = (ROOT / ".ci" / "run").read_text()
    lanes = {}
    for letter, words in re.findall(r"^[^#\n]*\blane ([AB])((?: [\w.-]+(?= ))+)", script, flags=re.M):
        if all((ROOT / "constraints" / f"{word}.txt").exists() for word in words.split()):  # not "lane B so far"
            lanes[letter] = words.split()
    lanes = [lanes.get("A", []), lanes.get("B", [])]
    ran = [stack for lane in lanes for stack in lane]
    assert len(lanes) == 2 and sorted(ran) == sorted(CI_ORDER) and len(ran) == len(set(ran)), lanes
    assert lanes[0][0] == "latest", lanes
    assert re.search(r'run "\$name" test latest ', script) and re.search(r'run "\$name" test-rest latest ', script)
    assert re.search(r'run "\$name" test-all "\$stack" "--own ', script)
    assert all((ROOT / "constraints" / f"{s}.txt").exists() for s in CI_ORDER)


@pytest.mark.parametrize(("dist", "affected", "home"), [
    ("deepspeed", "==0.18.3", "2025-12"),  # only one stack pins it
    ("deepspeed", ">=0.14.5", "latest"),  # every stack: the first
    ("trl", ">=1.10.0,<1.15.0", "trl1100"),
    ("accelerate", ">=1.1.1,<1.9.0", "2025-01"),
    ("deepspeed", "<0.1", None),  # no stack
])
def test_an_entry_runs_on_the_first_stack_in_ci_order_with_it_in_range(dist, affected, home):
    assert home_stack(dist, affected) == home


def test_own_keeps_exactly_the_tests_whose_stack_mark_names_the_stack(tmp_path):
    """A real pytest run of a small file under this conftest, forced to stack latest: with --own, the unmarked test and
    the one marked for another stack are deselected; without it, the unmarked one runs and the other is skipped."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("zerofix_tests_conftest", {str(ROOT / 'tests' / 'conftest.py')!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        pytest_addoption, pytest_configure = module.pytest_addoption, module.pytest_configure
        pytest_collection_modifyitems = module.pytest_collection_modifyitems
    """))
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        def test_unmarked():
            pass

        @pytest.mark.stack("latest", "2026-04")
        def test_named():
            pass

        @pytest.mark.stack("2024-11")
        def test_other():
            pass
    """))

    def outcome(*extra):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--stack", "latest",
                               "-rA", *extra, str(tmp_path / "test_sample.py")], capture_output=True, text=True,
                              cwd=tmp_path)
        return proc.stdout

    own = outcome("--own")
    assert "1 passed, 2 deselected" in own and "PASSED test_sample.py::test_named" in own, own
    every = outcome()
    assert "2 passed, 1 skipped" in every, every

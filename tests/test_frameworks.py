"""Issue 53: zerofix where users launch it. ms-swift 4.6.0's own command lines (``swift sft``, ``swift rlhf
--rlhf_type dpo``) on a tiny local Llama, one process, GA 4 x 2 against the big batch 1 x 8 on the same samples, one
SGD step, fp32, unpatched and with ``ZEROFIX=1`` (zerofix reaches the run through its ``.pth``, as it reaches a user's).

- Both are right upstream (SFT divides by the count; DPO divides its loss by the accumulation steps itself) and stay
  right with ``ZEROFIX=1``: before issue 51, zerofix read DPO's loss as a micro-batch mean and trained at 0.25.
- docs/frameworks.md's generated table holds both rows as this run measures them.
- zerofix's Trainer-log line appears in ms-swift's console output (which replaces transformers' DEFAULT_CALLBACKS at
  start-up, dropping zerofix's callback before), and names the framework's trainer class and what zerofix did.

The other rows (ORPO, CPO, SimPO, KTO, reward modelling, DPO with an RPO term) are a tool:
``tools/frameworks/swift_suite.py``; docs/frameworks.md holds their measured table.
"""
from __future__ import annotations

import pytest

from conftest import tool as conftest_tool

pytestmark = [pytest.mark.distributed, pytest.mark.stack("swift")]
RIGHT = 1e-4


def test_ms_swift_sft_and_dpo_are_right_with_zerofix_and_say_so(tmp_path, capsys):
    tool = conftest_tool("frameworks/swift_suite").FRAMEWORK
    assert tool.main([str(tmp_path), "sft", "dpo", "--jobs", "2"]) == 0
    print(capsys.readouterr().out)
    import json

    results = {r["row"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    for row in ("sft", "dpo"):
        plain, fixed = results[row]["plain"], results[row]["zerofix"]
        assert "error" not in plain and "error" not in fixed, (row, plain, fixed)
        assert plain["rel"] < RIGHT and plain["ratio"] == pytest.approx(1.0, abs=1e-4), (row, plain)  # upstream: right
        assert fixed["rel"] < RIGHT and fixed["ratio"] == pytest.approx(1.0, abs=1e-4), (row, fixed)  # no harm
        lines = results[row]["zerofix_lines"]
        assert sum("fixes act on this run" in line or "fix acts on this run" in line for line in lines) == 1, lines
        # docs/frameworks.md's generated table holds these rows as measured here (swift_suite.py --write-docs)
        assert tool.doc_rows().get(row) == tool.table_row(results[row]), (tool.doc_rows().get(row), results[row])
    dpo_lines = "\n".join(results["dpo"]["zerofix_lines"])
    assert "on DPOTrainer: the loss is independent of num_items_in_batch and its last operation divides it by " \
           "gradient_accumulation_steps (4): a coincidence, not a statement" in dpo_lines, dpo_lines


def test_trls_own_kto_trainer_trains_with_zerofix_as_without(tmp_path):
    """TRL 0.29.1 (what ms-swift resolves) defines KTOTrainer.__eq__ without __hash__: zerofix's Trainer entry raised
    `TypeError: unhashable type: 'KTOTrainer'` in the Trainer's own loop. Now the patched update is bitwise the
    unpatched one (tools/frameworks/trl_suite.py; KTO's batch KL term makes GA differ from the big batch by design)."""
    tool = conftest_tool("frameworks/trl_suite")
    assert tool.main([str(tmp_path), "kto"]) == 0
    import json

    kto = json.loads((tmp_path / "results.jsonl").read_text())
    assert "error" not in kto["zerofix"], (tmp_path / "kto" / "zerofix" / "log.txt").read_text()[-2000:]
    assert kto["bitwise_as_unpatched"] is True, kto

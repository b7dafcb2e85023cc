"""Issues 60 and 67: zerofix where users launch it. axolotl 0.19.0's own command line (``axolotl train config.yml``) on a
tiny local Llama, GA 4 x 2 against the big batch on the same samples, one SGD step, fp32, unpatched and with
``ZEROFIX=1`` (zerofix reaches the run through its ``.pth``, as it reaches a user's).

axolotl's trainer (0.17.0 - 0.19.x) sets ``model_accepts_loss_kwargs = False`` for every model whose inner forward does
not name ``num_items_in_batch`` (a causal LM's takes ``**kwargs``), so the Trainer hands the model's loss no count and
divides each micro-batch's token mean by the accumulation steps: SFT, LoRA and sample packing average micro-batch
means upstream (cosine 0.75, 0.77, 0.92 to the big batch's update here). axolotl 0.20.0 fixed it (PR #3982), so the
flag is axolotl's known bug, not the user's word: with ``ZEROFIX=1`` alone the count is handed and checked at every
step, and the update is the big batch's. docs/frameworks.md's generated table holds these rows as this run measures
them.

The other rows (DPO, ORPO, KTO, two processes under DDP, ZeRO-2 and ZeRO-3) are a tool:
``tools/frameworks/axolotl_suite.py``; docs/frameworks.md holds their measured table. The user's own flag (a Trainer
subclass of theirs, ``ZEROFIX_HAND_COUNT_TO_MODEL=1``) is held by tests/test_micro_means.py.
"""
from __future__ import annotations

import json

import pytest

from conftest import tool as conftest_tool

pytestmark = [pytest.mark.distributed, pytest.mark.stack("axolotl")]
RIGHT = 1e-4


def said_text(line: str) -> str:
    """A console line's zerofix message, without the handler's prefix (a record may reach two handlers)."""
    return line[line.index("zerofix: "):]


def test_axolotl_sft_trains_the_token_mean_with_zerofix(tmp_path, capsys):
    """Issue 67: axolotl 0.17.0 - 0.19.x set ``model_accepts_loss_kwargs = False`` for every model (fixed in 0.20.0, PR
    #3982). Unpatched, SFT, LoRA and sample packing average micro-batch means; with ``ZEROFIX=1`` alone,
    ``axolotl-withheld-count`` records that axolotl's code set the flag and the Trainer entry hands the count, checked at
    every step: the big batch's update, said once in axolotl's console as the entry's line."""
    tool = conftest_tool("frameworks/axolotl_suite").FRAMEWORK
    # CI time (issue 68): SFT here; LoRA (PEFT's wrapper in the path) and packing, measured the same way, are the tool's
    # rows (docs/frameworks.md): `axolotl_suite.py OUT lora packing`
    rows = ("sft",)
    assert tool.main([str(tmp_path), *rows, "--jobs", "2"]) == 0
    print(capsys.readouterr().out)
    results = {r["row"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    for row in rows:
        plain, fixed = results[row]["plain"], results[row]["zerofix"]
        assert "error" not in plain and "error" not in fixed, (row, plain, fixed)
        assert plain["rel"] > 0.1 and plain["cosine"] < 0.95, (row, plain)  # upstream: a mean of micro-batch means
        assert fixed["rel"] < RIGHT and fixed["ratio"] == pytest.approx(1.0, abs=1e-4), (row, fixed)  # the big batch
        lines = results[row]["zerofix_lines"]
        said = {said_text(line) for line in lines if "axolotl-withheld-count acts on this run (axolotl 0.19.0)" in line}
        assert len(said) == 1, lines  # one message, however many handlers print it
        assert "AxolotlTrainer.__init__ set model_accepts_loss_kwargs = False; zerofix has the Trainer hand the model " \
               "num_items_in_batch, and its loss was divided by it in 4 of 4 backwards" in said.pop(), lines
        assert not [line for line in lines if "averages a term" in line], lines  # no mean of means left to say
        assert tool.doc_rows().get(row) == tool.table_row(results[row]), (tool.doc_rows().get(row), results[row])

"""Issue 60: zerofix where users launch it. axolotl 0.19.0's own command line (``axolotl train config.yml``) on a tiny
local Llama, GA 4 x 2 against the big batch on the same samples, one SGD step, fp32, unpatched and with ``ZEROFIX=1``
(zerofix reaches the run through its ``.pth``, as it reaches a user's).

- SFT: axolotl's trainer sets ``model_accepts_loss_kwargs = False`` for every model whose inner forward does not name
  ``num_items_in_batch`` (a causal LM's takes ``**kwargs``), so the Trainer hands the model's loss no count and
  divides each micro-batch's token mean by the accumulation steps: the update averages micro-batch means (the
  measured bug: cosine about 0.75 to the big batch's update here, with 26, 7, 62 and 8 counted tokens). zerofix
  follows the trainer's setting (a run may want it), bitwise, and says once, at WARNING, what the setting does and
  how to get the window's mean.
- SFT with ``ZEROFIX_HAND_COUNT_TO_MODEL=1`` (the user's word that the trainer's flag is not theirs): zerofix hands
  the model's loss the count, finds every step's loss divided by it, and the update is the big batch's.
- DPO: right upstream and bitwise the same with ``ZEROFIX=1``.
- docs/frameworks.md's generated table holds these rows as this run measures them.

The other rows (sample packing, ORPO, KTO, two processes under DDP, ZeRO-2 and ZeRO-3) are a tool:
``tools/frameworks/axolotl_suite.py``; docs/frameworks.md holds their measured table.
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


def test_axolotl_sft_is_said_and_followed_handed_on_the_users_word_and_dpo_is_right(tmp_path, capsys):
    tool = conftest_tool("frameworks/axolotl_suite").FRAMEWORK
    assert tool.main([str(tmp_path), "sft", "sft-hand", "dpo", "--jobs", "2"]) == 0
    print(capsys.readouterr().out)
    results = {r["row"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    for row in ("sft", "dpo"):
        plain, fixed = results[row]["plain"], results[row]["zerofix"]
        assert "error" not in plain and "error" not in fixed, (row, plain, fixed)
        assert results[row]["bitwise_as_unpatched"] is True, (row, results[row])  # no harm: the setting followed
        lines = results[row]["zerofix_lines"]
        # said once; the console may print it twice (transformers propagates its records to the root logger where CI
        # is set, and axolotl's root handler prints them too): one message, however many handlers
        assert len({said_text(line) for line in lines if "fix acts on this run" in line}) == 1, lines

    dpo = results["dpo"]["plain"]
    assert dpo["rel"] < RIGHT and dpo["ratio"] == pytest.approx(1.0, abs=1e-4), dpo  # upstream: right

    sft = results["sft"]["plain"]
    assert sft["rel"] > 0.1 and sft["cosine"] < 0.95, sft  # upstream: a mean of micro-batch means
    said = sorted({said_text(line) for line in results["sft"]["zerofix_lines"]
                   if "averages a term over its own micro-batch" in line})
    assert len(said) == 1, results["sft"]["zerofix_lines"]
    assert "AxolotlTrainer set model_accepts_loss_kwargs = False" in said[0], said
    assert "zerofix follows that setting" in said[0] and "mean of means stays as upstream computes it" in said[0], said
    assert "set model_accepts_loss_kwargs = True on the trainer once it is built" in said[0], said

    # ZEROFIX_HAND_COUNT_TO_MODEL=1: the user's word that the trainer's flag is not theirs; the count is handed to the
    # model's loss, every step's loss is divided by it, and the update is the big batch's (the window's token mean)
    hand = results["sft-hand"]
    assert hand["plain"] == sft, (hand, sft)  # its unpatched run is sft's, the same bug
    assert hand["zerofix"]["rel"] < RIGHT and hand["zerofix"]["ratio"] == pytest.approx(1.0, abs=1e-4), hand
    assert hand["bitwise_as_unpatched"] is False
    lines = hand["zerofix_lines"]
    assert any("the loss is divided by num_items_in_batch; zerofix changed 4 of its first 4 backwards" in line
               for line in lines), lines
    assert not [line for line in lines if "averages a term" in line or "[WARNING] [zerofix]" in line], lines

    for row in ("sft", "sft-hand", "dpo"):  # docs/frameworks.md's generated table (axolotl_suite.py --write-docs)
        assert tool.doc_rows().get(row) == tool.table_row(results[row]), (tool.doc_rows().get(row), results[row])

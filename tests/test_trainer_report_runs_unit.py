"""Issue 58, item 3, without a Trainer: an entry that acts only where a run uses what it fixes (``Fix.acts_when``) is
not named at the start of a run, and is named once the run's own steps used it (``acted_in``), per run."""
from __future__ import annotations

import types

import pytest

from zerofix import catalogue, trainer_report
from zerofix.fixes import trl_grpo_window_normalisation as grpo
from zerofix.patching import Record

pytestmark = pytest.mark.stack_independent


def test_entries_that_act_when_used_are_not_named_at_the_start():
    used = {f.id for f in catalogue.FIXES if f.acts_when}
    assert used == {"transformers-moe-aux-loss", "trl-grpo-window-normalisation", "trl-gspo-token-window-normalisation",
                    "transformers-deepspeed-sp-loss", "axolotl-withheld-count", "llamafactory-processor-withheld-count"}
    records = [Record("transformers-trainer-scaling", "applied", "transformers", "5.24.0", "", ""),
               Record("transformers-moe-aux-loss", "applied", "transformers", "5.24.0", "", ""),
               Record("trl-grpo-window-normalisation", "applied", "trl", "1.5.1", "", "")]
    lines = trainer_report.summary_lines(records, deepspeed=False, trl=True)
    assert lines == ["zerofix: 1 fix acts on this run (no DeepSpeed): transformers-trainer-scaling (transformers 5.24.0)"]


class _Args(types.SimpleNamespace):
    pass


class _State:
    """A TrainerState stand-in (a dataclass instance: weak-referenceable, as SimpleNamespace is not)."""


def _grpo_trainer(steps_per_generation, window):
    trainer = types.SimpleNamespace(loss_type="dapo", model=types.SimpleNamespace(training=True),
                                    args=_Args(steps_per_generation=steps_per_generation),
                                    current_gradient_accumulation_steps=window, state=_State())
    return trainer


def _trl_compute_loss(module):
    def _compute_loss(model, inputs):
        return 1.0

    _compute_loss.__module__ = module
    return _compute_loss


def test_trls_grpo_entry_is_named_in_the_run_whose_own_loss_ran(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, grpo.__name__, grpo)
    record = Record(grpo.FIX_ID, "applied", "trl", "1.5.1", "", "")
    gspo = Record(grpo.GSPO_TOKEN_FIX_ID, "applied", "trl", "1.5.1", "", "")
    trainer = _grpo_trainer(steps_per_generation=4, window=2)
    assert trainer_report.used_lines([record, gspo], trainer.state, set()) == []  # no step yet
    for _ in range(3):
        assert grpo.compute_loss(_trl_compute_loss("trl.trainer.grpo_trainer"), trainer, (None, {}), {}) == 2.0
    seen = set()
    lines = trainer_report.used_lines([record, gspo], trainer.state, seen)
    assert len(lines) == 1 and lines[0].startswith(f"zerofix: {grpo.FIX_ID} acts on this run")
    assert "rescaled 3 of its first 3" in lines[0]
    assert trainer_report.used_lines([record, gspo], trainer.state, seen) == []  # once a run
    other = _grpo_trainer(steps_per_generation=2, window=2)  # another run: its own account, nothing rescaled
    grpo.compute_loss(_trl_compute_loss("trl.trainer.grpo_trainer"), other, (None, {}), {})
    assert "untouched" in trainer_report.used_lines([record], other.state, set())[0]
    assert trainer_report.used_lines([record], _State(), set()) == []  # a run that never ran it

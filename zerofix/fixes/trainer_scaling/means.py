"""Reading the means a loss takes over its own micro-batch, window by window, on every rank (issues 53 and 59): the
records come from the loss's graph (``zerofix.micro_means``), what they mean and what is said from the run's decision.
Where one divides by a count that changes between micro-batches, the update averages micro-batch means and zerofix,
which cannot hand that term a count, says so once. On several processes each rank reads to the window's end before the
ranks compare (one small all-gather a window while the reading lasts), so every rank reaches the same decision at the
same step."""
from __future__ import annotations

from zerofix import decision, framework_flags, micro_means, trainer_words as words
from zerofix.fixes.trainer_scaling import reading


def compare(records: list, world: int) -> tuple:
    """A window's records, every rank's, compared: ``micro_means.outcome`` (what differs, if anything)."""
    return micro_means.outcome(across_ranks(records, world))


def withheld(trainer) -> str | None:
    """Who withheld the count from the model's own loss, in words, where a trainer's own flag did (axolotl 0.19's, a
    user's subclass): followed, and said with the setting; None elsewhere (a trainer's own loss, TRL's ORPO, keeps the
    other words)."""
    if not reading.count_withheld_by_trainer(trainer, trainer.model):
        return None
    flag = framework_flags.of(trainer)
    return words.withheld_who_framework(flag) if decision.framework_word(flag) == decision.UNCLEAR else \
        words.withheld_who(type(trainer).__name__)


def across_ranks(records: list, world: int) -> list:
    """This window's records of every rank, in rank order (this rank's alone on one process)."""
    import torch.distributed as dist

    if world <= 1 or not (dist.is_available() and dist.is_initialized()):
        return records
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return [record for rank in gathered for record in rank]

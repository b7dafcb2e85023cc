"""transformers-nokw-undivided (transformers >=4.46,<4.48).

4.46 stopped dividing the loss by gradient_accumulation_steps in training_step, relying on the model
normalising by ``num_items_in_batch``. A model whose forward takes no ``**kwargs`` never sees that count
and returns its micro-batch mean, which nothing divides without DeepSpeed: updates are GAS times too
large (measured 8.000 at GAS=8, 1 process and 2-rank DDP). With DeepSpeed the engine's own division
happens to be the only one. Upstream (#35207, 4.48.0) divides by GAS in training_step; zerofix divides
by the window's real length (what ``get_batch_samples`` fetched) in its Accelerator.backward wrapper, and
then the DeepSpeed entry lets the engine divide by 1, as on 4.49 (see ``zerofix.scaling``).
"""
from __future__ import annotations

from zerofix.fixes import _trainer_step


def structural_check(targets) -> str | None:
    import inspect

    params = list(inspect.signature(targets["Trainer.get_batch_samples"]).parameters)
    if params[:3] != ["self", "epoch_iterator", "num_batches"]:
        return f"Trainer.get_batch_samples{tuple(params)} is not (self, epoch_iterator, num_batches, ...)"
    return _trainer_step.check_targets(targets)


def training_step(wrapped, instance, args, kwargs):
    return _trainer_step.training_step(wrapped, instance, args, kwargs)


def get_batch_samples(wrapped, instance, args, kwargs):
    return _trainer_step.get_batch_samples(wrapped, instance, args, kwargs)


def backward(wrapped, instance, args, kwargs):
    return _trainer_step.backward(wrapped, instance, args, kwargs)

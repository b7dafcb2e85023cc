"""The count handed where the Trainer does not hand it: ``CountToLoss`` (to a loss function the model's forward calls
without it) and ``Handing`` (the Trainer's ``model_accepts_loss_kwargs`` True for one call). What the entry does with
the loss that comes back is the step's verdict (``zerofix.decision``)."""
from __future__ import annotations

import inspect

import torch

from zerofix import own_mean


class CountToLoss:
    """For one handed step (issue 59): the count the model's forward is called with reaches the ``loss_function`` that
    forward calls without it. Qwen3-VL and GLM-4V on transformers 4.57 - 5.6 and Qwen3.5 on 5.3 - 5.6 take the count in
    their ``**kwargs`` and call ``self.loss_function(logits=..., labels=..., vocab_size=...)`` without it, so the count
    the Trainer hands never reaches the loss and each micro-batch takes its own token mean. Whether the loss is then
    divided by the count is the step's verdict, as for any handed head (``zerofix.decision``): kept where it is, the step run
    again without the count where it is not. The count is the one the model's own call carries (a forward pre-hook
    reads it; a call without one, such as the chunked-loss switch's proof of its route, gets none), a call that passes
    the count itself (5.24's heads) is left as it is, and so is a loss function that takes no count (its signature has
    neither ``num_items_in_batch`` nor ``**kwargs``). The model's own ``_loss_function`` (a user's, set through the
    property transformers provides) is what gets the count, and it, the hooks and the rest are put back after the step.
    ``model`` None: nothing is done."""

    def __init__(self, model, proven=None, called=None, inject: bool = True):
        self.model, self.kept, self.hooks, self.proven, self.inject = model, None, (), proven, inject
        self.dropped = False  # a loss function was called without the count its model's call carried
        self.injected = False  # ... and zerofix handed it that count (``inject``)
        # the module whose call carries the count: a PeftModel around the model (PEFT's tuner calls the model's
        # ``forward`` directly, so hooks on the model itself would never run), else the model
        self.called = called if called is not None else model

    def __enter__(self):
        model = self.model
        if model is None or not isinstance(model, torch.nn.Module) or not isinstance(self.called, torch.nn.Module):
            return self
        current = [None, False]  # the count of the model call under way; whether its loss function took a count
        original = self._loss_function(model)
        if original is not None:
            names = list(inspect.signature(original).parameters)
            position = names.index("num_items_in_batch") if "num_items_in_batch" in names else None

            def with_count(*args, **kwargs):
                count = current[0]
                if kwargs.get("num_items_in_batch") is not None:
                    current[1] = True
                    return original(*args, **kwargs)
                if count is None:
                    return original(*args, **kwargs)
                if position is not None and position < len(args) and args[position] is not None:
                    current[1] = True
                    return original(*args, **kwargs)
                self.dropped = True
                if not self.inject:
                    return original(*args, **kwargs)
                current[1] = True
                if position is not None and position < len(args):
                    self.injected = True
                    return original(*args[:position], count, *args[position + 1:], **kwargs)
                self.injected = True
                return original(*args, **{**kwargs, "num_items_in_batch": count})

            self.kept = (vars(model).get("_loss_function"), "_loss_function" in vars(model))
            model.loss_function = with_count

        def called(module, args, kwargs):
            current[0], current[1] = kwargs.get("num_items_in_batch"), False

        def returned(module, args, kwargs, output):
            count, took = current
            current[0], current[1] = None, False
            if count is not None and not took and self.proven is not None:
                self._weigh_own_mean(type(model).__name__, kwargs, output, count)


        self.hooks = (self.called.register_forward_pre_hook(called, with_kwargs=True),
                      self.called.register_forward_hook(returned, with_kwargs=True))
        return self

    @staticmethod
    def _loss_function(model):
        """The model's loss function where a count can be handed to it (the property transformers provides, whose
        signature takes ``num_items_in_batch`` or ``**kwargs``), else None."""
        prop = inspect.getattr_static(type(model), "loss_function", None)
        if not isinstance(prop, property) or prop.fset is None:  # 4.46 - 4.47: read-only, and no count is handed there
            return None
        try:
            original = model.loss_function
            params = inspect.signature(original).parameters
        except Exception:  # noqa: BLE001 - a loss function this cannot read: left as it is
            return None
        if "num_items_in_batch" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return None
        return original

    def _weigh_own_mean(self, name: str, kwargs: dict, output, count) -> None:
        """A forward that returned a loss no count reached (an inline mean, Gemma 3's): where that loss is proven the
        mean cross-entropy of the logits it returns over its micro-batch's counted tokens, it becomes its share of the
        window's token mean (``zerofix.own_mean``); otherwise it is left as it is (the step's verdict: independent)."""
        loss = getattr(output, "loss", None)
        if loss is None:
            return
        proof = own_mean.prove(loss, getattr(output, "logits", None), kwargs.get("labels"), kwargs.get("attention_mask")) \
            if hasattr(output, "keys") else None
        if proof is None:
            self.proven(name, None)
            return
        output.loss = own_mean.as_window_share(loss, proof, count)
        self.proven(name, proof)

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        if self.kept is None:
            return
        value, had = self.kept
        if had:
            self.model.loss_function = value
        else:
            vars(self.model).pop("_loss_function", None)


class Handing:
    """``trainer.model_accepts_loss_kwargs`` True for the length of one Trainer call (counting a window, a step):
    the Trainer then counts, passes and scales the count as for any model that takes it; outside, the attribute is the
    Trainer's own."""

    def __init__(self, trainer, on: bool):
        self.trainer, self.on, self.was = trainer, on, None

    def __enter__(self):
        if self.on:
            self.was = self.trainer.model_accepts_loss_kwargs
            self.trainer.model_accepts_loss_kwargs = True

    def __exit__(self, *exc):
        if self.on:
            self.trainer.model_accepts_loss_kwargs = self.was

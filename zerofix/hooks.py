"""Which hooks on a model are a user's, and keeping them out of a proof's way (issue 69): the chunked-loss switch
(``zerofix.fixes.trainer_chunked_loss``) stands aside where a user's hook would see the logits it does not build or
never fire, and hides a user's hooks inside the backbone from its proof's extra forwards. A hook is an engine's or a
library's by the module that defined its function; everything else is the user's."""
from __future__ import annotations


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


class unseen_by_user_hooks:
    """The forward hooks a user put on ``module``'s submodules, taken off for the proof's forwards and put back after,
    each in its place (issue 69: a hook on ``model.model.norm`` saw 8 calls in a 4-step run, 4 of them the proof's).
    The engines' hooks (DeepSpeed's ZeRO-3 gathers, FSDP's, accelerate's) and the libraries' own (transformers' input
    gradients, PEFT's) stay: the proof's forwards need them as the step does."""

    def __init__(self, module):
        self.module, self.taken = module, []

    def __enter__(self):
        for sub in self.module.modules():
            for name in _HOOK_DICTS:
                hooks = getattr(sub, name, None)
                if hooks and any(is_users(h) for h in hooks.values()):
                    order = list(hooks.items())
                    for key, hook in order:
                        if is_users(hook):
                            del hooks[key]
                    self.taken.append((hooks, order))
        return self

    def __exit__(self, *exc):
        for hooks, order in self.taken:
            added = [(k, h) for k, h in hooks.items() if k not in dict(order)]  # set during the proof: kept, after
            hooks.clear()
            hooks.update(order)
            hooks.update(added)
        self.taken = []

ENGINES = ("deepspeed", "torch.distributed", "accelerate", "zerofix")

LIBRARIES = ENGINES + ("transformers", "peft")


def is_users(hook, libraries=LIBRARIES) -> bool:
    """A hook that no engine or library set (read from the module that defined its function)."""
    function = getattr(hook, "__func__", hook)
    return not (getattr(function, "__module__", None) or "").startswith(libraries)


def user_hooks(module, pre: bool = True) -> bool:
    """Forward hooks on ``module`` that no engine (nor zerofix's Trainer entry) set (DeepSpeed's ZeRO-3 and FSDP hook every
    module); ``pre``: its pre-hooks too (they see the inputs only, which the route passes on as they are)."""
    hooks = [*module._forward_hooks.values(), *(module._forward_pre_hooks.values() if pre else ())]
    return any(is_users(h, ENGINES) for h in hooks)


def user_backward_hooks(module) -> bool:
    """Backward hooks on ``module`` that no engine set: on the head they would never fire (the route never calls it), on
    the model they would see gradients of outputs the route does not build."""
    hooks = [*module._backward_hooks.values(), *module._backward_pre_hooks.values()]
    return any(is_users(h, ENGINES) for h in hooks)


def process_wide_hooks() -> bool:
    """Hooks a user registered for every module (``register_module_forward_hook`` and the pre / backward ones)."""
    from torch.nn.modules import module as torch_module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return any(is_users(h, ENGINES) for name in names for h in getattr(torch_module, name, {}).values())

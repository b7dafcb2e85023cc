"""The single-process reference: what the parameters should be after training on exactly the samples
the ranks consumed.

The loss the user means, per accumulation window (all micro-batches of all ranks between two optimizer
steps): ``token-mean`` = sum of every counted token's loss / number of counted tokens (models taking
loss kwargs); ``rank-token-mean`` = the mean over ranks of each rank's token mean over its share of the
window (what ``average_tokens_across_devices=False`` asks for); ``batch-mean`` = mean of the micro-batch means (models without them);
``moe`` = the token mean plus the router auxiliary loss averaged over the window's micro-batches (of every rank),
times the model's coefficient (``moe:<c>:<a>``: the token mean times c plus the auxiliary term times a, how a
mis-scaled run weights them); ``smoothed-token-mean:<e>`` / ``smoothed-batch-mean:<e>``: the same two means of the
label-smoothed loss (transformers' LabelSmoother, factor e). Computed in
float64, so the comparison measures the distributed run's error, not the reference's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from zerofix.check import models

LOSS_MODES = ("token-mean", "rank-token-mean", "batch-mean")


_computed: dict = {}  # reference_state's answers by what they depend on (see there)


def reference_state(kind: str, init_state: dict, windows, *, loss_mode: str, optimizer_factory,
                    seed: int = 0, last_of_each: int = 0, ranks: int = 1, clip: float = 0.0) -> dict:
    """Parameters after one optimizer step per window.

    ``windows``: one entry per optimizer step, each a list of micro-batches (lists of sample indices)
    from every rank. ``optimizer_factory(params)`` builds the same optimizer the run used.
    ``last_of_each=R``: what a run that keeps only each rank's last micro-batch of a window computes
    (the window split into R equal rank slices; the normalisation still counts the whole window).
    ``ranks``: how many equal rank slices a window holds (``rank-token-mean`` only). ``clip``: the window's
    gradient is clipped to this global norm, ``g * clip / (norm + 1e-6)`` when that factor is below 1 (torch's
    clip_grad_norm_ and DeepSpeed alike).

    The same question asked twice is answered once (a run's unpatched and patched halves train on the same samples,
    mostly from the same weights): the key is the weights' bytes, the windows and every other argument, and an
    optimizer factory that is not a value (a lambda) is never cached.
    """
    if loss_mode not in LOSS_MODES and not loss_mode.startswith(("moe", "smoothed-")):
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}")
    key = None
    if isinstance(optimizer_factory, SGD):
        key = (kind, _digest(init_state), repr(windows), loss_mode, optimizer_factory, seed, last_of_each, ranks, clip)
        if key in _computed:
            return {k: v.clone() for k, v in _computed[key].items()}
    state = _reference_state(kind, init_state, windows, loss_mode=loss_mode, optimizer_factory=optimizer_factory,
                             seed=seed, last_of_each=last_of_each, ranks=ranks, clip=clip)
    if key is not None:
        _computed[key] = {k: v.clone() for k, v in state.items()}
    return state


def _digest(state: dict) -> str:
    import hashlib

    h = hashlib.sha1()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _reference_state(kind, init_state, windows, *, loss_mode, optimizer_factory, seed, last_of_each, ranks, clip):
    model = models.build_model(kind, seed).double()
    model.load_state_dict({k: v.double() for k, v in init_state.items()})
    model.train()
    optimizer = optimizer_factory(model.parameters())
    for window in windows:
        optimizer.zero_grad(set_to_none=True)
        _objective(model, window, loss_mode, last_of_each=last_of_each, ranks=ranks, seed=seed, kind=kind).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _objective(model, window, loss_mode: str, *, last_of_each: int = 0, ranks: int = 1, seed: int = 0,
               kind: str = "causal-lm"):
    """The loss the user means over one window (see the module docstring); a sequence-level kind counts
    samples where a token-level one counts tokens."""
    if loss_mode.startswith("moe"):
        return _moe_objective(model, window, loss_mode, seed)
    task = models.task_of(kind)
    if loss_mode.startswith("smoothed-"):  # smoothed-token-mean:<e>, smoothed-batch-mean:<e>
        loss_mode, epsilon = loss_mode.removeprefix("smoothed-").split(":")
        sums, counts = zip(*(models.smoothed_loss_sum(model, models.collate(mb, seed, task), float(epsilon))
                             for mb in window))
    else:
        sums, counts = zip(*(models.loss_sum(kind, model, models.collate(mb, seed, task)) for mb in window))
    kept = range(len(window))
    if last_of_each:
        per_rank = len(window) // last_of_each
        kept = [(r + 1) * per_rank - 1 for r in range(last_of_each)]
    if loss_mode == "token-mean":
        return torch.stack([sums[i] for i in kept]).sum() / sum(counts)
    if loss_mode == "rank-token-mean":
        if last_of_each or len(window) % ranks:
            raise ValueError("rank-token-mean needs whole rank slices and no last_of_each")
        per_rank = len(window) // ranks
        slices = [range(r * per_rank, (r + 1) * per_rank) for r in range(ranks)]
        return torch.stack([sum(sums[i] for i in sl) / sum(counts[i] for i in sl) for sl in slices]).mean()
    return torch.stack([sums[i] / counts[i] for i in kept]).sum() / len(window)


def _moe_objective(model, window, loss_mode: str, seed: int):
    ce_weight, aux_weight = (float(x) for x in (loss_mode.split(":")[1:] or ("1", "1")))
    ces, counts, auxes = zip(*(models.moe_losses(model, models.collate(mb, seed)) for mb in window))
    coef = float(getattr(model, "router_aux_loss_coef", models.MOE_AUX_COEF))
    return ce_weight * torch.stack(ces).sum() / sum(counts) + aux_weight * coef * torch.stack(auxes).mean()


def window_loss(kind: str, state: dict, window, *, loss_mode: str, ranks: int = 1, seed: int = 0) -> float:
    """The value of that loss for the weights ``state`` (float64, no step): a point of a loss curve."""
    model = models.build_model(kind, seed).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    with torch.no_grad():
        return float(_objective(model, window, loss_mode, ranks=ranks, seed=seed, kind=kind))


def compare(init: dict, measured: dict, reference: dict) -> dict:
    """How the measured update (measured - init) relates to the reference update, over all parameters:
    ``rel_err`` = max |du - dr| / max |dr|; ``ratio`` = <du, dr> / <dr, dr>; ``cosine``."""
    du = torch.cat([(measured[k].double() - init[k].double()).flatten() for k in sorted(reference)])
    dr = torch.cat([(reference[k].double() - init[k].double()).flatten() for k in sorted(reference)])
    return compare_updates(du, dr)


def compare_updates(du, dr) -> dict:
    """``compare`` on the flat updates themselves (float64): measured ``du``, reference ``dr``."""
    scale = dr.abs().max().item()
    if scale == 0:
        raise ValueError("the reference update is zero: the scenario trains nothing")
    return {
        "rel_err": (du - dr).abs().max().item() / scale,
        "ratio": (du @ dr).item() / (dr @ dr).item(),
        "cosine": (du @ dr).item() / max(du.norm().item() * dr.norm().item(), 1e-300),
        "update_norm": du.norm().item(),
        "reference_norm": dr.norm().item(),
    }


def windows_from_ranks(rank_records: list[dict]) -> list[list[list[int]]]:
    """Merge the per-rank records (``windows``: per step, the micro-batches that rank consumed)."""
    steps = {len(r["windows"]) for r in rank_records}
    if len(steps) != 1:
        raise ValueError(f"ranks took different numbers of optimizer steps: {sorted(steps)}")
    return [[mb for r in rank_records for mb in r["windows"][s]] for s in range(steps.pop())]


class SGD(NamedTuple):
    """torch's SGD at a constant rate, as a value (``reference_state`` can cache what it answers with it)."""

    lr: float

    def __call__(self, params):
        return torch.optim.SGD(params, lr=self.lr)


def sgd(lr: float) -> SGD:
    return SGD(float(lr))



def reference_windows(init_state: dict, windows, *, world: int, optimizer_factory, clip: float = 0.0,
                      kind: str = "custom", seed: int = 0) -> tuple[list[dict], list[float]]:
    """Raw-loop reference (zerofix.check.accumulation): the parameters after each window and the
    gradient norm of each update (before clipping).

    ``windows``: per window, its updates; per update, ``(micro_step, weight)`` pairs. An update's
    gradient is the rank average of sum(weight * grad(mean loss of the rank's micro-batch)), clipped
    like DeepSpeed does (``g * clip / (norm + 1e-6)`` when that factor is below 1)."""
    model = models.build_model(kind, seed).double()
    model.load_state_dict({k: v.double() for k, v in init_state.items()})
    model.train()
    optimizer = optimizer_factory(model.parameters())
    states, norms = [], []
    for window in windows:
        for update in window:
            optimizer.zero_grad(set_to_none=True)
            _raw_objective(model, update, world, seed).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
            norms.append(norm)
            if clip > 0 and clip / (norm + 1e-6) < 1:
                for g in grads:
                    g.mul_(clip / (norm + 1e-6))
            optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states, norms


def _raw_objective(model, update, world: int, seed: int = 0):
    """sum(weight * mean loss of the micro-step's batch), averaged over the ranks' batches."""
    from zerofix.check.accumulation import sample_indices

    loss = 0.0
    for micro_step, weight in update:
        for rank in range(world):
            batch = models.collate(sample_indices(micro_step, rank, world), seed)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            logits = out["logits"] if isinstance(out, dict) else out.logits
            loss = loss + weight / world * models.next_token_ce(logits, batch["labels"], "mean")
    return loss


def raw_update_loss(state: dict, update, *, world: int, kind: str = "custom", seed: int = 0) -> float:
    """The value of a raw-loop update's objective for the weights ``state`` (float64, no step)."""
    model = models.build_model(kind, seed).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    with torch.no_grad():
        return float(_raw_objective(model, update, world, seed))


# Shared by the runs and the reference. AdamW's eps is small on purpose: its update g / (|g| + eps)
# amplifies the fp32 rounding of gradients whose size is near eps (8e-6 relative error with the default
# 1e-8 on upstream-correct paths, 5e-5 with 1e-6); at 1e-10 the worst DeepSpeed cell is 7.0e-6 (bound 1e-5).
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=2.0),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-10, weight_decay=0.01),
}

"""A head's own token mean, proven from the logits it returns, and weighed as the window's (issue 59).

Some heads compute their loss inline (Gemma 3's ``nn.CrossEntropyLoss()`` on transformers 4.57 - 5.6): no count
reaches it, so under gradient accumulation each micro-batch is its own token mean and the update is a mean of
micro-batch means. Where that loss is proven, on the micro-batch itself, to be the mean cross-entropy of the logits
the head returns over ``n`` counted tokens, ``loss * n / N`` (``N`` the window's count, the Trainer's
``num_items_in_batch``) is the sum of those tokens' losses over the window's count: the window's token mean, through
the head's own graph (its gradient is ``n / N`` times the head's, exactly what the token sum gives).

The proof: the next-token cross-entropy of the returned logits (position t against label t+1, labels of -100 not
counted), summed in float64 and divided by the count, equals the head's loss to within ``TOLERANCE`` relative (or, for
a loss handed back in bf16 or fp16, is that mean rounded to its dtype), for the tokens the labels count, or for those
the labels and the 2-D attention mask count (Gemma 3 drops masked positions).
Anything else (an extra term, label smoothing, an unshifted loss, shapes that do not line up, no counted
token) proves nothing, and the caller leaves the loss as it is. Computed without autograd, in chunks of about
``CHUNK_BYTES`` of float32, so the step's peak memory barely moves (benchmarks/bench_own_mean_heads.py).

Plain code: tests/test_own_mean.py. Importing this module imports torch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
TOLERANCE = 2e-5  # relative: float32 means of the same float32 logits agree to about 1e-6
CHUNK_BYTES = 16 * 2**20  # float32 logits per chunk of positions (one temporary of this size at a time)


class Proof(NamedTuple):
    count: torch.Tensor  # the tokens the head's mean is over (a 0-dim float tensor on the loss's device)
    tokens: str  # which tokens: "labels" or "labels and attention mask"


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The next-token cross-entropy of each counted position (float32, no autograd) and the counted mask of the shifted
    positions ([B, L-1]); None where the shapes do not line up."""
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape or logits.shape[1] < 2:
        return None
    if labels.dtype not in (torch.int64, torch.int32):
        return None
    with torch.no_grad(), torch.autocast(logits.device.type, enabled=False):
        shifted = labels[:, 1:].to(logits.device)
        counted = shifted != IGNORE_INDEX
        step = max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
        out = []
        for row in range(logits.shape[0]):  # contiguous views of each sample's positions: no copy of the logits
            for start in range(0, logits.shape[1] - 1, step):
                part = logits[row, start:min(start + step, logits.shape[1] - 1)].float()
                targets = shifted[row, start:start + part.shape[0]]
                picked = part.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
                out.append(part.logsumexp(-1) - picked)
        # every position's loss, then the counted ones at once (one selection: on a GPU, one synchronisation)
        losses = torch.cat(out)[counted.reshape(-1)]
    return losses, counted


def prove(loss, logits, labels, attention_mask=None) -> Proof | None:
    """The count the head's ``loss`` is the mean over, proven from its returned ``logits`` and the micro-batch's
    ``labels`` (and 2-D ``attention_mask``), or None where it is not that mean."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        return None
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return None
    read = token_losses(logits, labels)
    if read is None:
        return None
    losses, counted = read
    candidates = [("labels", torch.ones_like(losses, dtype=torch.bool))]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
            and attention_mask.shape[0] == labels.shape[0] and attention_mask.shape[1] >= labels.shape[1] - 1:
        # the mask of each label's position (Gemma 3 crops it to the shifted length from the right)
        kept = attention_mask[:, -(labels.shape[1] - 1):].to(counted.device) != 0
        candidates.append(("labels and attention mask", kept[counted]))
    with torch.no_grad():
        value = float(loss.detach().double())
        for tokens, keep in candidates:
            n = int(keep.sum())
            if n == 0:
                continue
            mean = float(losses[keep].double().sum()) / n
            if _agrees(value, mean, loss.dtype):
                return Proof(torch.tensor(float(n), dtype=loss.dtype, device=loss.device), tokens)
    return None


def _agrees(value: float, mean: float, dtype: torch.dtype) -> bool:
    """The loss's value is the mean to within TOLERANCE, or is that mean rounded to the loss's own dtype (a loss handed
    back in bf16: FSDP2's mixed precision casts a forward's outputs, the loss among them, to bf16; the proof then holds
    to bf16's rounding, half a unit in the last place, about 0.2%)."""
    if abs(value - mean) <= TOLERANCE * max(abs(mean), 1e-6):
        return True
    if dtype in (torch.float32, torch.float64):
        return False
    near = torch.tensor([mean * (1 - TOLERANCE), mean, mean * (1 + TOLERANCE)], dtype=torch.float64)
    return value in near.to(dtype).double().tolist()


def as_window_share(loss: torch.Tensor, proof: Proof, num_items) -> torch.Tensor:
    """The head's mean weighed as its share of the window's token mean: ``loss * (n / num_items)``; where the window
    is this micro-batch (one process, GAS 1) the factor is exactly 1 and the loss upstream's, bitwise."""
    count = num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else num_items
    return loss * (proof.count / count)

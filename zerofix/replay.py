"""What a forward changes besides its output, kept so it can run again from the same point: the random states a model
draws from (torch's on the CPU and every initialised CUDA device, so dropout draws the same masks; Python's ``random``
and NumPy's global generator, which stochastic depth and layer drop written by hand draw from: issue 69) and a model's
buffers (running statistics, counters).

Used where zerofix runs a training forward twice and the step must not know: the Trainer entry's micro-batch run again
without a handed count (issue 51), and the chunked-loss switch's proof, which compares the model's own training forward
with the route's on one random state and leaves the step's random state as it found it (issue 58). Importing this
module imports torch.
"""
from __future__ import annotations

import random
import sys

import torch


class Snapshot:
    """The random states and ``model``'s buffers now; ``restore()`` puts them back (as often as needed)."""

    def __init__(self, model=None):
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")  # imported by whoever draws from it: never imported here
        self.numpy = (numpy, numpy.random.get_state()) if numpy is not None else None
        self.cpu = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        buffers = model.buffers() if isinstance(model, torch.nn.Module) else ()
        self.buffers = [(b, b.detach().clone()) for b in buffers]

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            self.numpy[0].random.set_state(self.numpy[1])
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        with torch.no_grad():
            for buffer, value in self.buffers:
                buffer.copy_(value)

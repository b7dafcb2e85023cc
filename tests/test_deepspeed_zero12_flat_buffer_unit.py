"""deepspeed-zero12-flat-buffer without a distributed run: its structural check on the shapes of DeepSpeed's
``DeepSpeedZeroOptimizer.__init__``, and its wrapper on real tensors. The installed releases were checked the same
way: 0.18.7, 0.18.8 and 0.18.9 are the broken ones; 0.18.3 and 0.18.6 drift (the parameters are flattened from CPU
copies), 0.19.0 and 0.19.8 drift (the buffer is detached, DeepSpeed PR #7948). The distributed half (unpatched:
the crash on every rank; patched: the reference) is tests/test_deepspeed_accumulation.py's ``-gradstep`` cells."""
from __future__ import annotations

import pytest

from zerofix.fixes import deepspeed_zero12_flat_buffer as fix

pytestmark = pytest.mark.stack_independent  # the same on every stack: runs on latest (CI time)


class Shapes:
    def __init__(self):  # 0.18.7 - 0.18.9
        if flatten_on_gpu:  # noqa: F821
            flattened_buffer = self.flatten_dense_tensors_aligned(self.round_robin_bit16_groups[i], alignment,  # noqa: F821
                                                                  use_cpu_data=False)
        else:
            flattened_buffer = self.flatten_dense_tensors_aligned(self.round_robin_bit16_groups[i], alignment,  # noqa: F821
                                                                  use_cpu_data=True)
        self.bit16_groups_flat.append(flattened_buffer)

    def fixed(self):  # 0.19.0
        flattened_buffer = self.flatten_dense_tensors_aligned(self.round_robin_bit16_groups[i], alignment,  # noqa: F821
                                                              use_cpu_data=False).detach()
        self.bit16_groups_flat.append(flattened_buffer)

    def before(self):  # 0.18.6: CPU copies only
        flattened_buffer = self.flatten_dense_tensors_aligned(self.round_robin_bit16_groups[i], alignment,  # noqa: F821
                                                              use_cpu_data=True)
        self.bit16_groups_flat.append(flattened_buffer.to(device))  # noqa: F821


def test_the_undetached_flatten_is_found():
    assert fix.drift_from_broken(Shapes.__init__) is None


@pytest.mark.parametrize("shape, why", [(Shapes.fixed, "detaches the flat buffer"),
                                        (Shapes.before, "never flattens the parameters themselves"),
                                        (len, "source unavailable")])
def test_any_other_shape_drifts(shape, why):
    assert why in fix.drift_from_broken(shape)


def test_a_buffer_with_a_graph_comes_back_detached_and_anything_else_as_it_was():
    import torch

    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    flat = fix.flatten_dense_tensors_aligned(lambda: torch.cat(params), None, (), {})
    assert not flat.requires_grad and flat.grad_fn is None
    flat.add_(1.0)  # the same storage as the concatenation DeepSpeed made, now free to be written in place
    grads = torch.zeros(5)
    assert fix.flatten_dense_tensors_aligned(lambda: grads, None, (), {}) is grads

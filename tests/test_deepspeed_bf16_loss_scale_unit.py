"""deepspeed-bf16-loss-scale without a distributed run: its structural check on the shapes of DeepSpeed's
``_take_model_step``, and its wrappers on a real FP16_UnfusedOptimizer where the installed DeepSpeed is in range.

The real sources were checked the same way (structural_check on each installed release): 0.17.6, 0.18.0, 0.18.2,
0.18.3 and 0.18.5 are the broken ones; 0.16.3 and 0.17.5 drift (no low_precision_dtype: bf16 never reaches the
optimizer), 0.18.6, 0.18.9 and 0.19.8 drift (the optimizer is told its dtype, PR #7839)."""
from __future__ import annotations

import pytest

from zerofix.fixes import deepspeed_bf16_loss_scale as fix


class Shapes:
    def broken(self):  # 0.17.6 - 0.18.5
        if self.bfloat16_enabled():
            # TODO: Temporary until bf16_optimizer and zero_optimizer are integrated
            if self.zero_optimization() and hasattr(self.optimizer, "zero_grad"):
                self.optimizer.zero_grad()
            else:
                pass
        elif self.zero_optimization() or self.fp16_enabled() or self.amp_enabled():
            self.optimizer.zero_grad()
        else:
            self.zero_grad()

    def fixed(self):  # 0.18.6
        if self.bfloat16_enabled():
            if hasattr(self.optimizer, "zero_grad"):
                self.optimizer.zero_grad()
            else:
                self.zero_grad()
        elif self.zero_optimization() or self.fp16_enabled() or self.amp_enabled():
            self.optimizer.zero_grad()

    def without_bf16(self):
        self.optimizer.zero_grad()


@pytest.mark.stack_independent
def test_the_broken_gate_is_found():
    assert fix.zero_grad_gate_drift(Shapes.broken) is None


@pytest.mark.stack_independent
@pytest.mark.parametrize("shape, why", [(Shapes.fixed, "without testing zero_optimization()"),
                                        (Shapes.without_bf16, "has no bf16 branch"), (len, "source unavailable")])
def test_any_other_shape_drifts(shape, why):
    assert why in fix.zero_grad_gate_drift(shape)


# FP16_UnfusedOptimizer asks deepspeed.comm for its rank: a one-process gloo group, in a process of its own
SCRIPT = """
import json, os, sys, torch, deepspeed
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from zerofix.fixes import deepspeed_bf16_loss_scale as fix
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
deepspeed.init_distributed(dist_backend="gloo")
def build(dtype):
    params = [torch.nn.Parameter(torch.ones(3, dtype=dtype))]
    return FP16_UnfusedOptimizer(torch.optim.SGD(params, lr=0.1), dynamic_loss_scale=True)
out = {}
for name in ("bfloat16", "float16"):
    dtype = getattr(torch, name)
    optimizer, seen = build(dtype), out.setdefault(name, [])
    def scale():
        seen.append([optimizer.cur_scale, optimizer.dynamic_loss_scale])
    scale()
    assert fix.configure_fp16_optimizer(lambda: optimizer, None, (), {}) is optimizer
    scale()
    saved = build(dtype).state_dict()  # a checkpoint of an unpatched run
    optimizer.load_state_dict(saved)  # DeepSpeed's own load
    scale()
    fix.load_state_dict(optimizer.load_state_dict, optimizer, (saved,), {})
    scale()
    out[name + "-changed"] = fix.runtime_details()
    fix.reset_runtime()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def scales() -> dict:
    """Per dtype, the optimizer's (cur_scale, dynamic) as built, through the configure wrapper, after DeepSpeed's
    own load of a checkpoint that holds fp16's scale, and after that load through the wrapper."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT, "", str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SCALED, UNSCALED = [2.0 ** 16, True], [1.0, False]


@pytest.mark.stack("2025-10", "2025-12")  # DeepSpeed 0.18.0, 0.18.3: in range
def test_a_bf16_optimizer_loses_its_scale_when_built_and_when_loaded(scales):
    assert scales["bfloat16"] == [SCALED, UNSCALED, SCALED, UNSCALED]  # fp16's scale in bf16: the bug


@pytest.mark.stack("2025-10", "2025-12")
def test_an_fp16_optimizer_keeps_its_scale(scales):
    assert scales["float16"] == [SCALED] * 4


@pytest.mark.stack("2025-10", "2025-12")
def test_the_runtime_details_count_what_was_changed(scales):
    """What zerofix.status() shows, and what `zerofix check` names a row's fix from: the bf16 optimizer's scale
    dropped twice (built, loaded), nothing done to the fp16 one."""
    assert scales["bfloat16-changed"] == [{"scales_dropped": 2, "steps_zeroed": 0, "corrected": 2}]
    assert scales["float16-changed"] == [{"scales_dropped": 0, "steps_zeroed": 0, "corrected": 0}]

"""deepspeed-output-hook-division on the shapes of output that decide it, one real engine per case.

One process (DeepSpeed on gloo, world size 1), ZeRO-1, config GAS=4, one boundary backward (flagged with
``set_gradient_accumulation_boundary(True)``, so the gradient can be read at once), read with
``safe_get_full_grad`` and compared with the float64 gradient of the objective / GAS computed by hand on the
same weights. Each case runs through ``engine.backward(objective)`` and a direct ``objective.backward()``:

- ``logits``: the model returns (loss, logits), the loss is computed from the logits (every HF model);
- ``hidden``: (loss, logits, hidden), each on the next one's path (``output_hidden_states``);
- ``parallel``: (loss, aux), neither on the other's path, the objective is their sum: each is divided
  once by DeepSpeed, and must stay so;
- ``penalty``: (loss, logits), the objective adds a penalty on the logits: the logits' gradient is partly
  through the loss and partly not;
- ``unhooked``: the loss of ``engine.module(...)``, which crossed no hooked output (engine.backward only).

Every run is compared with float64 gradients of ``w_loss * loss + w_other * other`` for the weights each
behaviour means: (1/GAS, 1/GAS) is right; unpatched, the weights DeepSpeed is measured to apply (one more
1/GAS per hooked output on the path); patched, right, and identical bit for bit where upstream was
right; on the direct path with a penalty, the documented limitation (1/GAS, 1).
"""
from __future__ import annotations

import json
import socket

import pytest

from conftest import run_python
from zerofix import catalogue, versions
from zerofix.check import launch

# the releases with the hooks (0.18.3, 0.18.9, 0.19.8); before 0.18.3 the entry is not in range
pytestmark = [pytest.mark.slow, pytest.mark.stack("latest", "2026-04", "2025-12")]
FIX = "deepspeed-output-hook-division"
GAS = 4

SCRIPT = r"""
import json, os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
import torch
import torch.nn.functional as F
import zerofix

if sys.argv[1] == "patched":
    zerofix.patch(fixes=[{fix!r}])
import deepspeed
from deepspeed.utils import safe_get_full_grad

deepspeed.init_distributed(dist_backend="gloo")
GAS = {gas}
WEIGHTS = {weights!r}
CASES = {cases!r}


class Model(torch.nn.Module):
    def __init__(self, case):
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.embed = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11)
        self.aux = torch.nn.Linear(8, 1)

    def forward(self, ids):
        hidden = torch.tanh(self.body(self.embed(ids)))
        logits = self.head(hidden)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
        if self.case == "parallel":
            return {{"loss": loss, "aux": self.aux(self.embed(ids)).pow(2).mean()}}
        if self.case == "hidden":
            return {{"loss": loss, "logits": logits, "hidden": hidden}}
        if self.case == "unhooked":
            return {{"loss": loss}}
        return {{"loss": loss, "logits": logits}}


def objective(out, case, w_loss=1.0, w_other=1.0):
    value = w_loss * out["loss"]
    if case == "parallel":
        value = value + w_other * out["aux"]
    elif case == "penalty":
        value = value + w_other * 0.1 * out["logits"].pow(2).mean()
    return value


ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
config = {{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
          "zero_optimization": {{"stage": 1}}, "zero_allow_untested_optimizer": True,
          "gradient_clipping": 0.0, "steps_per_print": 10**9}}
results = {{}}
for case, path in CASES:
    model = Model(case)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    engine.set_gradient_accumulation_boundary(True)
    value = objective(engine.module(ids) if case == "unhooked" else engine(ids), case)
    if path == "engine":
        engine.backward(value)
    else:
        value.backward()
    grads = {{n: safe_get_full_grad(p).double() for n, p in engine.module.named_parameters()}}
    errors = {{}}
    for w in WEIGHTS:
        reference = Model(case).double()
        objective(reference(ids), case, *w).backward()
        ref = {{n: p.grad for n, p in reference.named_parameters() if p.grad is not None}}
        scale = max(r.abs().max().item() for r in ref.values())
        errors[repr(w)] = max((grads[n] - ref[n]).abs().max().item() for n in ref) / scale
    results[case + "-" + path] = {{"errors": errors, "grads": [grads[n].float().flatten().tolist()
                                                           for n in sorted(grads)]}}
    del engine
print("RESULT" + json.dumps(results))
"""

D = float(GAS)
RIGHT = (1 / D, 1 / D)
CASES = [(case, path) for case in ("logits", "hidden", "parallel", "penalty", "unhooked") for path in ("engine", "direct")
         if not (case == "unhooked" and path == "direct")]
WEIGHTS = [RIGHT, (1 / D**2, 1 / D), (1.0, 1.0), (1 / D, 1.0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(variant: str, cases) -> dict:
    code = SCRIPT.format(fix=FIX, gas=GAS, weights=WEIGHTS, cases=cases)
    proc = run_python(code, env=launch.scenario_env(), args=(variant, str(free_port())), timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def unpatched_weights(case: str, path: str, deepspeed_version: str) -> tuple | None:
    """What DeepSpeed applies (measured): each hooked output divides the gradient entering it. None: no
    single weight (``hidden``: the head's gradient is divided twice, the layers below three times)."""
    hooks = versions.version_in_range(deepspeed_version, ">=0.18.3")
    root_scaled = versions.version_in_range(deepspeed_version, ">=0.19.6") and path == "engine"
    if not hooks or root_scaled or case == "parallel":
        return RIGHT
    return {"logits": (1 / D**2, 1 / D), "hidden": None, "penalty": (1 / D**2, 1 / D),
            "unhooked": (1.0, 1.0)}[case]


def patched_weights(case: str, path: str) -> tuple:
    return (1 / D, 1.0) if (case, path) == ("penalty", "direct") else RIGHT


@pytest.fixture(scope="module")
def measured():
    version = versions.installed_version("deepspeed")
    cases = [c for c in CASES if c[1] == "engine" or versions.version_in_range(version, ">=0.18.3")]
    return run("unpatched", cases), run("patched", cases)


@pytest.mark.parametrize("case, path", CASES, ids=[f"{c}-{p}" for c, p in CASES])
def test_each_gradient_is_divided_once(measured, case, path):
    version = versions.installed_version("deepspeed")
    if f"{case}-{path}" not in measured[0]:
        pytest.skip("DeepSpeed < 0.18.3 has no PyTorch-style backward")
    unpatched, patched = (m[f"{case}-{path}"] for m in measured)
    bug, fixed = unpatched_weights(case, path, version), patched_weights(case, path)
    assert bug is None or unpatched["errors"][repr(bug)] < 1e-6, unpatched["errors"]
    assert patched["errors"][repr(fixed)] < 1e-6, patched["errors"]
    if bug == RIGHT:  # upstream is right: zerofix leaves the gradient as it was, bit for bit
        assert patched["grads"] == unpatched["grads"]
    else:  # and the bug is a bug, not noise
        assert unpatched["errors"][repr(RIGHT)] > 0.5, unpatched["errors"]


def test_the_entry_applies_where_the_hooks_exist():
    fix = catalogue.by_id(FIX)
    version = versions.installed_version("deepspeed")
    assert versions.version_in_range(version, fix.affected) == versions.version_in_range(version, ">=0.18.3")

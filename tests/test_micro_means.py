"""Issue 53, item 3: a loss term averaged over its own micro-batch (TRL's ORPO / CPO NLL term, ms-swift's RPO term) makes
gradient accumulation average micro-batch means. zerofix reads the means from the loss's autograd graph over a run's
first window and, where a count changed between micro-batches, says so once (it cannot hand that term a count); where
no count changed, or the loss is divided by the Trainer's count, it says nothing."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from conftest import run_python  # noqa: E402
from zerofix.micro_means import differing, micro_means  # noqa: E402


def logits_and_labels(ignored):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels.view(-1)[:ignored] = -100
    return logits, labels


@pytest.mark.stack_independent
def test_the_means_a_loss_takes_and_their_counts():
    logits, labels = logits_and_labels(3)
    assert micro_means(F.cross_entropy(logits.view(-1, 7), labels.view(-1))) == [("cross-entropy token mean", 7)]
    # ignore_index read from the node (TRL's DPO flattens with ignore_index=0)
    zeros = labels.clamp(min=0)
    counted = int((zeros != 0).sum())
    assert micro_means(F.cross_entropy(logits.view(-1, 7), zeros.view(-1), ignore_index=0)) == [
        ("cross-entropy token mean", counted)]
    logps = logits.log_softmax(-1).amax(-1)
    mask = labels != -100
    assert micro_means(-logps[mask].mean()) == [("mean", 7)]  # ms-swift's RPO term: a masked selection's mean
    # not a count: a mean over a dimension, a sum, a class-weighted cross-entropy, no graph at all
    assert micro_means(logps.mean(-1).sum()) == []
    weighted = F.cross_entropy(logits.view(-1, 7), labels.view(-1), weight=torch.ones(7))
    assert micro_means(weighted) == [] and micro_means(torch.tensor(1.0)) is None
    both = F.cross_entropy(logits.view(-1, 7), labels.view(-1), reduction="sum") / 7 + logps.mean()
    assert micro_means(both) == [("mean", 10)]


@pytest.mark.stack_independent
def test_which_counts_changed():
    a, b = [("mean", 2), ("cross-entropy token mean", 7)], [("mean", 2), ("cross-entropy token mean", 9)]
    assert differing([a, b, a]) == [("cross-entropy token mean", [7, 9, 7])]
    assert differing([a, a]) == [] and differing([a]) == [] and differing([a, None]) == []
    assert differing([a, [("mean", 2)]]) == []  # graphs of different shapes: nothing to compare


# the program's imports, run once per environment by run_python's server (tests/preimported.py): 7.5 s of each run
PRELUDE = r"""
import json, logging, sys, tempfile
import torch, torch.nn.functional as F
import zerofix
zerofix.patch()
from transformers import Trainer, TrainingArguments
from zerofix.check import models
"""
SCRIPT = r"""
records = []
class Capture(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("zerofix").addHandler(Capture())
import os
if os.environ.get("ZEROFIX_LOG") == "info":  # the INFO lines too (zerofix.patch() here: the variable is not read)
    logging.getLogger("zerofix").setLevel(logging.INFO)

KIND = sys.argv[1]
import os
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD > 1:
    from accelerate import PartialState

    PartialState(backend="gloo")  # accelerate >= 1.13 on CPU otherwise sees one process
RANK = int(os.environ.get("RANK", "0"))
STEPS = 2 if KIND == "equal-first" else 1
GAS = 1 if KIND == "ranks" else 4
samples = []
for i in range(8 * STEPS * WORLD // (4 // GAS)):
    ids = torch.randint(1, models.VOCAB, (12,), generator=torch.Generator().manual_seed(i))
    labels = ids.clone()
    if KIND == "ranks":  # one micro-batch a window per rank; the ranks' counts differ, each rank's micro-batch even
        labels[: 2 + 3 * ((i // 2) % 2)] = -100
    elif KIND == "equal-first" and i < 8:
        labels[:4] = -100  # the first window: every micro-batch counts the same labels
    elif KIND != "even":
        labels[: 1 + (i * 3) % 10] = -100  # prompts of uneven length: 2 to 11 counted labels
    samples.append({"input_ids": ids, "labels": labels})

class NllTrainer(Trainer):
    # ORPO's shape: a sequence-level term (a per-sample mean) plus an NLL token mean over the micro-batch
    def _get_train_sampler(self, *args, **kwargs):  # the samples in order: which window holds which is the test's
        from torch.utils.data import SequentialSampler

        return SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
        labels = inputs["labels"][:, 1:]
        logps = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        per_sample = (logps * (labels != -100)).sum(-1).sigmoid().log().mean()
        if KIND == "per-sample":
            return -per_sample
        return -per_sample + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

torch.manual_seed(0)
model = models.build_model("causal-lm")
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, gradient_accumulation_steps=GAS,
                         max_steps=STEPS, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", report_to=[],
                         use_cpu=True, save_strategy="no", logging_strategy="no", max_grad_norm=0,
                         dataloader_drop_last=True, **({"ddp_backend": "gloo"} if WORLD > 1 else {}))
collate = lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
reference = None
if KIND.startswith(("withheld", "framework")):  # the window's token mean, by hand: the model's own loss over all 8 samples
    import copy

    ref = copy.deepcopy(model)
    ref(**collate(samples)).loss.backward()
    reference = {n: -1.0 * p.grad for n, p in ref.named_parameters()}  # SGD, lr 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
if KIND == "withheld":  # axolotl 0.19's shape: the model's own loss, the count withheld by the trainer's flag
    class WithheldTrainer(Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.model_accepts_loss_kwargs = False

        _get_train_sampler = NllTrainer._get_train_sampler

    WithheldTrainer(model=model, args=args, train_dataset=samples, data_collator=collate).train()
elif KIND.startswith("framework"):  # the same trainer as a framework's own code (a package of its own), its __init__
    # wrapped by the framework entry's wrapper as the catalogue wraps axolotl's; "framework-around": a subclass of the
    # script's own whose __init__ runs around the framework's
    import importlib, pathlib, wrapt
    from zerofix.fixes import framework_withheld_count

    where = pathlib.Path(tempfile.mkdtemp())
    (where / "fakefw").mkdir()
    (where / "fakefw" / "__init__.py").write_text("")
    (where / "fakefw" / "trainer.py").write_text(
        "from transformers import Trainer\n"
        "class FrameworkTrainer(Trainer):\n"
        "    def __init__(self, *a, **kw):\n"
        "        super().__init__(*a, **kw)\n"
        "        self.model_accepts_loss_kwargs = False\n"
        "    def _get_train_sampler(self, *args, **kwargs):\n"
        "        from torch.utils.data import SequentialSampler\n"
        "        return SequentialSampler(self.train_dataset)\n")
    sys.path.insert(0, str(where))
    from fakefw.trainer import FrameworkTrainer
    FrameworkTrainer.__init__ = wrapt.FunctionWrapper(vars(FrameworkTrainer)["__init__"],
                                                      framework_withheld_count.axolotl_init)
    chosen = FrameworkTrainer
    if KIND == "framework-around":
        class UserTrainer(FrameworkTrainer):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.model_accepts_loss_kwargs = False  # the user's own word, the same value

        chosen = UserTrainer
    chosen(model=model, args=args, train_dataset=samples, data_collator=collate).train()
else:
    NllTrainer(model=model, args=args, train_dataset=samples, data_collator=collate).train()
from zerofix.fixes import trainer_scaling
rel = None
if reference is not None:
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    rel = max(float((update[n] - r).abs().max()) for n, r in reference.items()) / max(
        float(r.abs().max()) for r in reference.values())
if RANK == 0:
    print("RESULT" + json.dumps({"records": records, "details": trainer_scaling.runtime_details(), "rel": rel},
                                default=str))
if WORLD > 1:  # barrier, leave the group, no interpreter teardown: gloo's threads otherwise sometimes abort on the
    from zerofix.check.rank import finish  # way out (rank 1 SIGABRT in one CI run, after the result was printed)

    finish()
"""


def run(kind, nproc=1, extra_env=None):
    env = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    if nproc > 1:  # the same script on ranks forked after one import (zerofix.check.forkrun, torchrun's stand-in), gloo
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        script = Path(tempfile.mkdtemp()) / "means.py"
        script.write_text(PRELUDE + SCRIPT)
        proc = subprocess.run([sys.executable, "-m", "zerofix.check.forkrun", str(nproc), "--import",
                               "transformers.trainer", str(script), kind],
                              env={**_plain_env(), **env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        proc = run_python(SCRIPT, prelude=PRELUDE, args=(kind,), env=env, timeout=300)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def _plain_env() -> dict:
    import os

    from zerofix.check.host.env import scenario_env

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROFIX", "_ZEROFIX"))}
    ranks_env = scenario_env()  # DeepSpeed's CPU op where this stack built it (tests/test_trainer_sequence_parallel.py)
    env.update(TORCH_EXTENSIONS_DIR=ranks_env["TORCH_EXTENSIONS_DIR"], PATH=ranks_env["PATH"])
    return env


@pytest.mark.slow
@pytest.mark.stack("latest", "2026-04")
def test_a_later_window_and_other_ranks_are_read_until_the_reading_concludes():
    """Issue 59, item 3: a first window of equal counts and a second that differs (silent before on 5.3: step 2 0.19
    off); on two ranks with one micro-batch a window, counts that differ between the ranks (each rank's own even)."""
    later = run("equal-first")
    said = [msg for level, msg in later["records"] if level == "WARNING" and "averages a term over its own" in msg]
    assert len(said) == 1 and "in window 2's 4 micro-batches" in said[0], later["records"]
    ranks = run("ranks", nproc=2)
    said = [msg for level, msg in ranks["records"] if level == "WARNING" and "averages a term over its own" in msg]
    assert len(said) == 1 and "in the first window's 2 micro-batches over 2 processes" in said[0], ranks["records"]


@pytest.mark.slow
@pytest.mark.stack("latest", "2026-04")
def test_a_micro_batch_token_mean_in_a_trainers_loss_is_said_once():
    result = run("uneven")
    said = [msg for level, msg in result["records"] if level == "WARNING" and "averages a term over its own" in msg]
    assert len(said) == 1, result["records"]
    if result["details"][-1]["corrected"]:  # latest: the Trainer's path sums the micro-batch means; zerofix averages
        # them (it scales the loss, which ignores its count, as a micro-batch mean), said in the same one WARNING
        assert "NllTrainer's loss is independent of num_items_in_batch and averages a term over its own micro-batch " \
               "(a cross-entropy token mean over" in said[0]
        assert "the update averages micro-batch means (the Trainer's own path gave 4x that)" in said[0]
        assert [level for level, msg in result["records"] if "independent of num_items_in_batch" in msg] == ["WARNING"]
    else:  # 2026-04: the Trainer's own path averages the micro-batch means, and runs unchanged
        assert "NllTrainer's loss averages a term over its own micro-batch (a cross-entropy token mean over" in said[0]
        assert "that mean of means stays as upstream computes it" in said[0]
    assert "gradient_accumulation_steps=1" in said[0] and "num_items_in_batch" in said[0]
    assert "model_accepts_loss_kwargs" not in said[0], said  # a compute_loss of its own: not the withheld count's words
    assert "a cross-entropy token mean over" in result["details"][-1]["micro_batch_mean"]  # zerofix status says it too
    for kind in ("even", "per-sample"):  # every count the same; no mean over a count at all
        quiet = run(kind)
        assert not [m for _, m in quiet["records"] if "averages a term" in m], (kind, quiet["records"])
        assert "micro_batch_mean" not in quiet["details"][-1], quiet["details"]


@pytest.mark.slow
@pytest.mark.stack("latest", "2026-04")
def test_a_count_the_trainers_own_flag_withholds_is_followed_and_said_with_the_flag():
    """Issue 60: axolotl 0.19's trainer sets ``model_accepts_loss_kwargs = False`` where the model's forward takes
    ``**kwargs``; the Trainer then hands the model's loss no count and averages micro-batch means. zerofix follows the
    setting and its one WARNING names it, and how to hand the count (not "make that term a sum", which a user of the
    model's own loss cannot do)."""
    result = run("withheld")
    said = [msg for level, msg in result["records"] if level == "WARNING" and "averages a term over its own" in msg]
    assert len(said) == 1, result["records"]
    assert "WithheldTrainer set model_accepts_loss_kwargs = False where the model's forward takes **kwargs" in said[0]
    assert "zerofix follows that setting" in said[0] and "cannot hand" not in said[0], said
    assert "zerofix hands it no count against that setting" in said[0], said
    assert "say so with ZEROFIX_HAND_COUNT_TO_MODEL=1" in said[0], said
    assert "set model_accepts_loss_kwargs = True on the trainer once it is built" in said[0], said
    assert result["rel"] > 0.5, result["rel"]  # the mean of micro-batch means, followed: 0.75 off (latest, 2026-04)
    if result["details"][-1]["corrected"]:  # 2026-04 (5.3): accelerate divides again (#45349); zerofix scales the
        # loss once, as the flag says (a micro-batch mean): the mean of the micro-batch means
        assert "zerofix scales it as a micro-batch mean and the update averages micro-batch means (the Trainer's own " \
               "path gave 0.25x that)" in said[0], said
    else:  # latest: the Trainer's own division, the mean of the micro-batch means, unchanged
        assert "that mean of means stays as upstream computes it" in said[0], said


@pytest.mark.slow
@pytest.mark.stack("latest")  # the rule and its wrapper depend on no release (the frameworks' own: their stacks' CLIs)
def test_a_flag_a_frameworks_own_init_sets_is_its_known_bug_and_the_count_is_handed():
    """Issue 67: a flag the framework's own ``__init__`` sets (recorded by the framework entry's wrapper, as on axolotl
    0.17.0 - 0.19.x) is the framework's known bug, not the user's word: without ``ZEROFIX_HAND_COUNT_TO_MODEL`` the count
    is handed and the update is the window's token mean, said at INFO naming the framework's code and the entry. A
    subclass of the user's own whose ``__init__`` runs around the framework's may set the flag itself: followed (the mean
    of means), and the WARNING names both."""
    result = run("framework", extra_env={"ZEROFIX_LOG": "info"})
    assert result["rel"] < 1e-5, result["rel"]
    details = result["details"][-1]
    assert details["count_handed"] == "LlamaForCausalLM" and details["steps_handed"] == 4, details
    assert details["framework_flag"] == "axolotl-withheld-count", details
    assert not [m for level, m in result["records"] if level == "WARNING"], result["records"]
    said = [m for level, m in result["records"] if level == "INFO" and "a known bug of axolotl" in m]
    assert len(said) == 1 and said[0].startswith("zerofix: FrameworkTrainer.__init__ (axolotl "), said
    assert "set model_accepts_loss_kwargs = False for LlamaForCausalLM, a known bug of axolotl >=0.17.0,<0.20.0 " \
           "(axolotl-withheld-count, fixed in 0.20.0: https://github.com/axolotl-ai-cloud/axolotl/pull/3982), not " \
           "your word" in said[0], said

    around = run("framework-around")
    assert around["rel"] > 0.5, around["rel"]  # followed: the mean of micro-batch means, as upstream
    assert "count_handed" not in around["details"][-1], around["details"]
    said = [m for level, m in around["records"] if level == "WARNING" and "averages a term over its own" in m]
    assert len(said) == 1, around["records"]
    assert "FrameworkTrainer.__init__ (axolotl " in said[0] and "set model_accepts_loss_kwargs = False (a known bug " \
           "of its releases: axolotl-withheld-count) and UserTrainer.__init__ runs around it, so the setting may also " \
           "be yours" in said[0], said
    assert "say so with ZEROFIX_HAND_COUNT_TO_MODEL=1" in said[0], said


@pytest.mark.slow
@pytest.mark.stack("latest", "2026-04")
def test_a_withheld_count_is_handed_where_the_user_says_so_and_the_update_is_the_window_token_mean():
    """Issue 60: ``ZEROFIX_HAND_COUNT_TO_MODEL=1`` says the trainer's own ``model_accepts_loss_kwargs = False`` is not the
    user's word: zerofix hands the model's loss the count, every step's loss is found divided by it, and the update is
    the window's token mean (the gradient of the model's own loss over all 8 samples in one batch, computed by hand in
    the same process), said at INFO, no WARNING of micro-batch means."""
    result = run("withheld", extra_env={"ZEROFIX_HAND_COUNT_TO_MODEL": "1", "ZEROFIX_LOG": "info"})
    assert result["rel"] < 1e-5, result["rel"]
    details = result["details"][-1]
    assert details["count_handed"] == "LlamaForCausalLM" and details["steps_handed"] == 4, details
    assert not [m for level, m in result["records"] if level == "WARNING"], result["records"]
    said = [m for level, m in result["records"] if level == "INFO" and "ZEROFIX_HAND_COUNT_TO_MODEL=1 says" in m]
    assert len(said) == 1 and "WithheldTrainer set model_accepts_loss_kwargs = False for LlamaForCausalLM" in said[0]

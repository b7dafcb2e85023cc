"""``zerofix check`` on the user's own configuration (``--deepspeed``, ``--gas``, ``--bf16``, ``--trainer-args``,
``--model``), its failure reports (the real exception, the kept log, the no-torch rows, the pre-flight line)
and zerofix's line in a Trainer run's own log.

The resolution of a configuration and the reports are plain functions, tested without ranks; the real runs
train the user-style configurations on 2026-04 and latest and assert the verdicts the built-in scenarios
show on those stacks (tests/test_check.py): the same bug, the same fix, whatever the configuration says.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from test_check import run_cli  # noqa: I001 - tests/ is on the path (conftest), as test_check imports conftest
from zerofix.check import command, launch, plan, report, userconfig

# A user-style ZeRO-2 configuration: what the Hugging Face docs' examples look like.
ZERO2 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
                          "allgather_bucket_size": 2e8, "reduce_bucket_size": "auto"},
    "steps_per_print": 100,
}
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
ZERO2_OFFLOAD = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"},
}

# ZeRO-1 in bf16 with an fp32 gradient accumulator: DeepSpeed builds its BF16_Optimizer (0.16, 0.18.5 and later)
ZERO1_BF16_FP32_ACCUMULATOR = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
}


def write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


# ---- resolving a configuration: no ranks --------------------------------------------------------------------

def test_autos_resolve_as_the_trainer_resolves_them(tmp_path):
    cfg = userconfig.load(write(tmp_path, "ds.json", ZERO2), gas=4, nproc=2, deepspeed_version="0.18.9")
    assert (cfg.stage, cfg.gas, cfg.micro_batch, cfg.clip, cfg.dtype, cfg.offload) == (2, 4, 2, 1.0, "fp32", None)
    assert cfg.ds["train_micro_batch_size_per_gpu"] == 2 and cfg.ds["gradient_accumulation_steps"] == 4
    assert cfg.ds["zero_optimization"]["reduce_bucket_size"] == userconfig.HIDDEN ** 2  # hidden_size * hidden_size
    assert "train_batch_size" not in cfg.ds and "optimizer" not in cfg.ds and "scheduler" not in cfg.ds
    assert cfg.ds["bf16"] == {"enabled": False}
    assert cfg.notes == ("the optimizer and scheduler sections are left out: the check trains with torch SGD at a "
                         "constant rate, as its reference does",)
    assert cfg.summary() == ("ZeRO-2, GAS 4, micro-batch 2, fp32, clipping 1, overlap_comm, contiguous_gradients")
    z3 = userconfig.load(write(tmp_path, "z3.json", ZERO3), nproc=2, deepspeed_version="0.18.9")
    assert z3.gas == userconfig.DEFAULT_GAS and z3.clip == 1.0  # "auto": the Trainer's max_grad_norm default
    assert z3.ds["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * userconfig.HIDDEN ** 2)
    assert z3.ds["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * userconfig.HIDDEN


def test_trainer_arguments_flow_in_and_a_pickle_is_refused(tmp_path):
    args = write(tmp_path, "args.json", {"gradient_accumulation_steps": 8, "per_device_train_batch_size": 3,
                                         "max_grad_norm": 0.5, "average_tokens_across_devices": False,
                                         "bf16": True, "output_dir": "x", "learning_rate": 1e-5})
    cfg = userconfig.load(write(tmp_path, "ds.json", ZERO3), trainer_args=args, deepspeed_version="0.19.8")
    assert (cfg.gas, cfg.micro_batch, cfg.clip, cfg.dtype, cfg.average_tokens) == (8, 3, 0.5, "bf16", False)
    with pytest.raises(userconfig.ConfigError, match="training_args.bin is a pickle"):
        userconfig.load(write(tmp_path, "ds2.json", ZERO3), trainer_args=str(tmp_path / "training_args.bin"))


def test_absent_clipping_is_deepspeeds_default_per_release(tmp_path):
    bare = write(tmp_path, "ds.json", {"zero_optimization": {"stage": 1}})
    assert userconfig.load(bare, deepspeed_version="0.19.8").clip == 1.0
    assert userconfig.load(bare, deepspeed_version="0.18.9").clip == 0.0


def test_offload_and_what_cpu_cannot_reproduce(tmp_path):
    cfg = userconfig.load(write(tmp_path, "ds.json", ZERO2_OFFLOAD))
    assert cfg.offload == "cpu" and cfg.ds["zero_force_ds_cpu_optimizer"] is False and not cfg.unreproducible
    nvme = {**ZERO2_OFFLOAD, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert "offload_param to nvme" in userconfig.load(write(tmp_path, "nvme.json", nvme)).unreproducible[0]
    fp16 = userconfig.load(write(tmp_path, "fp16.json", {**ZERO2, "fp16": {"enabled": "auto"}}), fp16=True)
    assert fp16.dtype == "fp16" and "no fp16" in fp16.unreproducible[0]


@pytest.mark.parametrize("config, kwargs, message", [
    ({**ZERO2, "gradient_accumulation_steps": 8}, {"gas": 4}, "gradient_accumulation_steps=8 but the run uses 4"),
    ({**ZERO2, "train_batch_size": 7}, {"gas": 4}, "train_batch_size=7, but micro-batch 2 x GAS 4 x 2 ranks is 16"),
    ({**ZERO2, "bf16": {"enabled": False}}, {"bf16": True}, "--bf16 but --deepspeed"),
    ({"zero_optimization": {"stage": 5}}, {}, "stage must be 0, 1, 2 or 3"),
    ({**ZERO2, "wall_clock_breakdown": "auto"}, {}, "does not know how to resolve \"auto\" for wall_clock_breakdown"),
    ("{not json", {}, "not valid JSON"),
    ("[1, 2]", {}, "a JSON object is expected"),
])
def test_bad_configurations_name_the_fix(tmp_path, config, kwargs, message):
    with pytest.raises(userconfig.ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        userconfig.load(write(tmp_path, "ds.json", config), nproc=2, **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--gas", "4"], "--gas describes your own run, which needs its DeepSpeed config too: add --deepspeed"),
    (["--model", "m", "--bf16"], "--bf16 describes your own run"),  # --model and --gas alone run (issue 59)
    (["--model", "m", "--quick"], "--quick runs the built-in scenarios; leave it out with --model"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["--deepspeed", "{ds}", "--gas", "0"], "argument --gas: 0 is not a positive number"),
    (["--deepspeed", "{bad}"], "not valid JSON (Expecting property name enclosed in double quotes, line 1, column 2); "
                               "give the DeepSpeed config file your run passes"),
    (["--deepspeed", "/nonexistent/ds.json"], "--deepspeed /nonexistent/ds.json: no such file"),
    (["--deepspeed", "{ds}", "--quick"], "--quick runs the built-in scenarios"),
    (["--deepspeed", "{ds}", "--only", "zero3-loss-*"], "no scenario matches 'zero3-loss-*'"),  # ZeRO-2 has none
])
def test_usage_errors_of_the_own_configuration(tmp_path, capsys, argv, message):
    ds, bad = write(tmp_path, "ds.json", ZERO2), tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_cli(*[a.replace("{ds}", ds).replace("{bad}", str(bad)) for a in argv]) == 2
    assert message in capsys.readouterr().err


def test_rows_for_a_configuration(tmp_path):
    z2 = userconfig.load(write(tmp_path, "z2.json", ZERO2_OFFLOAD), gas=4)
    names = [r.name for r in plan.user_scenarios(z2)]
    assert names == ["trainer-causal-lm", "trainer-custom", "accelerate-causal-lm", "deepspeed-manual", "deepspeed-own"]
    assert all("deepspeed-offload-accumulator" in r.fixes for r in plan.user_scenarios(z2) if r.name != "deepspeed-manual")
    z3 = userconfig.load(write(tmp_path, "z3.json", ZERO3), bf16=False)
    rows = plan.user_scenarios(z3, model_name="GPT2LMHeadModel", tied=True)
    assert [r.name for r in rows][-2:] == ["zero3-loss-inside", "zero3-loss-outside"] and "tied" in rows[-1].title
    assert "trainer-custom" not in [r.name for r in rows]  # --model: the Trainer trains that class only
    bf16 = userconfig.load(write(tmp_path, "b.json", ZERO2), bf16=True)
    assert {r.tolerance for r in plan.user_scenarios(bf16)} == {plan.BF16_TOLERANCE}
    bf16_rows = plan.user_scenarios(bf16)
    assert not any("deepspeed-bf16-boundary-reduction" in r.fixes for r in bf16_rows)  # ZeRO-2: not that optimizer
    accumulator = userconfig.load(write(tmp_path, "a.json", ZERO1_BF16_FP32_ACCUMULATOR), bf16=True)
    assert all({"deepspeed-bf16-boundary-reduction", "deepspeed-bf16-loss-scale"} <= set(r.fixes)
               for r in plan.user_scenarios(accumulator))
    zero0 = {**ZERO1_BF16_FP32_ACCUMULATOR, "zero_optimization": {"stage": 0}}
    del zero0["data_types"]  # ZeRO-0 in bf16: FP16_UnfusedOptimizer from DeepSpeed 0.17.6
    zero0_rows = plan.user_scenarios(userconfig.load(write(tmp_path, "z0.json", zero0), bf16=True))
    assert all("deepspeed-bf16-loss-scale" in r.fixes and "deepspeed-bf16-boundary-reduction" not in r.fixes
               for r in zero0_rows)
    assert not any("deepspeed-bf16-loss-scale" in r.fixes for r in bf16_rows)  # ZeRO-2


# ---- --model: a tiny model of the user's class ------------------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
         "max_position_embeddings": 8192, "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "rope_theta": 500000.0}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
        "vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
         "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
         "max_position_embeddings": 32768, "tie_word_embeddings": True, "bos_token_id": 151643,
         "eos_token_id": 151643, "sliding_window": 32768, "max_window_layers": 21, "use_sliding_window": False}


@pytest.mark.parametrize("config, cls, tied", [(LLAMA, "LlamaForCausalLM", False), (GPT2, "GPT2LMHeadModel", True),
                                               (QWEN2, "Qwen2ForCausalLM", True)])
def test_model_builds_a_tiny_model_of_the_same_class(tmp_path, config, cls, tied):
    pytest.importorskip("transformers")
    import torch

    from zerofix.check import models, usermodel

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    kind, described = usermodel.prepare(model_dir, tmp_path / "work")
    assert (described["class"], described["tied_head"]) == (cls, tied)
    model = models.build_model(kind, seed=0)
    assert type(model).__name__ == cls and described["parameters"] < 100_000
    # a size left to the class's default is shrunk too (GPT-2's file here names no n_positions: 1024 by default)
    assert getattr(model.config, "max_position_embeddings", None) == 64
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head is embed) == tied and tuple(head.shape) == (usermodel.VOCAB, userconfig.HIDDEN)
    # no dropout (the reference could not repeat its masks), the class's defaults included (GPT-2's 0.1)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(0 <= getattr(model.config, t, 0) < usermodel.VOCAB for t in usermodel.SPECIAL_TOKENS
               if isinstance(getattr(model.config, t, None), int))
    # the same weights from the same seed: the reference rebuilds the model in another process
    assert all((a == b).all() for a, b in zip(model.state_dict().values(),
                                              models.build_model(kind, seed=0).state_dict().values()))


BERT_CLS = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "hidden_size": 768,
            "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522,
            "id2label": {"0": "NEG", "1": "POS"}, "label2id": {"NEG": 0, "POS": 1}, "hidden_dropout_prob": 0.1}
QWEN2_REWARD = {**QWEN2, "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}


@pytest.mark.parametrize("config, cls", [(BERT_CLS, "BertForSequenceClassification"),
                                         (QWEN2_REWARD, "Qwen2ForSequenceClassification")])
def test_model_builds_a_tiny_sequence_classifier(tmp_path, config, cls):
    """A sequence classifier (a reward model's num_labels=1 included) is built with the check's 3 classes: the
    scaling depends on whether its loss reads num_items_in_batch, not on the loss's form."""
    pytest.importorskip("transformers")
    import torch

    from zerofix.check import models, usermodel

    (tmp_path / "config.json").write_text(json.dumps(config))
    kind, described = usermodel.prepare(tmp_path / "config.json", tmp_path / "work")
    assert (described["class"], described["task"]) == (cls, "sequence") and models.task_of(kind) == "sequence"
    model = models.build_model(kind, seed=0)
    assert type(model).__name__ == cls and model.config.num_labels == models.NUM_LABELS
    assert usermodel.NUM_LABELS == models.NUM_LABELS and usermodel.TYPED == models.TYPED  # the constants they share
    batch = models.collate([0, 1, 2, 3], task="sequence")
    loss_sum, count = models.loss_sum(kind, model, batch)
    assert count == 4 and torch.isfinite(loss_sum)
    assert plan.user_scenarios(userconfig.load(write(tmp_path, "ds.json", ZERO2), gas=None, nproc=2),
                               model_name=cls, task="sequence")[0].name == "trainer-seq-cls"


@pytest.mark.parametrize("config, message", [
    ({"model_type": "no-such-model"}, "model_type 'no-such-model' is unknown to transformers"),
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"},
     "BertForMaskedLM is neither a causal language model nor a sequence classifier"),
    ({"hidden_size": 8}, "no model_type"),
])
def test_a_config_whose_class_cannot_be_built_is_a_clear_error(tmp_path, config, message):
    pytest.importorskip("transformers")
    from zerofix.check import usermodel

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(userconfig.ConfigError, match=message):
        usermodel.prepare(tmp_path / "config.json", tmp_path / "work")


# ---- failure reports: no ranks -------------------------------------------------------------------------------

# What torchrun printed when DeepSpeed could not build its CPU communication op (no compiler; trimmed from a
# real launcher.log): torchrun's footer names no exception, the ranks never had a process group.
COMPILER_FAILURE = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 2893, in _run_ninja_build
    subprocess.run(
subprocess.CalledProcessError: Command '['ninja', '-v']' returned non-zero exit status 1.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 2910, in _run_ninja_build
    raise RuntimeError(message) from e
RuntimeError: Error building extension 'deepspeed_shm_comm': [1/3] /nonexistent/c++ -MMD -MF shm_interface.o.d
FAILED: shm_interface.o
/bin/sh: 1: /nonexistent/c++: not found
ninja: build stopped: subcommand failed.

Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/deepspeed/ops/op_builder/builder.py", line 530, in load
ImportError: /tmp/ext/deepspeed_shm_comm/deepspeed_shm_comm.so: cannot open shared object file
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 29418)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""


def test_the_real_exception_of_a_rank_that_died_before_connecting():
    assert launch.failing_rank_tail(COMPILER_FAILURE) == (
        "RuntimeError: Error building extension 'deepspeed_shm_comm': [1/3] /nonexistent/c++ -MMD -MF "
        "shm_interface.o.d\n/bin/sh: 1: /nonexistent/c++: not found")
    assert launch.real_cause("just a log line that mentions ValueError: x\nand more") is None


def test_a_failed_build_is_the_cause_even_where_a_peer_wrote_its_error_first(tmp_path):
    """CI: rank 1 built DeepSpeed's op and failed; rank 0, waiting on torch's build lock, loaded the missing library and
    wrote its ImportError first. The report names the build's failure; otherwise the oldest error is the cause."""
    missing = "Traceback (most recent call last):\nImportError: /ext/deepspeed_shm_comm.so: cannot open shared object"
    failed = COMPILER_FAILURE.split("ninja: build stopped", 1)[0]  # its CalledProcessError, then the RuntimeError
    assert "RuntimeError: Error building extension" in failed and "ImportError" not in failed
    for rank, traceback, when in ((0, missing, 100), (1, failed, 101), (2, "Traceback\nValueError: later", 102)):
        path = tmp_path / f"error.rank{rank}"
        path.write_text(json.dumps({"traceback": traceback}))
        os.utime(path, (when, when))
    assert launch.first_error(tmp_path) == (1, failed)
    (tmp_path / "error.rank1").unlink()
    assert launch.first_error(tmp_path) == (0, missing)


def test_the_raw_output_names_a_failed_build_even_where_a_peers_importerror_came_first():
    """torchrun's output, where the peer waiting on torch's build lock printed its ImportError before the building
    rank's failure: the build is still the cause. Without one, the first exception is."""
    building = COMPILER_FAILURE.split("\nTraceback (most recent call last):\n  File \"/venv/lib/python3.11/site-packages/"
                                      "deepspeed", 1)[0]
    missing = ("Traceback (most recent call last):\n  File \"/venv/lib/python3.11/site-packages/deepspeed/ops/op_builder/"
               "builder.py\", line 530, in load\nImportError: /tmp/ext/deepspeed_shm_comm.so: cannot open shared object file\n")
    assert "ImportError" not in building and "Error building extension" in building
    assert launch.real_cause(missing + building) == (
        "RuntimeError: Error building extension 'deepspeed_shm_comm': [1/3] /nonexistent/c++ -MMD -MF "
        "shm_interface.o.d\n/bin/sh: 1: /nonexistent/c++: not found")
    later = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: later\n"
    assert launch.real_cause(missing + later) == "ImportError: /tmp/ext/deepspeed_shm_comm.so: cannot open shared object file"


def test_without_torch_every_row_is_skipped_and_the_exit_is_0(monkeypatch, capsys):
    monkeypatch.setattr(command, "versions", lambda: {"zerofix": "0", "torch": None, "transformers": None,
                                                      "accelerate": None, "deepspeed": None, "trl": None, "datasets": None})
    monkeypatch.setattr(plan, "installed_version", lambda dist: None)
    assert run_cli("--quick") == 0
    out = capsys.readouterr().out
    assert "pre-flight: torch is not installed" in out
    assert out.count("skipped: torch") == len(plan.select(quick=True))


def test_preflight_names_a_missing_compiler(monkeypatch):
    rows = plan.select(only=["deepspeed-zero2-manual"])
    found = {"torch": "2.13.0", "deepspeed": "0.19.8"}
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    line = report.preflight(found, rows)
    assert line.startswith("pre-flight: no C++ compiler ($CXX=/nonexistent/c++ not found)")
    monkeypatch.delenv("CXX")
    monkeypatch.setattr("shutil.which", lambda name, path=None: f"/usr/bin/{name}")
    monkeypatch.setattr(report, "_op_built", lambda where: True)
    assert report.preflight(found, rows) == "pre-flight: ok (C++ compiler /usr/bin/c++)"


def test_preflight_names_a_missing_ninja_and_an_op_still_to_build(monkeypatch):
    """Issue 42: without ninja every DeepSpeed row failed although the compiler was there; a first build sat
    silent for about 100 s."""
    rows = plan.select(only=["deepspeed-zero2-manual"])
    found = {"torch": "2.13.0", "deepspeed": "0.19.8"}
    monkeypatch.setattr("shutil.which", lambda name, path=None: None if name == "ninja" else f"/usr/bin/{name}")
    line = report.preflight(found, rows)
    assert "no ninja on the ranks' PATH" in line and "pip install ninja" in line, line
    monkeypatch.setattr("shutil.which", lambda name, path=None: f"/usr/bin/{name}")
    monkeypatch.setattr(report, "_op_built", lambda where: False)
    assert "DeepSpeed's CPU op is not built yet: the first DeepSpeed run builds it" in report.preflight(found, rows)


def test_the_ranks_and_the_prebuild_find_this_environments_ninja_first(monkeypatch):
    """Issue 42: make (the environment's bin off PATH) and an activated environment used two ninjas, each
    rebuilding the other's op. The ranks' PATH starts with the interpreter's own bin directory, whatever the
    caller's PATH."""
    import sys

    from zerofix.check import launch

    here = os.path.dirname(sys.executable)
    for caller in ("/usr/local/bin:/usr/bin", f"/usr/bin:{here}", ""):
        monkeypatch.setenv("PATH", caller)
        path = launch.scenario_env()["PATH"].split(os.pathsep)
        assert path[0] == here and path.count(here) == 1, path


def test_advice_names_the_fixes_and_their_upstream_releases():
    rows = [{"status": "fixed", "applied": ["deepspeed-offload-accumulator", "deepspeed-manual-accumulation"]},
            {"status": "ok", "applied": []}]
    text = report.advice(rows)
    assert "deepspeed-offload-accumulator (fixed upstream in deepspeed 0.19.0" in text
    assert "deepspeed-manual-accumulation (no upstream release fixes it yet)" in text
    assert report.advice([{"status": "ok", "applied": []}]).endswith("every scenario that ran is right without zerofix")


# ---- zerofix in a Trainer run's own log: no ranks -----------------------------------------------------------

def test_trainer_report_lines():
    from zerofix import trainer_report
    from zerofix.patching import Record

    engine = {"engine": "0x1", "zero_stage": 2, "active": True, "why": "ZeRO-2: bucket reduction at step()",
              "warnings": ["short-window"]}
    records = [Record("a-fix", "applied", "deepspeed", "0.19.8", "", "", (engine,)),
               Record("b-fix", "not-affected", "transformers", "5.23.0", "", "")]
    assert trainer_report.summary_lines(records) == [
        "zerofix: 1 fix acts on this run (through DeepSpeed): a-fix (deepspeed 0.19.8)"]
    # a run without DeepSpeed names the Trainer's entry as acting and DeepSpeed's only as installed
    scaling = Record("t-fix", "applied", "transformers", "5.23.0", "", "")
    assert trainer_report.summary_lines([scaling, records[0]], deepspeed=False) == [
        "zerofix: 1 fix acts on this run (no DeepSpeed): t-fix (transformers 5.23.0)",
        "zerofix: also applied in this process, for paths this run does not take: a-fix"]
    seen = set()
    assert len(trainer_report.engine_lines(records, seen)) == 1 and trainer_report.engine_lines(records, seen) == []
    assert "short-window" in trainer_report.warning_lines(records, set())[0]
    assert "changes nothing" in trainer_report.summary_lines(records[1:])[0]
    # issue 69: a fix that failed (a --no-deps install without wrapt) is said as failed, never as out of range
    failed = Record("c-fix", "failed", "transformers", "5.6.0", "", "ModuleNotFoundError: No module named 'wrapt'")
    said = trainer_report.summary_lines([records[1], failed])
    assert len(said) == 1 and "no fix applies to the installed releases" not in said[0], said
    assert said[0] == ("zerofix is active, but no fix is applied, so it changes nothing in this run; 1 fix(es) in range "
                       "could not be applied: c-fix failed (ModuleNotFoundError: No module named 'wrapt')"), said
    said = trainer_report.summary_lines([scaling, failed], deepspeed=False)
    assert said[-1].startswith("zerofix: not applied in this process; 1 fix(es) in range could not be applied: c-fix "
                               "failed"), said


def test_patch_registers_the_callback_and_unpatch_removes_it():
    pytest.importorskip("transformers")
    import transformers.trainer

    import zerofix
    from zerofix import trainer_report

    before = list(transformers.trainer.DEFAULT_CALLBACKS)
    zerofix.patch(fixes=["deepspeed-manual-accumulation"])
    try:
        assert transformers.trainer.DEFAULT_CALLBACKS == before + [trainer_report.callback_class()]
        zerofix.patch(fixes=["deepspeed-manual-accumulation"])  # twice: registered once
        assert transformers.trainer.DEFAULT_CALLBACKS.count(trainer_report.callback_class()) == 1
    finally:
        zerofix.unpatch()
    assert transformers.trainer.DEFAULT_CALLBACKS == before


# ---- real runs -------------------------------------------------------------------------------------------------

def check_json(tmp_path, *argv) -> dict:
    out = tmp_path / "check.json"
    code = run_cli(*argv, "--json", str(out), "--workdir", str(tmp_path / "work"))
    document = json.loads(out.read_text())
    assert document["exit_code"] == code
    return document


def verdicts(document) -> dict:
    return {r["name"]: r["verdict"] for r in document["scenarios"]}


# Per stack and configuration: the verdicts, as the built-in scenarios show them there (tests/test_check.py):
# 2026-04's DeepSpeed 0.18.9 divides accelerate's loss twice (deepspeed-output-hook-division) and both releases keep
# only the last micro-batch of a manual ZeRO-1/2 window (deepspeed-manual-accumulation).
MANUAL = "fixed by deepspeed-manual-accumulation"
OWN_CONFIG = {
    ("2026-04", "zero2"): {"trainer-causal-lm": "ok", "trainer-custom": "ok",
                           "accelerate-causal-lm": "fixed by deepspeed-output-hook-division",
                           "deepspeed-manual": MANUAL, "deepspeed-own": "ok"},
    ("latest", "zero2"): {"trainer-causal-lm": "ok", "accelerate-causal-lm": "ok", "deepspeed-manual": MANUAL,
                          "deepspeed-own": "ok"},
}


@pytest.mark.distributed
@pytest.mark.stack("2026-04")
def test_own_zero2_configuration_on_2026_04(tmp_path):
    """The user-style ZeRO-2 config (overlap_comm, "auto" sizes, clipping 1.0, AdamW and scheduler sections), GAS 4:
    DeepSpeed 0.18.9's output hook divides accelerate's loss twice, manual accumulation keeps the last micro-batch.
    (Its custom-module Trainer row is the same path as the causal LM's; left out for CI time. The ZeRO-3 and
    CPU-offload configurations: docs/check.md, measured by hand on both stacks.)"""
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", ZERO2), "--gas", "4",
                          "--skip", "trainer-custom")
    assert verdicts(document) == {k: v for k, v in OWN_CONFIG[("2026-04", "zero2")].items() if k != "trainer-custom"}
    rows = {r["name"]: r for r in document["scenarios"]}
    assert rows["accelerate-causal-lm"]["unpatched"]["ratio"] == pytest.approx(1 / 4, rel=1e-4)
    assert rows["deepspeed-manual"]["unpatched"]["cosine"] < 0.5  # only the last micro-batch survives
    assert document["configuration"]["summary"].startswith("ZeRO-2, GAS 4, micro-batch 2, fp32, clipping 1")
    assert document["exit_code"] == 0


@pytest.mark.distributed
@pytest.mark.stack("2026-04")
def test_own_bf16_configuration_with_an_fp32_accumulator_on_2026_04(tmp_path):
    """ZeRO-1, bf16, data_types.grad_accum_dtype fp32 (DeepSpeed's BF16_Optimizer), GAS 4: DeepSpeed 0.18.9 never
    averages the boundary micro-batch in any loop (deepspeed-bf16-boundary-reduction); accelerate's loss is also
    divided twice by the output hook. The manual loop is not deepspeed-manual-accumulation's: the BF16 optimizer
    adds every backward by itself, so that entry follows and is not named."""
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", ZERO1_BF16_FP32_ACCUMULATOR), "--bf16",
                          "--gas", "4", "--skip", "trainer-custom")
    bf16 = "fixed by deepspeed-bf16-boundary-reduction"
    assert verdicts(document) == {"trainer-causal-lm": bf16, "deepspeed-manual": bf16, "deepspeed-own": bf16,
                                  "accelerate-causal-lm": "fixed by deepspeed-output-hook-division + "
                                  "deepspeed-bf16-boundary-reduction"}
    for row in document["scenarios"]:  # the unpatched half is the measured bug, the patched one bf16 rounding
        assert row["unpatched"]["rel_err"] > 0.3 and row["patched"]["rel_err"] < plan.BF16_TOLERANCE, row
    assert document["exit_code"] == 0


# DeepSpeed 0.18.3 builds FP16_UnfusedOptimizer for ZeRO-1 bf16 + fp32 accumulator: no update unpatched. The
# Trainer passes scale_wrt_gas=False, which 0.18.3's output hook ignores (deepspeed-scale-wrt-gas); accelerate's loss
# is divided at both outputs (deepspeed-output-hook-division).
LOSS_SCALE = "deepspeed-bf16-loss-scale"
OWN_BF16_2025_12 = {"trainer-causal-lm": f"fixed by deepspeed-scale-wrt-gas + {LOSS_SCALE}",
                    "accelerate-causal-lm": f"fixed by deepspeed-output-hook-division + {LOSS_SCALE}",
                    "deepspeed-manual": f"fixed by {LOSS_SCALE}", "deepspeed-own": f"fixed by {LOSS_SCALE}"}


@pytest.mark.distributed
@pytest.mark.stack("2025-12")
def test_own_bf16_configuration_with_an_fp32_accumulator_on_2025_12(tmp_path):
    """The same configuration on DeepSpeed 0.18.3, which builds FP16_UnfusedOptimizer for it, not BF16_Optimizer:
    no update at all unpatched (deepspeed-bf16-loss-scale). deepspeed-bf16-boundary-reduction is applied (in
    range) but meets no optimizer of its class, so no row names it: the Trainer's rows from what the entry
    changed (its runtime details), DeepSpeed's from the optimizer the engine built."""
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", ZERO1_BF16_FP32_ACCUMULATOR), "--bf16",
                          "--gas", "4", "--skip", "trainer-custom")
    assert verdicts(document) == OWN_BF16_2025_12, verdicts(document)
    for row in document["scenarios"]:
        assert "deepspeed-bf16-boundary-reduction" not in row["verdict"], row
        assert row["patched"]["rel_err"] < plan.BF16_TOLERANCE, row


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_own_configuration_with_a_tied_model_on_latest(tmp_path):
    """ZeRO-2 with the user's GPT-2 class (tied head) and Trainer arguments (clipping 0.5, GAS 4): the Trainer row
    trains a tiny GPT2LMHeadModel, the manual row shows the bug upstream has not fixed. (The accelerate and
    own-style rows: in the 2026-04 test and the built-in run.)"""
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(GPT2))
    args = write(tmp_path, "args.json", {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 2,
                                         "max_grad_norm": 0.5})
    config = {**ZERO2, "gradient_clipping": "auto"}
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", config), "--trainer-args", args,
                          "--model", str(model_dir), "--only", "trainer-causal-lm,deepspeed-manual")
    assert verdicts(document) == {k: v for k, v in OWN_CONFIG[("latest", "zero2")].items()
                                  if k in ("trainer-causal-lm", "deepspeed-manual")}
    assert document["configuration"]["model"]["class"] == "GPT2LMHeadModel"
    assert document["configuration"]["summary"].startswith("ZeRO-2, GAS 4, micro-batch 2, fp32, clipping 0.5")
    # Clipping acts here (the tiny GPT-2's first window's gradient norm is about 1.4, clipped to 0.5), so the
    # Trainer row is right only because the reference clips as DeepSpeed does.
    trainer = next(r for r in document["scenarios"] if r["name"] == "trainer-causal-lm")
    assert trainer["patched"]["rel_err"] < 1e-4


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_zerofix_says_once_in_a_trainer_runs_log_what_it_applies(tmp_path):
    """ZEROFIX=1 (activation in every rank), the Trainer through DeepSpeed ZeRO-2 on 2 ranks: the run's own log
    (transformers' logger, main process) names the fixes acting on its path once and the engine the DeepSpeed fix
    saw; without DeepSpeed, DeepSpeed's fixes are named only as applied in the process."""
    launch.torchrun("zerofix.check.scenarios.trainer_gas", ["--zerofix", "env", "--zero-stage", "2", "--gas", "2"],
                    nproc=2, out_dir=tmp_path, env={"ZEROFIX": "1", "TRANSFORMERS_VERBOSITY": "warning"})
    lines = [line for line in (tmp_path / "launcher.log").read_text().splitlines() if "zerofix:" in line]
    applied = [line for line in lines if "on this run (through DeepSpeed)" in line]
    assert len(applied) == 1 and "deepspeed-manual-accumulation (deepspeed " in applied[0] \
        and "transformers-trainer-scaling (transformers " in applied[0], lines
    engines = [line for line in lines if "on the DeepSpeed engine" in line]
    assert len(engines) == 1 and "(ZeRO-2)" in engines[0]
    launch.torchrun("zerofix.check.scenarios.trainer_gas", ["--zerofix", "env", "--gas", "2"], nproc=1,
                    out_dir=tmp_path / "ddp", env={"ZEROFIX": "1", "TRANSFORMERS_VERBOSITY": "warning"})
    lines = [line for line in (tmp_path / "ddp" / "launcher.log").read_text().splitlines() if "zerofix:" in line]
    acting = [line for line in lines if "on this run (no DeepSpeed)" in line]
    assert len(acting) == 1 and "transformers-trainer-scaling" in acting[0] and "deepspeed-" not in acting[0], lines
    assert any("also applied in this process" in line and "deepspeed-manual-accumulation" in line for line in lines)


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_a_compiler_failure_shows_deepspeeds_real_exception(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # empty: DeepSpeed must build
    document = check_json(tmp_path, "--only", "deepspeed-zero2-manual")
    row = document["scenarios"][0]
    assert row["status"] == "failed" and document["exit_code"] == 1
    assert "RuntimeError: Error building extension 'deepspeed_shm_comm'" in row["tail"]
    # the shell's own words, or ccache's where torch's builder puts ccache in front of the compiler (CI installs it)
    assert "/nonexistent/c++: not found" in row["tail"] or \
        "execute_noreturn of /nonexistent/c++ failed: No such file or directory" in row["tail"], row["tail"]
    log = row["tail"].rsplit("full log: ", 1)[1].strip()
    assert log.startswith(str(tmp_path / "work")) and os.path.exists(log), row["tail"]


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_own_configuration_with_a_classifier_on_latest(tmp_path):
    """ZeRO-2 (AdamW, clipping 1.0: the configuration above) with the user's BERT classifier: transformers 5.23
    scales its loss GAS x processes too large; patched, transformers-trainer-scaling makes it the mean over the
    window's samples (the update's ratio is not 8 here: AdamW and clipping are not linear in the loss)."""
    (tmp_path / "config.json").write_text(json.dumps(BERT_CLS))
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", ZERO2), "--model",
                          str(tmp_path / "config.json"), "--only", "trainer-seq-cls")
    assert verdicts(document) == {"trainer-seq-cls": "fixed by transformers-trainer-scaling"}
    row = document["scenarios"][0]
    assert row["unpatched"]["rel_err"] > 0.3 and row["patched"]["rel_err"] < 1e-4, row


QWEN2_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
             "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
             "num_experts": 60, "num_experts_per_tok": 4, "output_router_logits": True, "router_aux_loss_coef": 0.5}


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_own_configuration_with_an_moe_model_on_latest(tmp_path):
    """ZeRO-2 with the user's Qwen2-MoE (output_router_logits): one forward of the tiny model adds a router
    auxiliary loss, so the Trainer row's reference weights it as in one big batch and transformers-moe-aux-loss
    fixes the GAS x too heavy term (issue 40)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_MOE))
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", {**ZERO2, "gradient_clipping": 0}),
                          "--model", str(tmp_path / "config.json"), "--only", "trainer-causal-lm")
    assert verdicts(document) == {"trainer-causal-lm": "fixed by transformers-moe-aux-loss"}
    assert document["configuration"]["model"]["moe"] is True
    row = document["scenarios"][0]
    assert row["unpatched"]["rel_err"] > 0.05 and row["patched"]["rel_err"] < 1e-5, row


@pytest.mark.parametrize("config, message", [
    ({"zero_optimisation": {"stage": 2}}, "unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)"),
    ({"zero_optimization": {"stage": 2, "overlap_coom": True}},
     "unknown key zero_optimization.'overlap_coom' (did you mean 'overlap_comm'?): DeepSpeed refuses it"),
])
def test_a_misspelt_deepspeed_key_is_named_before_anything_runs(tmp_path, capsys, config, message):
    """Issue 42: a misspelt top-level key made the check certify a ZeRO-0 run; a misspelt ZeRO key became a
    WRONG row. Both are usage errors now (exit 2), naming the nearest key DeepSpeed knows."""
    pytest.importorskip("deepspeed")
    from zerofix import cli

    path = write(tmp_path, "ds.json", config)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--deepspeed", path])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_every_configuration_the_project_uses_has_only_known_keys():
    pytest.importorskip("deepspeed")
    from zerofix.check import userconfig

    for config in (ZERO2, {**ZERO2, "zero_optimization": {**ZERO2["zero_optimization"], "stage": 3,
                                                          "stage3_param_persistence_threshold": 0,
                                                          "offload_optimizer": {"device": "cpu"}}},
                   {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "sparse_gradients": False,
                    "zero_allow_untested_optimizer": True, "steps_per_print": 10, "wall_clock_breakdown": False,
                    "gradient_clipping": 0, "zero_force_ds_cpu_optimizer": False, "communication_data_type": "fp32"}):
        assert userconfig.unknown_keys(config) == [], config


def test_trainer_report_says_what_the_trainer_entry_decided():
    """Issues 46 and 47: the Trainer's log names a handed count, a step never seen and an unknown verdict, once."""
    from zerofix import trainer_report
    from zerofix.patching import Record

    details = [{"trainer": "Trainer", "steps_unknown": 0, "count_handed": "Qwen2_5_VLForConditionalGeneration"},
               {"trainer": "MyTrainer", "steps_unknown": 1, "covered": "not covered: this trainer's training_step ..."},
               {"trainer": "Other", "steps_unknown": 2, "route": "the count left the watch as a Python number"}]
    records = [Record("transformers-trainer-scaling", "applied", "transformers", "5.23.0", "", "", tuple(details))]
    seen = set()
    lines = trainer_report.verdict_lines(records, seen)
    assert len(lines) == 3 and trainer_report.verdict_lines(records, seen) == []
    assert "never hands num_items_in_batch to Qwen2_5_VLForConditionalGeneration" in lines[0]
    assert "not covered" in lines[1] and "Python number" in lines[2]


QWEN2_5_VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
              "vision_end_token_id": 151653, "tie_word_embeddings": False,
              "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944,
                              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                              "vocab_size": 152064, "max_position_embeddings": 128000, "bos_token_id": 151643,
                              "eos_token_id": 151645, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                              "rope_theta": 1000000.0},
              "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}}


def test_model_builds_a_tiny_vision_language_model(tmp_path):
    """Issue 47: a composite config (text and vision towers) is shrunk tower by tower; the class keeps its
    ``accepts_loss_kwargs = False``, and text-only samples train it."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen2_5_VLForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen2.5-VL (4.49 and later)")
    import torch

    from zerofix.check import models, usermodel

    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_VL))
    kind, described = usermodel.prepare(tmp_path / "config.json", tmp_path / "work")
    assert described["class"] == "Qwen2_5_VLForConditionalGeneration" and described["parameters"] < 200_000
    model = models.build_model(kind, seed=0)
    assert type(model).accepts_loss_kwargs is False
    loss_sum, count = models.loss_sum(kind, model, models.collate([0, 1]))
    assert count > 0 and torch.isfinite(loss_sum)


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_own_configuration_with_a_vision_language_model_on_latest(tmp_path):
    """Issue 47, the doctor: ZeRO-2 with the user's Qwen2.5-VL, which the Trainer never hands the count: unpatched the
    mean of micro-batch means, patched the window's token mean (transformers-trainer-scaling hands it the count)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_VL))
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", {**ZERO2, "gradient_clipping": 0}),
                          "--model", str(tmp_path / "config.json"), "--only", "trainer-causal-lm")
    assert verdicts(document) == {"trainer-causal-lm": "fixed by transformers-trainer-scaling"}
    row = document["scenarios"][0]
    assert row["unpatched"]["rel_err"] > 0.05 and row["patched"]["rel_err"] < 1e-5, row


# Issue 51, item 6: the flag-False families as transformers ships their configs (no mrope_section, per-layer
# overrides by layer index, per-layer embeddings of the whole vocabulary)
SHIPPED = {"Qwen2_5_VLConfig": "Qwen2_5_VLForConditionalGeneration", "Qwen3VLConfig": "Qwen3VLForConditionalGeneration",
           "Qwen3_5Config": "Qwen3_5ForConditionalGeneration", "Glm4vConfig": "Glm4vForConditionalGeneration",
           "Gemma4Config": "Gemma4ForConditionalGeneration"}


@pytest.mark.stack("latest")  # transformers 5.3's Qwen2.5-VL / GLM-4V need an mrope_section their shipped configs lack
@pytest.mark.parametrize("config_class", list(SHIPPED))
def test_a_shipped_vision_language_config_shrinks_to_a_model_that_trains(tmp_path, config_class):
    """Every size shrunk consistently: the multimodal rotary sections with the head (written in where the class
    defaults them for a full-size head), per-layer overrides moved to the shrunk layer of their kind, special tokens in
    the tiny vocabulary; the tiny model computes a finite loss and a gradient."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    import torch

    from zerofix.check import models, usermodel

    config = getattr(transformers, config_class)()
    config.architectures = [SHIPPED[config_class]]
    config.save_pretrained(tmp_path / "model")
    kind, described = usermodel.prepare(tmp_path / "model", tmp_path / "work")
    assert described["class"] == SHIPPED[config_class] and described["parameters"] < 2_000_000, described
    model = models.build_model(kind, seed=0)
    loss_sum, count = models.loss_sum(kind, model, models.collate([0, 1]))
    loss_sum.backward()
    assert count > 0 and torch.isfinite(loss_sum)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.distributed
@pytest.mark.stack("latest")
def test_own_configuration_with_a_shipped_qwen2_5_vl_config(tmp_path):
    """Issue 51, item 6: ``Qwen2_5_VLConfig()`` as shipped (its mrope_section left to the model's default) through the
    doctor: the mean-of-means row, unpatched and patched (both Trainer rows failed before: split_with_sizes)."""
    import transformers

    config = transformers.Qwen2_5_VLConfig()
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(tmp_path / "model")
    document = check_json(tmp_path, "--deepspeed", write(tmp_path, "ds.json", {**ZERO2, "gradient_clipping": 0}),
                          "--model", str(tmp_path / "model"), "--only", "trainer-causal-lm")
    assert verdicts(document) == {"trainer-causal-lm": "fixed by transformers-trainer-scaling"}
    row = document["scenarios"][0]
    assert row["unpatched"]["rel_err"] > 0.05 and row["patched"]["rel_err"] < 1e-5, row


def test_the_trainer_log_of_a_run_says_only_what_that_run_decided():
    """Issue 51, item 5: two Trainers of one class in a process (a notebook), the first with an unknown verdict: the
    second run's log says nothing of the first's (``own_run`` narrows the records to the run whose TrainerState the
    callback is handed). A head handed the count whose loss is independent of it (a classifier, a masked LM) is not
    said at all: nothing changed."""
    import types

    from zerofix import trainer_report
    from zerofix.fixes import trainer_scaling
    from zerofix.patching import Record

    first, second, third = (types.SimpleNamespace() for _ in range(3))
    accounts = {id(first): {"trainer": "Trainer", "steps_unknown": 1, "route": "the count left the watch as a number"},
                id(second): {"trainer": "Trainer", "steps_unknown": 0, "scaled_for_ga": "is ... read as per window"},
                id(third): {"trainer": "Trainer", "steps_unknown": 0, "count_handed_verdict": "independent",
                            "count_handed": "ConvNextForImageClassification: stopped at optimizer step 1, ..."}}
    records = [Record(trainer_scaling.FIX_ID, "applied", "transformers", "5.24.0", "", "", tuple(accounts.values()))]
    found = trainer_scaling.run_details
    trainer_scaling.run_details = lambda state: accounts.get(id(state))
    try:
        assert trainer_report.verdict_lines(trainer_report.own_run(records, second), set()) == [
            "zerofix: transformers-trainer-scaling on Trainer: the loss is ... read as per window"]
        assert trainer_report.verdict_lines(trainer_report.own_run(records, third), set()) == []
        assert len(trainer_report.verdict_lines(trainer_report.own_run(records, first), set())) == 1
        assert trainer_report.own_run(records, types.SimpleNamespace())[0].runtime == ()  # a run it saw nothing of
    finally:
        trainer_scaling.run_details = found


def test_the_trainer_log_says_what_the_switch_decided_once_it_knows():
    """Issue 52, item 4: the chunked-loss switch is not among the fixes that act at the start of training; after the
    first step, one line per model (routed, or its own loss and why) and per stand-aside."""
    from zerofix import trainer_report
    from zerofix.patching import Record

    switch = Record("transformers-trainer-chunked-loss", "applied", "transformers", "5.24.0", "", "", (
        {"model": "LlamaForCausalLM", "routed": True, "why": "its loss is the chunked loss", "steps": 4},
        {"model": "BartForConditionalGeneration", "routed": False, "why": "runs its backbone on other inputs"},
        {"model": None, "trainer": "DPOTrainer", "routed": False, "why": "its compute_loss never calls ..."}))
    scaling = Record("transformers-trainer-scaling", "applied", "transformers", "5.24.0", "", "")
    start = trainer_report.summary_lines([scaling, switch], deepspeed=False)
    assert "chunked" not in " ".join(start) and "1 fix acts" in start[0], start
    seen = set()
    lines = trainer_report.switch_lines([scaling, switch], seen)
    assert len(lines) == 3 and trainer_report.switch_lines([scaling, switch], seen) == []
    assert "routes LlamaForCausalLM" in lines[0] and "Bart" in lines[1] and "stands aside for DPOTrainer" in lines[2]


@pytest.mark.distributed
@pytest.mark.stack("2026-04")
def test_the_doctor_takes_a_model_without_a_deepspeed_config(tmp_path):
    """Issue 59, item 4: ``zerofix check --model DIR`` alone trains the model's class on one process and with DDP, the
    Trainer as the user's run has it (no DeepSpeed): Qwen3-VL on transformers 5.3, a head the Trainer never hands the
    count whose loss function its forward calls without it, shows its mean-of-means row fixed."""
    import transformers

    config = transformers.Qwen3VLConfig()
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True}  # as the Hub's
    config.save_pretrained(tmp_path / "model")
    document = check_json(tmp_path, "--model", str(tmp_path / "model"))
    assert document["exit_code"] == 0, document
    assert verdicts(document) == {"trainer-1proc-causal-lm": "fixed by transformers-trainer-scaling",
                                  "trainer-ddp-causal-lm": "fixed by transformers-trainer-scaling"}
    for row in document["scenarios"]:
        assert row["unpatched"]["rel_err"] > 0.05 and row["patched"]["rel_err"] < 1e-5, row
    assert document["configuration"]["model"]["class"] == "Qwen3VLForConditionalGeneration"


@pytest.mark.slow  # a fresh interpreter importing transformers' Trainer
def test_an_install_without_wrapt_says_its_fixes_failed_not_that_none_is_in_range():
    """Issue 69, item 5: a ``--no-deps`` install leaves ``wrapt`` out; every fix in range then fails to apply, and the
    Trainer log's first line says so (it said "no fix applies to the installed releases", which was untrue)."""
    pytest.importorskip("transformers")
    from conftest import run_python

    proc = run_python("""
        import sys
        sys.modules["wrapt"] = None  # as absent as a --no-deps install leaves it
        import zerofix
        zerofix.patch()
        import transformers.trainer  # the Trainer's entries apply (and fail) here
        from zerofix import trainer_report
        records = zerofix.status()
        print("STATES", sorted({r.state for r in records if r.dist == "transformers"}))
        print("LINE", trainer_report.summary_lines(records, deepspeed=False)[0])
    """, env={"TRANSFORMERS_VERBOSITY": "error"})
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("STATES", "LINE")))
    assert "'failed'" in out["STATES"] and "'applied'" not in out["STATES"], out
    assert out["LINE"].startswith("zerofix is active, but no fix is applied, so it changes nothing in this run; "), out
    assert "failed (ModuleNotFoundError" in out["LINE"] and "no fix applies to the installed releases" not in out["LINE"]

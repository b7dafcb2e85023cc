"""zerofix.paths: which engine and layout a loss goes through, and the rule that every entry acts only on the paths
it models (issue 39). Plain objects stand in for accelerate's state and DeepSpeed's engine: the module reads
attributes only. The real runs: test_trainer_fsdp.py (FSDP2 through accelerate, asserted in the run)."""
from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import types

import pytest

from zerofix import catalogue, paths

pytestmark = pytest.mark.stack_independent
NS = types.SimpleNamespace


def state(kind="MULTI_GPU", **extra):
    return NS(**{"distributed_type": kind, "parallelism_config": None, "torch_tp_plugin": None, **extra})


@pytest.mark.parametrize("given, expected", [
    (state("NO"), "one process"),
    (state("MULTI_CPU"), "DDP"),
    (state("MULTI_XPU"), "DDP"),
    (state("FSDP", fsdp_plugin=NS(fsdp_version=2)), "FSDP2"),
    (state("FSDP", fsdp_plugin=NS(fsdp_version=1)), "FSDP1"),
    (state("DEEPSPEED", deepspeed_plugin=NS(deepspeed_config={"zero_optimization": {"stage": 3}})),
     "DeepSpeed ZeRO-3"),
    # a ParallelismConfig of plain data parallelism (FSDP2's dp_shard) is covered
    (state("FSDP", fsdp_plugin=NS(fsdp_version=2), parallelism_config=NS(dp_shard_size=2, tp_size=1, cp_size=1,
                                                                        sp_size=1)), "FSDP2"),
])
def test_covered_paths(given, expected):
    path = paths.accelerate_path(given)
    assert path == paths.Path(expected, True) and str(path) == expected


@pytest.mark.parametrize("given, model, n_gpu, expected", [
    (state("FSDP", parallelism_config=NS(tp_size=2)), None, 1, "tensor parallel (tp_size=2)"),
    (state("FSDP", parallelism_config=NS(cp_size=2, cp_backend="torch")), None, 1,
     "context parallel (cp_size=2, torch)"),
    (state("DEEPSPEED", parallelism_config=NS(sp_size=2, sp_backend="deepspeed")), None, 1,
     "sequence parallel (sp_size=2, deepspeed)"),
    (state("FSDP", parallelism_config=NS(dp_replicate_size=2, dp_shard_size=2)), None, 1,
     "HSDP (dp_replicate_size=2, dp_shard_size=2)"),
    (state("DEEPSPEED", deepspeed_plugin=NS(deepspeed_config={"sequence_parallel_size": 2})), None, 1,
     "DeepSpeed Ulysses sequence parallel (sequence_parallel_size=2)"),
    (state("DEEPSPEED", deepspeed_plugin=NS(deepspeed_config={"tensor_parallel": {"autotp_size": 2}})), None, 1,
     "DeepSpeed AutoTP tensor parallel (autotp_size=2)"),
    (state("MULTI_GPU", torch_tp_plugin=NS(tp_size=2)), None, 1, "tensor parallel (torch_tp_plugin tp_size=2)"),
    (state("MULTI_GPU"), NS(_tp_size=4), 1, "tensor parallel (model _tp_size=4)"),
    (state("NO"), None, 2, "torch DataParallel (n_gpu=2)"),
    (state("MEGATRON_LM"), None, 1, "accelerate DistributedType.MEGATRON_LM"),
    (state("XLA"), None, 1, "accelerate DistributedType.XLA"),
    (state("A_TYPE_ACCELERATE_ADDS_LATER"), None, 1, "accelerate DistributedType.A_TYPE_ACCELERATE_ADDS_LATER"),
])
def test_every_other_path_is_not_covered(given, model, n_gpu, expected):
    path = paths.accelerate_path(given, model=model, n_gpu=n_gpu)
    assert path == paths.Path(expected, False) and str(path) == f"not covered: {expected}"


def test_a_deepspeed_engine_is_covered_while_data_parallel():
    engine = NS(zero_optimization_stage=lambda: 2, sequence_parallel_size=1, autotp_size=lambda: 0)
    assert paths.engine_path(engine) == paths.Path("DeepSpeed ZeRO-2", True)
    engine.sequence_parallel_size = 4
    assert not paths.engine_path(engine).covered
    engine.sequence_parallel_size, engine.autotp_size = 1, (lambda: 2)
    assert str(paths.engine_path(engine)) == "not covered: DeepSpeed AutoTP tensor parallel (autotp_size=2)"


def test_the_manual_accumulation_entry_stands_aside_on_ulysses_and_says_so():
    pytest.importorskip("deepspeed")
    from zerofix.fixes import deepspeed_manual_accumulation as manual

    paths.reset()
    engine = NS(zero_optimization_stage=lambda: 2, sequence_parallel_size=2, autotp_size=lambda: 0,
                pipeline_parallelism=False, managed_gradient_accumulation=lambda: True)
    engine.__dict__[manual._FLAG] = False
    why = manual._outside_schedule(engine)
    assert why == "not covered: DeepSpeed Ulysses sequence parallel (sequence_parallel_size=2)"
    assert paths.not_covered(manual.FIX_ID) == ["DeepSpeed Ulysses sequence parallel (sequence_parallel_size=2)"]


def test_stood_aside_is_said_once_per_path():
    paths.reset()
    path = paths.Path("tensor parallel (tp_size=2)", False)
    assert paths.stood_aside("x", path) and not paths.stood_aside("x", path)
    assert paths.not_covered("x") == ["tensor parallel (tp_size=2)"]
    paths.reset()
    assert paths.not_covered("x") == []


@pytest.mark.parametrize("fix", catalogue.FIXES, ids=lambda f: f.id)
def test_every_entry_says_which_paths_it_models_and_checks_them(fix):
    """The rule in code: an entry that computes a plan (not a backport of upstream's own code) names the
    zerofix.paths function that decides its path, and its implementation calls it."""
    assert fix.covers, fix.id
    if fix.covers.startswith("backport"):
        assert fix.fixed_in or "0.19" in fix.covers, fix.id
        return
    function = re.search(r"paths\.(\w+)", fix.covers).group(1)
    assert callable(getattr(paths, function))
    pytest.importorskip(fix.dist.replace("-", "_"))
    def source_of(name: str) -> str:  # a package's source is every module's in it (the Trainer entry's parts)
        module = importlib.import_module(name)
        text = inspect.getsource(module)
        for part in sorted(pathlib.Path(module.__file__).parent.glob("*.py")) if hasattr(module, "__path__") else ():
            text += part.read_text()
        return text

    source = source_of(fix.implementation)
    # an entry riding on another's step (the MoE entry on the Trainer's) checks the path through it
    for name in re.findall(r"from zerofix\.fixes import (\w+)", source):
        source += source_of(f"zerofix.fixes.{name}")
    assert f"paths.{function}(" in source, fix.id


def test_the_trainers_log_line_says_not_covered():
    from zerofix.patching import Record
    from zerofix.trainer_report import summary_lines

    records = [Record("transformers-trainer-scaling", "applied", "transformers", "5.23.0", ">=4.46", "")]
    aside = summary_lines(records, deepspeed=False, path=paths.Path("context parallel (cp_size=2, torch)", False))
    assert aside[0] == ("zerofix: transformers-trainer-scaling stands aside on this run, not covered: context parallel "
                        "(cp_size=2, torch): the Trainer's own scaling runs unchanged")
    assert aside[1].startswith("zerofix: 0 fixes act on this run")
    fsdp = summary_lines(records, deepspeed=False, path=paths.Path("FSDP2", True))
    assert fsdp == ["zerofix: 1 fix acts on this run (through FSDP2): transformers-trainer-scaling (transformers 5.23.0)"]


def test_the_log_names_only_the_sequence_parallel_entry_as_acting_on_a_sequence_parallel_run():
    """Issue 69: the start line named deepspeed-manual-accumulation as acting on a DeepSpeed Ulysses run, and the next
    line said it was not covered there. On that path only transformers-deepspeed-sp-loss acts; the Trainer's and
    DeepSpeed's entries stand aside and say so; TRL's act where TRL's loss runs (any path)."""
    from zerofix.patching import Record
    from zerofix.trainer_report import summary_lines

    def record(fix_id, dist):
        return Record(fix_id, "applied", dist, "1.0", ">=0", "")

    records = [record("transformers-trainer-scaling", "transformers"), record("transformers-deepspeed-sp-loss",
               "transformers"), record("deepspeed-manual-accumulation", "deepspeed"),
               record("trl-grpo-window-normalisation", "trl")]
    sp = paths.Path("sequence parallel (sp_size=2, deepspeed)", False)
    said = summary_lines(records, deepspeed=True, path=sp)
    assert said[:2] == [
        "zerofix: transformers-trainer-scaling stands aside on this run, not covered: sequence parallel (sp_size=2, "
        "deepspeed): the Trainer's own scaling runs unchanged",
        "zerofix: deepspeed-manual-accumulation stands aside on this run, not covered: sequence parallel (sp_size=2, "
        "deepspeed): DeepSpeed's own accumulation runs unchanged"], said
    # the SP entry and TRL's are named once a step used them (their own lines), never on the start line
    assert said[2:] == ["zerofix: 0 fixes act on this run (through DeepSpeed): none"], said
    assert paths.stands_aside("transformers-deepspeed-sp-loss", "transformers", sp) is False
    assert paths.stands_aside("trl-grpo-window-normalisation", "trl", sp) is False
    # on context parallelism nothing models the path: the SP entry stands aside too
    cp = paths.Path("context parallel (cp_size=2, torch)", False)
    assert paths.stands_aside("transformers-deepspeed-sp-loss", "transformers", cp) is True
    assert paths.stands_aside("deepspeed-manual-accumulation", "deepspeed", paths.Path("DeepSpeed ZeRO-2", True)) is False


def sp_trainer(stage=2, world=2, sp=2, reduce_scatter=True, prescale=False, predivide=1.0, quantized=False, **pc):
    """A Trainer under DeepSpeed Ulysses as paths.sequence_parallel_path reads it (accelerate's ParallelismConfig,
    DeepSpeed's engine attributes and accessors)."""
    engine = NS(zero_optimization_stage=lambda: stage, seq_dp_world_size=world, sequence_parallel_size=sp,
                zero_reduce_scatter=lambda: reduce_scatter, postscale_gradients=lambda: not prescale,
                gradient_predivide_factor=lambda: predivide, zero_quantized_gradients=lambda: quantized)
    config = NS(**{"sp_size": sp, "sp_backend": "deepspeed", "tp_size": 1, "cp_size": 1, "dp_shard_size": 1, **pc})
    return NS(accelerator=NS(parallelism_config=config), model_wrapped=engine)


@pytest.mark.parametrize("given, name, divisor", [
    # DeepSpeed 0.18.2 - 0.19.8 divide the sum over every rank by world / sp (ZeRO-0/1/2) ...
    (sp_trainer(0), "DeepSpeed Ulysses sequence parallel (sp_size=2, 1 data-parallel) ZeRO-0", 1.0),
    (sp_trainer(2, world=4), "DeepSpeed Ulysses sequence parallel (sp_size=2, 2 data-parallel) ZeRO-2", 2.0),
    # ... and ZeRO-3's reduce-scatter by the world size
    (sp_trainer(3, world=4), "DeepSpeed Ulysses sequence parallel (sp_size=2, 2 data-parallel) ZeRO-3", 4.0),
])
def test_the_sequence_parallel_path_and_its_reduction(given, name, divisor):
    assert paths.sequence_parallel_path(given) == (paths.Path(name, True), divisor)


@pytest.mark.parametrize("given, why", [
    (sp_trainer(3, reduce_scatter=False), "without reduce_scatter"),
    (sp_trainer(2, prescale=True), "prescale_gradients"),
    (sp_trainer(2, predivide=2.0), "gradient_predivide_factor"),
    (sp_trainer(3, quantized=True), "quantized gradients"),
    (sp_trainer(2, tp_size=2), "tensor, context or sharded data parallelism"),
    (sp_trainer(2, sp=4), "an engine zerofix cannot read"),  # the engine's SP group is not the config's
    (NS(accelerator=NS(parallelism_config=NS(sp_size=2)), model_wrapped=None), "an engine zerofix cannot read"),
])
def test_sequence_parallel_layouts_not_modelled(given, why):
    path, _ = paths.sequence_parallel_path(given)
    assert not path.covered and why in path.name, path

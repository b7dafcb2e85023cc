"""The fixes zerofix knows, as plain data (NamedTuples: ``dataclasses`` would import ``inspect``, ~15 ms
at every interpreter start-up with ZEROFIX=1).

Each entry says *what* is broken (title, upstream references), *where* (distribution and the PEP 440
range of affected releases) and *how* it is patched (target attributes in their defining submodules and
the implementation module holding the wrappers). Importing this module imports no ML library, so the
README, the CLI and the start-up hook can read it for free.
"""
from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    """One attribute to wrap: ``module`` is the *defining* submodule (the post-import hook fires on it),
    ``attribute`` a dotted path inside it (``Class.method``), ``wrapper`` the wrapper function
    ``(wrapped, instance, args, kwargs)`` as ``"module:function"`` (entries sharing a mechanism share it)."""

    module: str
    attribute: str
    wrapper: str
    optional: bool = False  # absent from some releases in range: skipped there, the rest still applies


class Fix(NamedTuple):
    id: str
    title: str
    dist: str  # the distribution whose installed version decides (importlib.metadata name)
    affected: str  # PEP 440 specifier of the broken releases, evaluated with prereleases allowed
    targets: tuple[Target, ...]
    # the module that implements the entry: FIX_IDS naming it, structural_check(fix_id, targets) -> Check,
    # optionally runtime_details() (the contract: zerofix.fixes.contract)
    implementation: str
    upstream: tuple[str, ...] = ()
    fixed_in: str | None = None  # first upstream release with the fix, for humans
    where: str = ""  # the code path that shows the bug, for humans
    # Why the entry is applied only when named (patch(opt_in=...), ZEROFIX_OPT_IN, or an explicit fix list):
    # a right usage upstream documents produces the observations it reacts to. Empty: applied by default.
    opt_in: str = ""
    # The paths (engine and parallel layout, zerofix.paths) the entry's plan is computed for; on any other it stands
    # aside and says "not covered: <path>". BACKPORT: the entry is upstream's own later code, so it models the
    # layouts that release runs.
    covers: str = "backport"
    # A switch, not a bug fix (transformers-trainer-chunked-loss): it changes how something is computed, only when
    # named; never counted among the installed releases' bugs.
    switch: bool = False
    # What a run must itself do for the entry to act on it (a model returning a router auxiliary loss, TRL's own GRPO
    # loss running): the Trainer's log then names the entry at the first step that did, never at the start of a run
    # that does not (issue 58). Its implementation has acted_in(fix_id, trainer_state) -> str | None.
    acts_when: str = ""

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.module for t in self.targets))


TRAINER = "zerofix.fixes.trainer_scaling"
TRAINER_WIRING = TRAINER + ".wiring"  # the entry's wrappers (a package: its parts in modules of their own)
MANUAL = "zerofix.fixes.deepspeed_manual_accumulation"
SCALE = "zerofix.fixes.deepspeed_scale_wrt_gas"
HOOK = "zerofix.fixes.deepspeed_output_hook_division"
SHORT = "zerofix.fixes.accelerate_short_window"
MOE = "zerofix.fixes.trainer_moe_aux"
CHUNKED = "zerofix.fixes.trainer_chunked_loss"
SP = "zerofix.fixes.trainer_sequence_parallel"
FRAMEWORK = "zerofix.fixes.framework_withheld_count"

FIXES: tuple[Fix, ...] = (
    # The Trainer's gradient-accumulation scaling (zerofix.fixes.trainer_scaling, rule in zerofix.scaling):
    # training_step watches whether the loss reads num_items_in_batch, Accelerator.backward divides exactly
    # once; a plain accelerate loop is never touched. Replaces transformers-nokw-undivided,
    # transformers-deepspeed-double-division and transformers-accelerate-double-division (RETIRED below).
    # The MoE router auxiliary loss (zerofix.fixes.trainer_moe_aux): re-weighted inside the Trainer entry's step,
    # after its plan; listed first so its Accelerator.backward layer is the inner one (it sees the plan carried out).
    Fix(
        id="transformers-moe-aux-loss",
        title="The Trainer scales an MoE model's router auxiliary loss like its normalised cross-entropy: GAS x "
        "(and x processes) too heavy",
        dist="transformers",
        affected=">=4.46",  # every release measured (4.46.3 - 5.23.0 with Mixtral); #48690 is open
        targets=(
            Target("transformers.trainer", "Trainer.compute_loss", MOE + ":compute_loss"),
            Target("accelerate.accelerator", "Accelerator.backward", MOE + ":backward"),
        ),
        implementation=MOE,
        upstream=(
            "https://github.com/huggingface/transformers/issues/48690",
            "https://github.com/huggingface/transformers/pull/48691",
        ),
        fixed_in=None,
        where="Trainer with gradient_accumulation_steps > 1 and a Mixture-of-Experts model whose loss adds "
        "router_aux_loss_coef x aux_loss (output_router_logits): the auxiliary term trains at GAS x, and x processes "
        "with average_tokens_across_devices; on 5.2.0-5.5.3 it is the cross-entropy that is off instead",
        covers="trainer: as transformers-trainer-scaling, whose step and plan it uses (paths.trainer_path)",
        acts_when="the run's loss adds a router auxiliary loss",
    ),
    Fix(
        id="transformers-trainer-scaling",
        title="Trainer scales the loss by gradient_accumulation_steps (and the number of processes) from a "
        "guess at the forward's signature, and some releases divide twice or never",
        dist="transformers",
        # every release measured from 4.46.3 to 5.24.0 has a head it scales wrongly; #47688 is open
        affected=">=4.46",
        targets=(
            Target("transformers.trainer", "Trainer.training_step", TRAINER_WIRING + ":training_step"),
            Target("transformers.trainer", "Trainer.compute_loss", TRAINER_WIRING + ":compute_loss"),
            Target("transformers.trainer", "Trainer.get_batch_samples", TRAINER_WIRING + ":get_batch_samples"),
            Target("accelerate.accelerator", "Accelerator.backward", TRAINER_WIRING + ":backward"),
        ),
        implementation=TRAINER,
        upstream=(
            "https://github.com/huggingface/transformers/issues/47688",
            "https://github.com/huggingface/transformers/pull/35207",
            "https://github.com/huggingface/transformers/pull/35808",
            "https://github.com/huggingface/transformers/pull/45349",
        ),
        fixed_in=None,
        where="Trainer with gradient_accumulation_steps > 1: a head whose forward takes **kwargs but whose loss "
        "ignores num_items_in_batch (sequence classification, ...; a compute_loss or compute_loss_func returning a "
        "mean) trains at GAS x (and x processes) on every release; a head whose class says accepts_loss_kwargs = "
        "False (Qwen2.5/3-VL, Qwen3.5, Gemma 4, GLM-4V, ...) is never handed the count and trains on the mean of "
        "micro-batch means; 4.46-4.47 never divide a loss without loss kwargs, 4.46-4.48 with DeepSpeed and "
        "5.2.0-5.5.3 without it divide a per-window loss twice",
        covers="trainer: one process, DDP, DeepSpeed ZeRO-0..3, FSDP1, FSDP2 (paths.trainer_path)",
    ),
    # DeepSpeed Ulysses sequence parallelism under the Trainer (zerofix.fixes.trainer_sequence_parallel): the one path
    # transformers-trainer-scaling stands aside on that has a model of its own (paths.sequence_parallel_path).
    Fix(
        id="transformers-deepspeed-sp-loss",
        title="Under DeepSpeed sequence parallelism the Trainer trains sp_size x the mean of micro-batch means "
        "(ZeRO-0/1/2), or the mean of micro-batch means (ZeRO-3), and never calls compute_loss_func",
        dist="transformers",
        # the SP branch of Trainer.compute_loss (deepspeed_sp_compute_loss) exists from 5.0.0 (4.57.1 has none);
        # measured wrong on 5.0.0, 5.3.0 and 5.24.0; the structural check requires the branch
        affected=">=5.0.0.dev0",
        targets=(
            Target("transformers.trainer", "Trainer.get_batch_samples", SP + ":get_batch_samples"),
            Target("transformers.trainer", "Trainer.compute_loss", SP + ":compute_loss"),
            Target("accelerate.accelerator", "Accelerator.backward", SP + ":backward"),
        ),
        implementation=SP,
        fixed_in=None,
        where="Trainer with parallelism_config=ParallelismConfig(sp_backend='deepspeed', sp_size > 1): the SP "
        "ranks' gradients of each micro-batch's mean are summed (sp_size x on ZeRO-0/1/2), micro-batches are "
        "averaged as means under gradient accumulation, and a compute_loss_func is silently not called",
        covers="trainer: DeepSpeed Ulysses sequence parallel on ZeRO-0/1/2, and ZeRO-3 with reduce-scatter "
        "(paths.sequence_parallel_path)",
        acts_when="the run trains with DeepSpeed sequence parallelism (sp_size > 1)",
    ),
    # Not a bug: a switch. The Trainer's causal-LM / vision-language training loss through zerofix's chunked loss,
    # without the full logits (zerofix.fixes.trainer_chunked_loss); opt-in, a route decided per model by a probe.
    Fix(
        id="transformers-trainer-chunked-loss",
        title="The Trainer's causal-LM and vision-language training loss without the full logits (a switch, not a "
        "bug fix)",
        dist="transformers",
        affected=">=4.46",
        targets=(Target("transformers.trainer", "Trainer.compute_loss", CHUNKED + ":compute_loss"),
                 # to say when a trainer's loss never reaches Trainer.compute_loss (TRL's DPO and reward trainers)
                 Target("transformers.trainer", "Trainer.training_step", CHUNKED + ":training_step")),
        implementation=CHUNKED,
        where="Trainer training a causal LM or vision-language model: the batch x sequence x vocabulary logits (19 "
        "GiB in float32 at 32k tokens and a 152k vocabulary) are built for the loss; with this switch the loss is "
        "zerofix.chunked_cross_entropy of the backbone's hidden states, ZeRO-3 and FSDP2 safe, the count honoured",
        opt_in="a switch, not a bug fix: it changes how the training loss is computed (its memory and rounding), so "
        "it runs only when asked for",
        covers="trainer: one process, DDP, DeepSpeed ZeRO-0..3, FSDP1, FSDP2 (paths.trainer_path); per model, "
        "where a probe finds its loss to be the chunked loss of its backbone's hidden states",
        switch=True,
    ),
    # A framework's own trainer that withholds the count from every model (zerofix.fixes.framework_withheld_count,
    # issue 67): the wrapper records that the framework's __init__ set the flag; the Trainer entry hands the count and
    # checks it at every step, as for a head whose class withholds it. Listed before accelerate's entries, after the
    # Trainer's: it acts through the Trainer entry's step.
    Fix(
        id="axolotl-withheld-count",
        title="axolotl's trainer sets model_accepts_loss_kwargs = False for every model: its runs train on a mean of "
        "micro-batch means under gradient accumulation",
        dist="axolotl",
        # AxolotlTrainer.__init__'s check is new in axolotl's #3577 (first release 0.17.0; 0.16.1 has none, git
        # history); 0.20.0 reads the loss function's signature (PR #3982). Measured 0.19.0 (axolotl train).
        affected=">=0.17.0,<0.20.0",
        targets=(Target("axolotl.core.trainers.base", "AxolotlTrainer.__init__", FRAMEWORK + ":axolotl_init"),),
        implementation=FRAMEWORK,
        upstream=("https://github.com/axolotl-ai-cloud/axolotl/pull/3982",),
        fixed_in="0.20.0",
        where="axolotl train with gradient_accumulation_steps > 1 (SFT, LoRA, sample packing): AxolotlTrainer sets "
        "model_accepts_loss_kwargs = False wherever the backbone's forward does not name num_items_in_batch (every "
        "transformers model), so the Trainer never hands the model's loss the count and each micro-batch takes its own "
        "token mean",
        covers="trainer: as transformers-trainer-scaling, which hands the count (paths.trainer_path)",
        acts_when="axolotl's trainer set model_accepts_loss_kwargs = False for a model whose loss takes the count",
    ),
    Fix(
        id="llamafactory-processor-withheld-count",
        title="LLaMA-Factory's SFT and PT trainers set model_accepts_loss_kwargs = False whenever a processor is "
        "present: vision-language runs train on a mean of micro-batch means under gradient accumulation",
        dist="llamafactory",
        # #7448 (first release 0.9.3; 0.9.2 sets it only in its DPO, KTO and reward trainers, whose losses are not
        # token means) for transformers 4.49's heads; still in 0.9.5 and main, open PR #10454. Measured 0.9.5.
        affected=">=0.9.3",
        targets=(
            Target("llamafactory.train.sft.trainer", "CustomSeq2SeqTrainer.__init__", FRAMEWORK + ":llamafactory_init"),
            Target("llamafactory.train.pt.trainer", "CustomTrainer.__init__", FRAMEWORK + ":llamafactory_init"),
        ),
        implementation=FRAMEWORK,
        upstream=("https://github.com/hiyouga/LLaMA-Factory/pull/7448",
                  "https://github.com/hiyouga/LLaMA-Factory/pull/10454"),
        fixed_in=None,
        where="llamafactory-cli train, stage sft or pt, a model with a processor (Qwen2-VL, ...), "
        "gradient_accumulation_steps > 1: the trainer sets model_accepts_loss_kwargs = False, so the Trainer never hands "
        "the model's loss the count and each micro-batch takes its own token mean",
        covers="trainer: as transformers-trainer-scaling, which hands the count (paths.trainer_path)",
        acts_when="LLaMA-Factory's trainer set model_accepts_loss_kwargs = False for a model whose loss takes the count",
    ),
    Fix(
        id="accelerate-short-last-window",
        title="A plain accelerator.accumulate loop divides the short last window of an epoch by "
        "gradient_accumulation_steps instead of its length",
        dist="accelerate",
        affected=">=1.1.1",  # every release measured (1.1.1 - 1.15.0); no upstream fix known
        targets=(
            Target("accelerate.accelerator", "Accelerator.accumulate", SHORT + ":accumulate"),
            Target("accelerate.accelerator", "Accelerator.backward", SHORT + ":backward"),
        ),
        implementation=SHORT,
        fixed_in=None,
        where="with accelerator.accumulate(model) over an epoch whose number of micro-batches is not a multiple "
        "of GAS: the last window's update is n/GAS of its mean; with DeepSpeed and accelerate < 1.10 it is never "
        "applied",
        opt_in="a loss normalised per window by the user (accelerate's gradient-accumulation guide) is right "
        "on the short window as accelerate scales it, and accelerate's own test suite asserts n/GAS: nothing a "
        "loop does tells the two apart",
        covers="accelerate: one process, DDP, DeepSpeed, FSDP1, FSDP2 (paths.accelerate_path)",
    ),
    Fix(
        id="accelerate-deepspeed-no-sync",
        title="accelerator.accumulate() enters a ZeRO-2/3 engine's no_sync(), which DeepSpeed >= 0.16 rejects",
        dist="accelerate",
        affected=">=1.1.1,<1.9.0",  # 1.1.1 - 1.8.0's no_sync reads no ZeRO stage (sources); 1.3.0 measured
        targets=(
            Target("accelerate.accelerator", "Accelerator.no_sync", "zerofix.fixes.accelerate_deepspeed_no_sync:no_sync"),
        ),
        implementation="zerofix.fixes.accelerate_deepspeed_no_sync",
        fixed_in="1.9.0",
        where="with accelerator.accumulate(model), DeepSpeed >= 0.16 ZeRO-2/3, 2+ ranks, GAS > 1: "
        "AssertionError 'no_sync context manager is incompatible with gradient partitioning' on every rank",
    ),
    Fix(
        id="deepspeed-manual-accumulation",
        title="Several engine.backward() before one engine.step() apply only the last micro-batch (ZeRO-1/2, "
        "config gradient_accumulation_steps=1)",
        dist="deepspeed",
        # ZeRO-1/2 at config GAS=1 keep only the last micro-batch from 0.17.6 on (with optimizer offload on
        # every release measured, 0.14.5 - 0.19.8). At config GAS > 1 every release skips step() until its
        # own count is reached: ambiguous with its own style, so zerofix only warns there.
        affected=">=0.14.5",
        targets=(
            Target("deepspeed.runtime.engine", "DeepSpeedEngine.backward", MANUAL + ":backward"),
            Target("deepspeed.runtime.engine", "DeepSpeedEngine.step", MANUAL + ":step"),
            Target("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint", MANUAL + ":save_checkpoint"),
            # zero_grad() ends a window without an update: the next backward starts a new one
            Target("deepspeed.runtime.engine", "DeepSpeedEngine.zero_grad", MANUAL + ":zero_grad"),
            # gradient reads between the last backward and step() reduce a lazily accumulated window
            # first; deepspeed.utils re-exports them by value, so both names are wrapped
            *(Target(module, name, MANUAL + ":read_grad", optional=name == "safe_update_full_grad_vectorized")
              for module in ("deepspeed.utils.tensor_fragment", "deepspeed.utils")
              for name in ("safe_get_full_grad", "safe_set_full_grad", "safe_update_full_grad_vectorized")),
        ),
        implementation=MANUAL,
        upstream=(
            "https://github.com/deepspeedai/DeepSpeed/issues/7718",
            "https://github.com/allenai/open-instruct/pull/1498",
        ),
        fixed_in=None,
        where="N x engine.backward() then one engine.step() with config GAS=1: ZeRO-1/2 keep only the last "
        "micro-batch (>= 0.17.6; with optimizer offload every release); config GAS=K > 1 is DeepSpeed's schedule "
        "(step() applies nothing until K step() calls): warned about, not changed",
        covers="deepspeed: a data-parallel engine, no pipeline, Ulysses or AutoTP (paths.engine_path)",
    ),
    Fix(
        id="deepspeed-zero12-accumulator",
        title="ZeRO-1/2's accumulator restarts every micro-step: ZeRO-2 applies only the last micro-batch",
        dist="deepspeed",
        # 0.18.0 measured (Trainer and raw loops); the structural check finds the same method in the
        # 0.17.6 and 0.18.2 sources, not in 0.17.5 (no such accumulator) or 0.18.3 (corrected).
        affected=">=0.17.6,<0.18.3",
        targets=(
            Target("deepspeed.runtime.zero.stage_1_and_2",
                   "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue",
                   "zerofix.fixes.deepspeed_zero12_accumulator:epilogue"),
        ),
        implementation="zerofix.fixes.deepspeed_zero12_accumulator",
        upstream=("https://github.com/deepspeedai/DeepSpeed/releases/tag/v0.18.3",),
        fixed_in="0.18.3",
        where="ZeRO-2 with gradient_accumulation_steps > 1, DeepSpeed's own loop (backward + step per "
        "micro-batch) or the Trainer/Accelerate: only the last micro-batch of each window is applied; "
        "ZeRO-1/2 manual accumulation raises TypeError",
    ),
    Fix(
        id="deepspeed-bf16-boundary-reduction",
        title="ZeRO-1 bf16 with an fp32 gradient accumulator: the boundary micro-batch is never averaged "
        "across ranks",
        dist="deepspeed",
        # Measured 0.18.9 (broken), 0.19.8 (right); the structural check finds the broken order in the sources
        # of 0.18.3 - 0.18.6 and 0.18.9, not in 0.18.1 - 0.18.2 (the gradients are added in optimizer.backward,
        # before the all-reduce) or 0.19.0 (DeepSpeed PR #7985). 0.18.3 - 0.18.4 build FP16_UnfusedOptimizer for
        # this configuration (measured 0.18.3), so the bug shows from 0.18.5.
        affected=">=0.18.3,<0.19.0",
        targets=(
            Target("deepspeed.runtime.engine", "DeepSpeedEngine._backward_epilogue",
                   "zerofix.fixes.deepspeed_bf16_boundary_reduction:backward_epilogue"),
        ),
        implementation="zerofix.fixes.deepspeed_bf16_boundary_reduction",
        upstream=("https://github.com/deepspeedai/DeepSpeed/pull/7985",),
        fixed_in="0.19.0",
        where="ZeRO-1, bf16 with data_types.grad_accum_dtype fp32 (DeepSpeed's BF16_Optimizer), 2+ ranks, any "
        "loop: each boundary micro-batch reaches the update unaveraged, each rank's own in its partition",
    ),
    Fix(
        id="deepspeed-bf16-loss-scale",
        title="bf16 through FP16_UnfusedOptimizer (ZeRO-0): a loss scale divides gradients nobody scaled, and "
        "gradients are never zeroed between steps",
        dist="deepspeed",
        # DeepSpeed #7837. Measured, ZeRO-0 bf16, 2 ranks: 0.17.5 right (bf16 never reaches that optimizer),
        # 0.17.6 - 0.18.2 every window carries the earlier ones and the norm is x65536, 0.18.3 - 0.18.5 no update
        # at all, 0.18.6 right (PR #7839)
        affected=">=0.17.6,<0.18.6",
        targets=(
            Target("deepspeed.runtime.engine", "DeepSpeedEngine._configure_fp16_optimizer",
                   "zerofix.fixes.deepspeed_bf16_loss_scale:configure_fp16_optimizer"),
            Target("deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step",
                   "zerofix.fixes.deepspeed_bf16_loss_scale:take_model_step"),
            Target("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer.load_state_dict",
                   "zerofix.fixes.deepspeed_bf16_loss_scale:load_state_dict"),
        ),
        implementation="zerofix.fixes.deepspeed_bf16_loss_scale",
        upstream=("https://github.com/deepspeedai/DeepSpeed/issues/7837",
                  "https://github.com/deepspeedai/DeepSpeed/pull/7839"),
        fixed_in="0.18.6",
        where="ZeRO-0 in bf16 (and ZeRO-1 bf16 with data_types.grad_accum_dtype fp32 up to 0.18.4), any loop: no "
        "update at all on 0.18.3 - 0.18.5; each window carries every earlier one and the reported grad norm is "
        "65536 times too large on 0.17.6 - 0.18.2",
    ),
    Fix(
        id="deepspeed-zero12-flat-buffer",
        title="ZeRO-1/2 build their flat parameter buffer with an autograd graph: step() raises 'Output 0 of Split is "
        "a view' on gloo",
        dist="deepspeed",
        # DeepSpeed PR #7828 (0.18.7) flattens on the accelerator, #7948 (0.19.0) detaches. Measured, ZeRO-1/2 on 2 gloo
        # ranks, step() in grad mode: 0.18.6 runs, 0.18.7 - 0.18.9 raise, 0.19.0 runs; the structural check finds the
        # undetached flatten in 0.18.7 - 0.18.9 only
        affected=">=0.18.7,<0.19.0",
        targets=(
            Target("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned",
                   "zerofix.fixes.deepspeed_zero12_flat_buffer:flatten_dense_tensors_aligned"),
        ),
        implementation="zerofix.fixes.deepspeed_zero12_flat_buffer",
        upstream=("https://github.com/deepspeedai/DeepSpeed/pull/7948",),
        fixed_in="0.19.0",
        where="ZeRO-1/2 on 2+ ranks with gloo (CPU), engine.step() in grad mode (the Trainer, accelerate, any loop "
        "without torch.no_grad()): RuntimeError at the first optimizer step, on every rank",
    ),
    Fix(
        id="deepspeed-offload-accumulator",
        title="ZeRO-2 with optimizer offload applies only the first and last micro-batch of each window",
        dist="deepspeed",
        # DeepSpeed #6550 (0.15.2) stores the CPU accumulator only at the first micro-step; #7967 (0.19.0)
        # stores it at every one. Measured on 0.15.4, 0.16.3, 0.18.0, 0.18.3, 0.18.9 (broken), 0.19.8 (right);
        # the structural check finds the broken method in every source from 0.15.2 to 0.18.9.
        affected=">=0.15.2,<0.19.0",
        targets=(
            Target("deepspeed.runtime.zero.stage_1_and_2",
                   "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu",
                   "zerofix.fixes.deepspeed_offload_accumulator:accumulate"),
        ),
        implementation="zerofix.fixes.deepspeed_offload_accumulator",
        upstream=("https://github.com/deepspeedai/DeepSpeed/pull/7967",
                  "https://github.com/deepspeedai/DeepSpeed/pull/6550"),
        fixed_in="0.19.0",
        where="ZeRO-2 with offload_optimizer and gradient_accumulation_steps > 2, DeepSpeed's own loop or the "
        "Trainer/Accelerate: the middle micro-batches of every window are lost (and the gradient norm with them)",
    ),
    Fix(
        id="deepspeed-scale-wrt-gas",
        title="engine.backward(loss, scale_wrt_gas=False) still divides the gradient by GAS",
        dist="deepspeed",
        affected="==0.18.3",  # the hook is new in 0.18.3 (absent from 0.18.2's source), 0.18.4 honours the flag
        targets=(
            Target("deepspeed.runtime.engine", "DeepSpeedEngine.backward", SCALE + ":backward"),
            Target("deepspeed.runtime.engine", "DeepSpeedEngine._backward_prologue_per_tensor", SCALE + ":per_tensor"),
        ),
        implementation=SCALE,
        upstream=("https://github.com/deepspeedai/DeepSpeed/pull/7724",),
        fixed_in="0.18.4",
        where="Trainer with DeepSpeed and GAS > 1 (it passes scale_wrt_gas=False): updates are 1/GAS, and "
        "1/GAS**2 under ZeRO-0/1/2 for a model that returns its logits next to the loss",
    ),
    Fix(
        id="deepspeed-output-hook-division",
        title="DeepSpeed divides the gradient at every output of the forward by GAS: a loss computed from "
        "logits the model also returns is divided twice",
        dist="deepspeed",
        # The hooks are new in 0.18.3 (#7665). engine.backward() divides once at the root from 0.19.6 on;
        # a direct loss.backward() still divides at every output in 0.19.8 (measured).
        affected=">=0.18.3",
        targets=(
            Target("deepspeed.runtime.utils", "OutputBackwardHookManager._make_backward_hook", HOOK + ":make_backward_hook"),
            Target("deepspeed.runtime.engine", "DeepSpeedEngine._backward_prologue_per_tensor",
                   HOOK + ":per_tensor"),
            Target("deepspeed.runtime.engine", "DeepSpeedEngine.backward", HOOK + ":backward"),
        ),
        implementation=HOOK,
        upstream=("https://github.com/deepspeedai/DeepSpeed/pull/7665",),
        fixed_in=None,
        where="ZeRO-0/1/2, gradient_accumulation_steps > 1, a model returning its logits next to the loss "
        "(every Hugging Face model): engine.backward(loss) on 0.18.3-0.19.5 (DeepSpeed's own loop, a plain "
        "accelerate loop), loss.backward() on every release since 0.18.3: updates are 1/GAS of the "
        "intended ones",
        covers="backport: the division DeepSpeed 0.19's graph tracker makes",
    ),
    Fix(
        id="trl-chunked-nll-zero3",
        title="SFTTrainer(loss_type='chunked_nll') reads a ZeRO-3 partitioned lm_head.weight and crashes",
        dist="trl",
        affected=">=1.4.0,<1.6.0",
        targets=(
            Target("trl.trainer.sft_trainer", "_chunked_cross_entropy_loss",
                   "zerofix.fixes.trl_chunked_nll_zero3:chunked_cross_entropy_loss"),
        ),
        implementation="zerofix.fixes.trl_chunked_nll_zero3",
        upstream=("https://github.com/huggingface/trl/pull/5873",),
        fixed_in="1.6.0",
        where="ZeRO-3 with the loss outside a gathering engine.forward: evaluation on DeepSpeed < 0.16, a "
        "compute_loss that runs the decoder then the chunked loss: 'size mismatch ... vec (0)' on every rank",
    ),
    Fix(
        id="trl-chunked-nll-gather-zero3",
        title="SFTTrainer(loss_type='chunked_nll') gathers the ZeRO-3 lm_head once per chunk: ranks with "
        "different chunk counts hang",
        dist="trl",
        affected=">=1.6.0,<1.15.0",
        targets=(
            Target("trl.trainer.sft_trainer", "_chunked_cross_entropy_loss",
                   "zerofix.fixes.trl_chunked_nll_zero3:per_chunk_gather_loss"),
        ),
        implementation="zerofix.fixes.trl_chunked_nll_zero3",
        upstream=("https://github.com/huggingface/trl/issues/6696", "https://github.com/huggingface/trl/pull/6698",
                  "https://github.com/huggingface/trl/issues/6372"),
        fixed_in="1.15.0",
        where="ZeRO-3, chunked_nll (the default loss_type from 1.7.0) where the head is not already whole: a "
        "compute_loss that runs the decoder then the chunked loss, and any backward that recomputes a chunk "
        "after DeepSpeed released the head; each chunk gathers, so ranks with different numbers of counted "
        "tokens (assistant-only or completion-only masking) run different numbers of collectives and hang",
    ),
    Fix(
        id="trl-distillation-chunked-gather-zero3",
        title="DistillationTrainer's chunked divergence gathers the ZeRO-3 heads once per chunk: ranks with "
        "different completion lengths run different collectives",
        dist="trl",
        affected=">=1.10.0,<1.15.0",
        targets=(
            Target("trl.trainer.distillation_trainer", "_chunked_divergence_loss",
                   "zerofix.fixes.trl_distillation_chunked_zero3:chunked_divergence_loss"),
        ),
        implementation="zerofix.fixes.trl_distillation_chunked_zero3",
        upstream=("https://github.com/huggingface/trl/issues/6696",),
        fixed_in="1.15.0",
        where="ZeRO-3, DistillationTrainer's own step: the teacher's head is partitioned after its forward, so "
        "each chunk of counted completion tokens gathers it (twice, with backward's recompute); completions end at "
        "EOS, ranks count different numbers of tokens, and their collectives stop matching (a hang on NCCL, an "
        "abort on gloo)",
    ),
    Fix(
        id="trl-grpo-window-normalisation",
        title="GRPOTrainer divides dapo/cispo/vespo losses by the generation batch's token count, not the "
        "accumulation window's",
        dist="trl",
        affected=">=0.22.0,<1.9.2",
        targets=(
            Target("trl.trainer.grpo_trainer", "GRPOTrainer._compute_loss",
                   "zerofix.fixes.trl_grpo_window_normalisation:compute_loss"),
        ),
        implementation="zerofix.fixes.trl_grpo_window_normalisation",
        upstream=("https://github.com/huggingface/trl/issues/5619", "https://github.com/huggingface/trl/pull/6024"),
        fixed_in="1.9.2",
        where="loss_type dapo (the default), cispo or vespo with steps_per_generation (or generation_batch_size) "
        "different from gradient_accumulation_steps: every update is GAS/steps_per_generation times the "
        "window's token-mean",
        acts_when="TRL's own GRPOTrainer._compute_loss runs (a framework's override replaces it)",
    ),
    # The experimental GSPO-token trainer copied _compute_loss (and its divisor) instead of calling it: its
    # own entry, applied when a script imports it.
    Fix(
        id="trl-gspo-token-window-normalisation",
        title="The experimental GSPO-token GRPOTrainer divides its dapo loss by the generation batch's token count",
        dist="trl",
        affected=">=0.22.0,<1.9.2",
        targets=(
            Target("trl.experimental.gspo_token.grpo_trainer", "GRPOTrainer._compute_loss",
                   "zerofix.fixes.trl_grpo_window_normalisation:compute_loss"),
        ),
        implementation="zerofix.fixes.trl_grpo_window_normalisation",
        upstream=("https://github.com/huggingface/trl/issues/5619", "https://github.com/huggingface/trl/pull/6024"),
        fixed_in="1.9.2",
        where="trl.experimental.gspo_token.GRPOTrainer, loss_type dapo, steps_per_generation != "
        "gradient_accumulation_steps: as trl-grpo-window-normalisation",
        acts_when="the experimental GSPO-token GRPOTrainer._compute_loss runs",
    ),
)


def ids() -> tuple[str, ...]:
    return tuple(f.id for f in FIXES)


def default_ids() -> tuple[str, ...]:
    """The entries patch() applies when no list names them: every entry but the opt-in ones."""
    return tuple(f.id for f in FIXES if not f.opt_in)


def by_id(fix_id: str) -> Fix:
    for fix in FIXES:
        if fix.id == fix_id:
            return fix
    raise KeyError(fix_id)


# Ids of earlier releases, merged into another entry: naming one gets an error that names its replacement.
RETIRED = {
    "transformers-nokw-undivided": "transformers-trainer-scaling",
    "transformers-deepspeed-double-division": "transformers-trainer-scaling",
    "transformers-accelerate-double-division": "transformers-trainer-scaling",
}


def retired_note(unknown) -> str:
    """" (x was merged into y)" for every retired id among ``unknown``; empty when none is."""
    merged = [f"{i} was merged into {RETIRED[i]}" for i in sorted(unknown) if i in RETIRED]
    return f" ({'; '.join(merged)})" if merged else ""


def unknown_ids_error(unknown) -> ValueError:
    return ValueError(
        f"unknown zerofix fix id(s): {', '.join(sorted(unknown))}{retired_note(unknown)}; valid ids: {', '.join(ids())}"
    )

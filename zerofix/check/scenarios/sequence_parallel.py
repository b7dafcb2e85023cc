"""One Trainer step under DeepSpeed's Ulysses sequence parallelism, against the window's token mean (issue 61).

Run in every rank (``python -m torch.distributed.run --nproc_per_node N -m zerofix.check.scenarios.sequence_parallel ...``):
a tiny Llama with ``sdpa`` attention, fp32, SGD, one optimizer step of the real Trainer with
``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=...)``. Samples are 32 tokens with uneven
counted labels, so the shards of one sample hold different counts, and one sample can give a shard no counted token.

Which samples the step trained on is read, not assumed: each rank's collator records the indices of every batch it
built, in order, and DeepSpeed's ``UlyssesSPDataLoaderAdapter`` hands its SP group one gathered batch per rank in
rank order (its documented order). Rank 0 computes the reference by hand in float64 from the weights before the
step: the gradient of the sum of every counted token's loss in the window (every micro-batch of every data-parallel
group) divided by their total count, and, for the verdict, the mean of the micro-batch means. The update is compared
with both (relative error of the update) and written as one JSON line.

On CPU two lines are the user's, no library change: ``deepspeed.init_distributed("gloo")`` before the accelerate
state, and ``DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import traceback

from zerofix.check.files import append_whole, write_whole

SEQ = 32
VOCAB = 64
# counted labels per sample (a prompt masked before them, padding after): uneven, and sample 2's first half empty
COUNTED = ((3, 12), (0, 31), (20, 30), (5, 9), (1, 29), (10, 14), (2, 7), (16, 31))


def samples():
    import torch
    gen = torch.Generator().manual_seed(1234)
    out = []
    for start, stop in COUNTED:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        labels = torch.full((SEQ,), -100)
        labels[start:stop + 1] = ids[start:stop + 1]
        out.append({"input_ids": ids, "labels": labels})
    return out


def tiny_llama(attention="sdpa"):
    """``attention``: the reference's is "eager": Ulysses registers its own wrapper in place of "sdpa" in every
    model of the process, and the float64 reference must not run the SP group's all-to-all."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation=attention, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def deepspeed_config(stage: int, reduce_scatter: bool = True) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter}, "bf16": {"enabled": False},
            "fp16": {"enabled": False}}


def token_losses(model, batch):
    """Per-token CE (float64 model), next-token shifted as DeepSpeed's adapter shifts: labels padded by one -100."""
    import torch
    logits = model(input_ids=batch["input_ids"]).logits
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                           reduction="none")
    return ce, int((labels != -100).sum())


def reference(init, micro_batches, lr):
    """(update of the window's token mean, update of the mean of micro-batch means), float64."""
    import torch
    data = samples()
    updates = []
    for kind in ("token", "means"):
        model = tiny_llama("eager").double()
        model.load_state_dict({k: v.double() for k, v in init.items()})
        total = sum(token_losses(model, _stack(data, mb))[1] for mb in micro_batches) if kind == "token" else None
        loss = 0.0
        for mb in micro_batches:
            ce, count = token_losses(model, _stack(data, mb))
            loss = loss + (ce.sum() / total if kind == "token" else ce.sum() / max(count, 1) / len(micro_batches))
        loss.backward()
        updates.append({k: -lr * p.grad for k, p in model.named_parameters()})
    return updates


def _stack(data, indices):
    import torch
    return {k: torch.stack([data[i][k] for i in indices]) for k in ("input_ids", "labels")}


def _compare(update, ref):
    import torch
    keys = sorted(ref)
    u = torch.cat([update[k].double().flatten() for k in keys])
    r = torch.cat([ref[k].flatten() for k in keys])
    return {"rel_err": float((u - r).abs().max() / r.abs().max()), "ratio": float(u.dot(r) / r.dot(r)),
            "cosine": float(u.dot(r) / (u.norm() * r.norm()))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default='[{"zero": 2, "gas": 2}]',
                        help="JSON list of cells: zero, gas, bs (1), sp (2), lr (1.0), loss_func (false), "
                             "reduce_scatter (true), smoothing (0.0: the Trainer's label_smoothing_factor), "
                             "variants (a list: this cell's own in place of --variants)")
    parser.add_argument("--variants", default="unpatched,patched",
                        help="comma-separated, in order, one Trainer each per cell: unpatched, patched")
    parser.add_argument("--out", required=True, help="a folder: result.jsonl (rank 0) and rank<N>.error")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="nccl: one GPU per rank (tests/test_gpu.py), the Trainer on CUDA")
    args = parser.parse_args(argv)
    import deepspeed
    deepspeed.init_distributed(args.backend)  # the user's line on CPU: accelerate would pick its own backend otherwise
    import torch.distributed as dist
    import zerofix

    os.makedirs(args.out, exist_ok=True)
    _gather_a_scalar_on_gloo()
    for cell in json.loads(args.cells):
        # a cell's own variants: a run that stops (upstream on 4 gloo ranks) can come last in the launch of the others
        variants = cell.pop("variants", args.variants.split(","))
        cell = {"bs": 1, "sp": 2, "lr": 1.0, "loss_func": False, "reduce_scatter": True, "added_term": False,
                "smoothing": 0.0, "backend": args.backend, **cell}
        for variant in variants:
            if variant == "patched":
                zerofix.patch()
            try:
                result = train_once(argparse.Namespace(**cell), variant)
            except Exception as exc:  # noqa: BLE001 - upstream's crash is a measured outcome (4 gloo ranks)
                # a peer may be waiting in a collective this rank never joins: say why and leave at once
                write_whole(os.path.join(args.out, f"rank{dist.get_rank()}.error"),
                            json.dumps({**cell, "variant": variant, "error": f"{type(exc).__name__}: {exc}",
                                        "trace": traceback.format_exc(limit=-8)}) + "\n")
                sys.stderr.flush()
                os._exit(3)
            finally:
                if variant == "patched":
                    zerofix.unpatch()
            if dist.get_rank() == 0:
                line = json.dumps({**cell, **result})
                print("ZEROFIX_SP " + line, flush=True)
                append_whole(os.path.join(args.out, "result.jsonl"), line)
            dist.barrier()
    return 0


def run(argv=None) -> None:
    """One run of ``zerofix check``'s session (its row ``trainer-sp-*``): ``--cells FILE`` (JSON), each cell
    unpatched then patched; every rank writes ``rank<r>.json``, rank 0's with the results. A run's exception is
    recorded per cell where every rank raises it alike (transformers 5.3's missing device mesh, before any
    collective of the step); transformers' ``sdpa`` is put back after every Trainer (Ulysses replaces it
    process-wide, and the session's next run would train through the SP group's all-to-all)."""
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import deepspeed
    deepspeed.init_distributed("gloo")
    import torch.distributed as dist
    import zerofix

    _gather_a_scalar_on_gloo()
    rank = dist.get_rank()
    record = {"rank": rank, "results": []}
    for cell in json.loads(Path(args.cells).read_text()):
        cell = {"bs": 1, "sp": 2, "lr": 1.0, "loss_func": False, "reduce_scatter": True, **cell}
        for variant in ("unpatched", "patched"):
            if variant == "patched":
                zerofix.patch()
            try:
                result = train_once(argparse.Namespace(**cell), variant)
            except Exception as exc:  # noqa: BLE001 - every rank alike: recorded, the row says it
                result = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if variant == "patched":
                    zerofix.unpatch()
                _fresh_process_state()
            if result is not None:
                record["results"].append({**cell, "variant": variant, **result})
            dist.barrier()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_whole(Path(args.out) / f"rank{rank}.json", json.dumps(record))


def train_once(args, variant):
    """One Trainer, one optimizer step; on rank 0 the comparison with the references (None elsewhere)."""
    import torch
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    import zerofix

    _fresh_process_state()
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // args.sp
    model = tiny_llama()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = samples()
    seen: list[list[int]] = []

    class Indexed(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"index": i, **data[i]}

    def collate(items):
        seen.append([it["index"] for it in items])
        batch = {k: torch.stack([it[k] for it in items]) for k in ("input_ids", "labels")}
        batch["position_ids"] = torch.arange(SEQ).expand(len(items), SEQ).clone()  # Ulysses needs them
        return batch

    class Sequential(Trainer):
        def _get_train_sampler(self, *a, **k):  # the samples' order is the test's, not a seed's
            return torch.utils.data.SequentialSampler(self.train_dataset)

        if getattr(args, "added_term", False):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                """A subclass that adds a term to the base loss (a weight penalty): not a loss zerofix read."""
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                head = self.accelerator.unwrap_model(model).lm_head.weight
                return loss + 1e-3 * head.float().pow(2).sum()

    called = []

    def divided_loss_func(outputs, labels, num_items_in_batch=None):
        called.append(num_items_in_batch)
        logits = outputs.logits.float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum") / num_items_in_batch

    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp, dp_replicate_size=dp,
                           sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.bs, gradient_accumulation_steps=args.gas,
        max_steps=1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, optim="sgd", report_to="none", save_strategy="no", logging_strategy="no",
        use_cpu=getattr(args, "backend", "gloo") == "gloo", dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True, label_smoothing_factor=getattr(args, "smoothing", 0.0),
        deepspeed=deepspeed_config(args.zero, args.reduce_scatter), parallelism_config=pc)
    trainer = Sequential(model=model, args=targs, train_dataset=Indexed(), data_collator=collate,
                         compute_loss_func=divided_loss_func if args.loss_func else None)
    trainer.train()
    final = _final_weights(trainer, args.zero)
    engine = trainer.model_wrapped
    everyone = [None] * world
    dist.all_gather_object(everyone, {"seen": seen, "called": len(called)})
    status = {r.id: r.state for r in zerofix.status()} if variant == "patched" else {}
    if rank != 0:
        return None
    windows = []
    for group in range(dp):  # DeepSpeed's SP groups: consecutive ranks
        ranks = range(group * args.sp, (group + 1) * args.sp)
        order = [everyone[r]["seen"][k] for k in range(min(len(everyone[r]["seen"]) for r in ranks)) for r in ranks]
        windows += order[:args.gas]
    token, means = reference(init, windows, args.lr)
    update = {k: final[k] - init[k] for k in token}
    return {"variant": variant, "zero": args.zero, "gas": args.gas, "bs": args.bs, "sp": args.sp, "dp": dp,
            "world": world, "loss_func": args.loss_func, "windows": windows,
            "engine": {"type": type(engine).__name__, "stage": engine.zero_optimization_stage(),
                       "sequence_parallel_size": engine.sequence_parallel_size},
            "loss_func_called": sum(e["called"] for e in everyone), "status": status,
            "token": _compare(update, token), "means": _compare(update, means),
            # the weights after the step, bitwise: where zerofix leaves a step to upstream both halves must agree
            "digest": hashlib.sha1(b"".join(final[k].numpy().tobytes() for k in sorted(final))).hexdigest()}


def _gather_a_scalar_on_gloo():
    """DeepSpeed < 0.19's ``UlyssesSPDataLoaderAdapter`` all-gathers a 0-dim sequence length into 1-element tensors:
    NCCL moves the bytes, gloo checks the shapes and raises ("invalid tensor size at index 0 (expected (), got (1))").
    A CPU quirk, not a numerical one (DeepSpeed 0.19.8 sends a 1-element tensor): the scalar is sent as one element."""
    import deepspeed.comm as dist
    gather = dist.all_gather
    if getattr(gather, "_zerofix_check_scalar", False):
        return

    def all_gather(tensor_list, tensor, *args, **kwargs):
        if tensor.dim() == 0 and tensor_list and all(t.shape == (1,) for t in tensor_list):
            tensor = tensor.reshape(1)
        return gather(tensor_list, tensor, *args, **kwargs)

    all_gather._zerofix_check_scalar = True
    dist.all_gather = all_gather


_SDPA = []  # transformers' own sdpa attention, before Ulysses replaced it in this process


def _fresh_process_state():
    """What a second Trainer in this process needs to start as the first did: accelerate's singletons, DeepSpeed's
    SP groups (``initialize_sequence_parallel`` asserts they are new) and its ``groups.mpu`` (which a later engine
    without SP would ask for an SP group), and transformers' ``sdpa`` attention, which
    ``UlyssesSPAttentionHF.register_with_transformers`` replaces by its wrapper (a second registration would wrap the
    wrapper)."""
    from accelerate.state import AcceleratorState, PartialState
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if not _SDPA:
        _SDPA.append(ALL_ATTENTION_FUNCTIONS["sdpa"])
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _SDPA[0]
    from deepspeed.utils import groups
    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = None
    parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None
    if groups.mpu is parallel_state_sp:  # an SP engine hands DeepSpeed its mpu process-wide; a later engine has none
        groups.mpu = None
    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def _final_weights(trainer, stage):
    import deepspeed
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = list(model.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    sys.exit(main())

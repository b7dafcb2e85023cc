"""Peak memory and time of one Trainer step at a long sequence, with and without the chunked-loss switch (issue 48).

    python benchmarks/bench_trainer_chunked_loss.py              # seq 4096, vocabulary 32000 (the default)
    python benchmarks/bench_trainer_chunked_loss.py --quick      # seq 1024
    python benchmarks/bench_trainer_chunked_loss.py --device cuda --seq 16384 --steps 10   # bf16 on a GPU

A tiny random Llama (hidden 256, 2 layers: the logits dominate, as in a long-context run of a real model), batch 1,
GAS 1, one SGD step on CPU, each variant in a fresh process, ``--repeats`` times, medians reported. Every variant
runs ``zerofix.patch()``; ``switch`` also names ``transformers-trainer-chunked-loss``; ``trl`` (where TRL has it)
trains through TRL's fused LM head instead (``trl.trainer.utils.add_fused_lm_head`` and a ``compute_loss`` that
calls ``model(..., fused_lm_head=True)``: what TRL's own trainers do). Peak memory is the growth of
the process's peak RSS during ``trainer.train()`` (the model, its gradients and the batch are in both figures);
the update of the two variants is compared after the measurement (relative error printed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_chunked_ce import peak_mib, rss_mib  # the same measure of memory as the loss's own benchmark

SWITCH = "transformers-trainer-chunked-loss"


def timed_train(trainer, model, cuda: bool) -> tuple[float, float]:
    """``trainer.train()``'s seconds and peak memory in MiB over what was there before: the CUDA allocator's peak on a
    GPU, the process's peak RSS on CPU (the model, its gradients and the batch are in both figures)."""
    import torch

    if cuda:
        model.cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_mib()
    start = time.perf_counter()
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, (torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_mib()) - base


def child(variant: str, seq: int, vocab: int, device: str = "cpu", steps: int = 1) -> dict:
    import torch
    import transformers

    import zerofix

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    zerofix.patch(opt_in=[SWITCH] if variant == "switch" else [])
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[0], "labels": ids[0]}] * steps
    cuda = device == "cuda"  # bf16 on the GPU, as a long-context run trains; peak: the CUDA allocator's
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=not cuda, bf16=cuda,
                                          report_to="none", per_device_train_batch_size=1, max_steps=steps,
                                          optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer_class = transformers.Trainer
    if variant == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)

        class FusedHeadTrainer(transformers.Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                out = model(**inputs, fused_lm_head=True, num_items_in_batch=num_items_in_batch)
                return (out.loss, out) if return_outputs else out.loss

        trainer_class = FusedHeadTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=data)
    seconds, peak = timed_train(trainer, model, cuda)
    update = torch.cat([(p.detach().cpu() - before[n].cpu()).flatten() for n, p in model.named_parameters()])
    routed = [d for d in zerofix.status() if d.id == SWITCH and d.runtime]
    return {"variant": variant, "seconds": seconds, "peak_mib": peak, "update": update.tolist()[:: max(1, len(update)
            // 20000)], "routed": bool(routed and any(r.get("routed") for r in routed[0].runtime))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--steps", type=int, default=1,
                        help="optimizer steps per process: the first step's probe of the switch is paid once per model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: bf16 mixed precision, the CUDA allocator's peak (what a GPU run trains with)")
    args = parser.parse_args()
    seq = args.seq or (1024 if args.quick else 4096)
    if args.child:
        print(json.dumps(child(args.child, seq, args.vocab, args.device, args.steps)))
        return
    import importlib.util

    runs = {"plain": [], "switch": []}
    if importlib.util.find_spec("trl") is not None:
        from trl.trainer import utils as trl_utils

        if hasattr(trl_utils, "add_fused_lm_head"):
            runs["trl"] = []
    for _ in range(args.repeats):  # interleaved
        for variant in runs:
            cmd = [sys.executable, __file__, "--child", variant, "--seq", str(seq), "--vocab", str(args.vocab),
                   "--device", args.device, "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    import torch

    plain = torch.tensor(runs["plain"][0]["update"])
    errs = {v: float((torch.tensor(runs[v][0]["update"]) - plain).abs().max() / plain.abs().max()) for v in runs}
    med = {v: {m: statistics.median(r[m] for r in rs) for m in ("seconds", "peak_mib")} for v, rs in runs.items()}
    where = (f"CUDA ({torch.cuda.get_device_name()}), bf16 mixed precision" if args.device == "cuda"
             else f"CPU, {os.environ.get('OMP_NUM_THREADS', 2)} threads")
    print(f"{args.steps} Trainer step(s), tiny Llama (hidden 256, 2 layers), batch 1 x {seq} tokens, "
          f"vocabulary {args.vocab}, {where}; median of {args.repeats} processes")
    print(f"{'variant':<8} {'peak MiB':>9} {'x plain':>8} {'seconds':>8} {'x plain':>8}")
    for v in runs:
        print(f"{v:<8} {med[v]['peak_mib']:>9.0f} {med[v]['peak_mib'] / med['plain']['peak_mib']:>8.3f} "
              f"{med[v]['seconds']:>8.2f} {med[v]['seconds'] / med['plain']['seconds']:>8.3f}")
    print(f"switch routed: {all(r['routed'] for r in runs['switch'])}; update max relative difference to plain: "
          + ", ".join(f"{v} {e:.1e}" for v, e in errs.items() if v != "plain"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq": seq, "vocab": args.vocab, "device": args.device, "steps": args.steps,
                       "medians": med, "update_err": errs}, f, indent=1)


if __name__ == "__main__":
    main()

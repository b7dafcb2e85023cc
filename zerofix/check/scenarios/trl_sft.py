"""TRL ``SFTTrainer`` under ZeRO-3 (``accelerate launch``, ``zero3_init_flag: true``), on a tiny model loaded
with ``from_pretrained`` from a local directory (``make_model_dir``), with TRL's chunked loss on the paths
where DeepSpeed does not gather ``lm_head.weight`` for it.

- ``--path r1``: ``eval_strategy="steps"`` + ``eval_on_start=True``; the evaluation calls the model outside
  ``engine.forward`` (DeepSpeed < 0.16 gathers attribute reads only inside it).
- ``--path r2``: a ``compute_loss`` override that runs the decoder (``model.model(...)``) and then the chunked
  loss on ``lm_head.weight`` (``--loss-fn trl``: TRL's ``_chunked_cross_entropy_loss``; ``zerofix``:
  ``zerofix.chunked_cross_entropy``); with ``--loss-type nll`` the override computes the full logits instead,
  the reference.
- ``--path r3``: the Trainer's own training step with ``assistant_only_loss=True`` on a chat dataset whose
  assistant turns are short on rank 0 and long on rank 1 (a sequential sampler), so the ranks' chunked losses
  have different numbers of chunks (TRL #6696). Every rank also records, per step, its counted tokens and how
  many times the loss gathered ``lm_head.weight`` itself (``param.all_gather``, which TRL's
  ``GatheredParameters`` and zerofix's ``gathered`` both call; DeepSpeed's own module fetches do not).
- ``--path r4``: r3's data and sampler with r2's ``compute_loss`` override (the head is not whole there, so
  TRL 1.6 - 1.14 gather it once per chunk: a different number of collectives on each rank).
- ``--zerofix``: ``zerofix.patch()`` first, before TRL is imported (what the README's quick start does).

Every rank writes ``rank{r}.json``: the Trainer's log history (train loss, grad norm, eval loss) or the error.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

VOCAB, SEQ, SAMPLES, CHUNK = 64, 16, 16, 8
# r3: the assistant turn's length by the rank that reads the sample (sequential sampler, 2 per rank and step):
# rank 0 counts 2 x 4 tokens (1 chunk of CHUNK), rank 1 2 x 12 (3 chunks)
SHORT_REPLY, LONG_REPLY = 3, 11
# A chat template with {% generation %} markers (what assistant_only_loss needs), over whitespace-split words
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} </s>"
                 "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %} {% endfor %}")


def make_model_dir(path: Path, *, tied: bool = False, seed: int = 0) -> Path:
    """A tiny Llama and a word-level tokenizer saved with ``save_pretrained`` (nothing from a hub)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def ensure(path, make, *, timeout: float = 300) -> Path:
    """The folder ``path``, made by ``make(folder)`` on rank 0 if it is not there yet (in a folder of its own, then
    renamed: whole or absent), the other ranks waiting for it to appear (no collective: a run may have no process
    group yet). The parent names the folder and the ranks, which have transformers imported already, make it; the
    random state is the same whether this run made it or found it."""
    import os
    import time

    import torch

    path = Path(path)
    if int(os.environ.get("RANK", "0")) == 0 and not path.exists():
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        with torch.random.fork_rng(devices=[]):  # a run that makes it draws what a run that finds it draws
            make(partial)
        os.replace(partial, path)
    waited = time.monotonic()
    while not path.exists():
        if time.monotonic() - waited > timeout:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s (rank 0 makes it)")
        time.sleep(0.05)
    return path


def dataset():
    """Pre-tokenized sequences of different lengths; some with a masked prompt (completion_mask)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    rows = {"input_ids": [], "completion_mask": []}
    for i in range(SAMPLES):
        n = SEQ - (i % 4)
        rows["input_ids"].append(torch.randint(3, VOCAB, (n,), generator=g).tolist())
        prompt = 0 if i % 2 else n // 2
        rows["completion_mask"].append([0] * prompt + [1] * (n - prompt))
    return Dataset.from_dict(rows)


def chat_dataset():
    """Conversations: a 4-word user turn, then an assistant turn of SHORT_REPLY words for the samples rank 0
    reads and LONG_REPLY for rank 1's (samples 4k, 4k+1 and 4k+2, 4k+3 with 2 per rank and step)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))

    rows = [[{"role": "user", "content": words(4)},
             {"role": "assistant", "content": words(SHORT_REPLY if i % 4 < 2 else LONG_REPLY)}]
            for i in range(SAMPLES)]
    return Dataset.from_dict({"messages": rows})


def count_head_gathers(head, counter: dict) -> None:
    """Count the explicit gathers of a ZeRO-3 parameter: ``GatheredParameters`` and ``zerofix.gathered``
    both call the parameter's own ``all_gather``."""
    original = head.all_gather

    def all_gather(*args, **kwargs):
        counter["n"] += 1
        return original(*args, **kwargs)

    head.all_gather = all_gather


def run(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--path", choices=("r1", "r2", "r3", "r4"), required=True)
    parser.add_argument("--loss-type", choices=("chunked_nll", "nll"), required=True)
    parser.add_argument("--loss-fn", choices=("trl", "zerofix", "full-logits"), default="trl",
                        help="full-logits (with --loss-type nll): SFTTrainer's compute_loss_func computes the loss "
                        "from the model's full logits, a reference independent of TRL's own loss (TRL >= 1.6 "
                        "computes nll in chunks itself)")
    parser.add_argument("--zerofix", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    from zerofix.check.rank import run_and_record

    run_and_record(parser.parse_args(argv), train)


def train(args) -> dict:
    import torch.nn.functional as F
    from trl import SFTConfig, SFTTrainer
    from trl.trainer import sft_trainer

    from accelerate import PartialState

    PartialState(backend="gloo")  # accelerate >= 1.13 on CPU otherwise sees one process
    ensure(args.model_dir, make_model_dir)
    phase = {"now": "setup"}
    chat = args.path in ("r3", "r4")  # assistant-only masking, ranks with different chunk counts
    config = SFTConfig(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=args.steps, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1e6, logging_steps=1,  # never clips, but logs the norm
        report_to="none", save_strategy="no", seed=0,
        dataloader_num_workers=0, disable_tqdm=True, bf16=False, use_cpu=True, ddp_backend="gloo",
        loss_type="chunked_nll" if (args.path in ("r1", "r3") and args.loss_type == "chunked_nll") else "nll",
        eval_strategy="steps" if args.path == "r1" else "no", eval_steps=2, eval_on_start=args.path == "r1",
        model_init_kwargs={"device_map": None},  # use_cpu would ask for "auto"
        **({"assistant_only_loss": True, "max_length": 64} if chat else {"completion_only_loss": True}),
    )
    override = args.path in ("r2", "r4")
    chunked = args.loss_type == "chunked_nll"
    loss_fn = args.loss_fn

    class Trainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            phase["now"] = "train forward" if model.training else "eval forward"
            if not override:
                result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                phase["now"] = "train backward" if model.training else "between steps"
                return result
            lm = model.module if hasattr(model, "module") else model
            hidden = lm.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
            labels = inputs["labels"]
            if not chunked:
                logits = lm.lm_head(hidden)[:, :-1].reshape(-1, VOCAB)
                loss = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
                loss = loss / num_items_in_batch
            elif loss_fn == "trl":
                loss = sft_trainer._chunked_cross_entropy_loss(
                    hidden, lm.lm_head.weight, CHUNK, labels=labels, num_items_in_batch=num_items_in_batch,
                    lm_head_bias=lm.lm_head.bias)[0]
            else:
                import zerofix

                loss = zerofix.chunked_cross_entropy(hidden[:, :-1], lm.lm_head.weight, labels[:, 1:],
                                                     lm.lm_head.bias, num_items_in_batch=num_items_in_batch,
                                                     chunk_size=CHUNK)
            phase["now"] = "train backward"
            return (loss, None) if return_outputs else loss

        def training_step(self, model, inputs, *a, **k):
            gathers["n"] = 0
            counted = int((inputs["labels"][:, 1:] != -100).sum())
            result = super().training_step(model, inputs, *a, **k)
            steps.append({"counted_tokens": counted, "head_gathers": gathers["n"]})
            phase["now"] = "between steps"
            return result

        def _get_train_sampler(self, *a, **k):
            if not chat:
                return super()._get_train_sampler(*a, **k)
            from torch.utils.data import SequentialSampler

            return SequentialSampler(self.train_dataset)

    steps, gathers = [], {"n": 0}
    data = chat_dataset() if chat else dataset()
    extra = {"compute_loss_func": full_logits_nll} if loss_fn == "full-logits" else {}
    trainer = Trainer(model=args.model_dir, args=config, train_dataset=data,
                      eval_dataset=data.select(range(4)) if args.path == "r1" else None, **extra)
    from transformers.integrations import is_deepspeed_zero3_enabled

    head = trainer.model.lm_head.weight
    facts = {"zero3": is_deepspeed_zero3_enabled(), "head_numel_after_load": head.numel(),
             "head_is_zero3_param": hasattr(head, "ds_id")}
    if hasattr(head, "ds_id"):
        count_head_gathers(head, gathers)
    try:
        trainer.train()
    except Exception as exc:
        raise RuntimeError(f"in {phase['now']}: {type(exc).__name__}: {exc}") from exc
    history = trainer.state.log_history
    return {
        "facts": facts,
        "train_loss": [h["loss"] for h in history if "loss" in h],
        "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
        "eval_loss": [h["eval_loss"] for h in history if "eval_loss" in h],
        "steps": steps,
    }


def full_logits_nll(outputs, labels, num_items_in_batch=None):
    """The next-token loss from the full logits: summed over counted tokens, divided by the window's count
    (``num_items_in_batch``, training) or this batch's (evaluation), as TRL's nll does."""
    import torch.nn.functional as F

    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    targets = labels[:, 1:].reshape(-1).to(logits.device)
    total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets, ignore_index=-100,
                            reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum().clamp(min=1)
    return total / count


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from zerofix.check.rank import entry

    entry(run)

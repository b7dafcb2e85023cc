"""A tiny, randomly initialised Llama with a byte-level tokenizer and a ChatML chat template, saved to a directory
that a framework's command line loads as a local model (nothing downloaded), and a preference / SFT dataset.

    python tools/frameworks/tiny_model.py OUT_DIR

writes OUT_DIR/model (config, weights, tokenizer) and OUT_DIR/sft.jsonl, dpo.jsonl, kto.jsonl: 8 samples whose
responses are 2 to 71 bytes long, so micro-batches carry uneven token counts (the case where a mean of micro-batch
means differs from the token mean).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PROMPTS = ["hi", "what is 2+2?", "name a colour", "say yes", "count to three", "a word for big", "spell cat", "ok?"]
CHOSEN = ["hello there", "4", "blue", "yes", "one two three", "large, huge, vast, immense, enormous, gigantic, colossal",
          "c a t", "ok"]
REJECTED = ["no", "five", "a car", "no way at all, never", "1 2", "small", "dog", "not ok at all, sorry"]


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token=None)
    fast.chat_template = CHATML
    return fast


def build(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False, attention_dropout=0.0)
    model_dir = out / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with open(out / "sft.jsonl", "w") as f:
        for p, c in zip(PROMPTS, CHOSEN):
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}) + "\n")
    with open(out / "dpo.jsonl", "w") as f:
        for p, c, r in zip(PROMPTS, CHOSEN, REJECTED):
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                "rejected_response": r}) + "\n")
    with open(out / "kto.jsonl", "w") as f:
        for i, (p, c, r) in enumerate(zip(PROMPTS, CHOSEN, REJECTED)):
            answer, good = (c, True) if i % 2 == 0 else (r, False)
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": answer}],
                                "label": good}) + "\n")
    # 16 samples for the 2-process rows (2 ranks x 2 x GA 4 against one process's 1 x 16): the 8 above and 8 more
    # with other prompts, so no two samples are the same
    again = [f"once more: {p}" for p in PROMPTS]
    with open(out / "sft16.jsonl", "w") as f:
        for p, c in zip(PROMPTS + again, CHOSEN + CHOSEN[::-1]):
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}) + "\n")
    with open(out / "dpo16.jsonl", "w") as f:
        for p, c, r in zip(PROMPTS + again, CHOSEN + CHOSEN[::-1], REJECTED + REJECTED[::-1]):
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                "rejected_response": r}) + "\n")
    return model_dir


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))

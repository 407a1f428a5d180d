"""Build a tiny random Llama (with a real BPE tokenizer and a chat template) for vLLM tests.

    python tiny_model.py OUT_DIR

Runs inside the vLLM virtualenv (it needs `torch`, `transformers` and `tokenizers`, which the
project's own environment does not have). Offline and deterministic: the tokenizer is trained on
the sentences below, the weights come from a fixed seed. Writes `OUT_DIR/.complete` last, so a
half-written directory is never mistaken for a model.
"""

from __future__ import annotations

import sys
from pathlib import Path

SENTENCES = [
    "Fair scheduling shares one engine between many users.",
    "A power user sends hundreds of requests at once.",
    "Light users should not wait for all of them.",
    "Tell me about fair scheduling.",
    "The engine keeps a waiting queue and a running batch.",
    "Backpressure comes from the engine's own metrics.",
    "Hello, how are you today? I am fine, thank you.",
    "Write a short poem about queues, tokens and time.",
    "system user assistant: the quick brown fox jumps over the lazy dog 0123456789",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def build(out_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / ".complete"
    marker.unlink(missing_ok=True)

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(SENTENCES, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    torch.manual_seed(0)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    marker.write_text("ok\n")
    print(f"tiny llama: vocab {vocab}, {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tiny_model.py OUT_DIR")
    build(Path(sys.argv[1]))

"""A tiny, deterministic byte-level BPE tokenizer with a ChatML chat template, built offline.

Tests cannot download a tokenizer, so `make_tiny_tokenizer()` trains a small BPE on a fixed corpus with the
`tokenizers` library and wraps it in a `PreTrainedTokenizerFast`. Byte-level pre-tokenisation means every
string encodes (no unknown tokens) and `decode(encode(text)) == text`, which reward and generation tests rely
on. Special tokens: `<|im_start|>`, `<|im_end|>` (eos) and `<|endoftext|>` (pad), ids 0, 1 and 2.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# ChatML, as Qwen and SmolLM2 use: each message framed by im_start/im_end, then an open assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "State the final answer to the following arithmetic problem: 12 + 30 - 7 =",
    "<think>I add the numbers one by one.</think> <answer>35</answer>",
    "system user assistant You are a helpful assistant. Solve it step by step.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "#### 72 the quick brown fox jumps over the lazy dog 0123456789",
]


@lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A fresh tokenizer (about `vocab_size` tokens) with eos, pad and a ChatML chat template.

    >>> tok = make_tiny_tokenizer()
    >>> tok.decode(tok("12 + 30 =")["input_ids"])
    '12 + 30 ='
    """
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok

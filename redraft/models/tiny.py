"""Tiny random targets (like ``transformers.testing_utils``): for tests, examples and the
benchmarks that measure host overhead without a real model.

``make_tiny_target_dir(path)`` writes a complete Hugging Face model directory: a small Llama
with random weights and a byte-level BPE tokenizer trained on a few sentences, with a chat
template. Nothing is downloaded, so it runs offline in seconds.
"""

from __future__ import annotations

from pathlib import Path

from redraft.models.chat_templates import CHATML_TEMPLATE

# Llama-2 / Vicuna style: [INST] user [/INST] assistant </s>; the system prompt folds into the
# first user turn. Used to check that loss masks do not depend on one template.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<s>[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + ' </s>' }}"
    "{% endif %}{% endfor %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "import torch\nx = torch.zeros(3)\nprint(x)\n",
    "Hello! How can I help you today? I am a helpful assistant.",
    "for i in range(10):\n    print(i * i)\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
]


def make_tiny_tokenizer(vocab_size: int = 384, template: str = "chatml"):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML or Llama-2 specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if template == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        chat_template, bos, eos = CHATML_TEMPLATE, None, "<|im_end|>"
    elif template == "llama2":
        specials = ["<unk>", "<s>", "</s>"]
        chat_template, bos, eos = LLAMA2_TEMPLATE, "<s>", "</s>"
    else:
        raise ValueError(f"unknown template {template!r}; use 'chatml' or 'llama2'")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=specials[0],
        pad_token=specials[0],
    )
    fast.chat_template = chat_template
    return fast


def make_tiny_model(
    vocab_size: int,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    eos_token_id: int | None = None,
    tie_word_embeddings: bool = False,
):
    """A tiny random ``LlamaForCausalLM`` (eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Random init with std 0.02 gives nearly uniform logits; sharper logits make greedy paths
    # that repeat (like a real LM's) so drafters have something to hit in tests.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def make_tiny_target_dir(
    path,
    vocab_size: int = 384,
    hidden_size: int = 32,
    num_layers: int = 2,
    template: str = "chatml",
    seed: int = 0,
) -> Path:
    """Write a tiny random model + tokenizer to ``path`` (a HF directory) and return it."""
    path = Path(path)
    tok = make_tiny_tokenizer(vocab_size=vocab_size, template=template)
    model = make_tiny_model(
        len(tok),
        hidden_size=hidden_size,
        num_layers=num_layers,
        seed=seed,
        eos_token_id=tok.eos_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path

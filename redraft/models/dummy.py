"""Dummy targets: the shapes of real models with seeded random weights, made directly on the
device, and an offline byte-level tokenizer of the model's vocabulary size (speed measurements
only; ``load_target("dummy:llama-8b")``, like vLLM's ``--load-format dummy``).

:func:`load_dummy` is what :func:`redraft.models.target.load_target` calls for a
``dummy:<shape>`` spec; :data:`DUMMY_SHAPES` lists the shapes (numbers copied from the public
``config.json`` of the model each one is like).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from redraft.errors import TargetLoadError
from redraft.models.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE, VICUNA_TEMPLATE

logger = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"
# Artifacts built on a dummy target record a fingerprint that says so; loading one with a real
# target is then a fingerprint mismatch that names "dummy-...".
DUMMY_FINGERPRINT_PREFIX = "dummy-"


@dataclass(frozen=True)
class DummyTokenizerSpec:
    """Special tokens (id -> text) and the chat template of a dummy target's tokenizer."""

    specials: dict
    bos: str | None
    eos: str
    pad: str
    template: str


DUMMY_TOKENIZERS = {
    # Llama 3: the real ids of the specials its chat template uses
    "llama3": DummyTokenizerSpec(
        {
            128000: "<|begin_of_text|>",
            128001: "<|end_of_text|>",
            128006: "<|start_header_id|>",
            128007: "<|end_header_id|>",
            128008: "<|eom_id|>",
            128009: "<|eot_id|>",
        },
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        LLAMA3_TEMPLATE,
    ),
    # Llama 2 / Vicuna (SentencePiece): <unk> <s> </s> at 0, 1, 2
    "vicuna": DummyTokenizerSpec(
        {0: "<unk>", 1: "<s>", 2: "</s>"}, "<s>", "</s>", "<unk>", VICUNA_TEMPLATE
    ),
    "chatml": DummyTokenizerSpec(
        {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"},
        None,
        "<|im_end|>",
        "<|endoftext|>",
        CHATML_TEMPLATE,
    ),
}


@dataclass(frozen=True)
class DummyShape:
    """A dummy target: the public model its numbers come from, ``LlamaConfig`` keyword
    arguments copied from that model's ``config.json``, and its tokenizer family."""

    like: str
    config: dict
    tokenizer: str


DUMMY_SHAPES = {
    "llama-8b": DummyShape(
        "meta-llama/Meta-Llama-3-8B-Instruct",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=[128001, 128009],
        ),
        "llama3",
    ),
    "llama-1b": DummyShape(
        "meta-llama/Llama-3.2-1B-Instruct",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=[128001, 128008, 128009],
        ),
        "llama3",
    ),
    "vicuna-7b": DummyShape(
        "lmsys/vicuna-7b-v1.3",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "vicuna",
    ),
    # for tests: the same code path in milliseconds
    "tiny": DummyShape(
        "(no public model: a 2-layer Llama for tests)",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "chatml",
    ),
}


def dummy_config(name: str):
    """The ``LlamaConfig`` of dummy shape ``name`` (a key of :data:`DUMMY_SHAPES`)."""
    from transformers import LlamaConfig

    if name not in DUMMY_SHAPES:
        raise TargetLoadError(
            f"unknown dummy target {DUMMY_PREFIX}{name}; use one of "
            f"{[DUMMY_PREFIX + k for k in DUMMY_SHAPES]}."
        )
    shape = DUMMY_SHAPES[name]
    return LlamaConfig(**shape.config, architectures=["LlamaForCausalLM"])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of ``tokenizers``' ByteLevel)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), 256))
    )
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def dummy_tokenizer(vocab_size: int, family: str):
    """A byte-level tokenizer with exactly ``vocab_size`` entries and no merges: every UTF-8 byte
    is one token (ids: the first 256 ids the special tokens leave free, in byte order), the
    family's special tokens sit at their real ids, and filler tokens ``<|dummy_i|>`` (never
    produced by encoding) pad the vocabulary to ``vocab_size``. Text round-trips exactly; a
    sequence has one token per byte (about 4x a real BPE's count on English)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = DUMMY_TOKENIZERS[family]
    if vocab_size < 256 + len(spec.specials) or max(spec.specials) >= vocab_size:
        raise TargetLoadError(
            f"a byte-level dummy tokenizer needs a vocabulary of at least "
            f"{max(256 + len(spec.specials), max(spec.specials) + 1)} tokens, not {vocab_size}."
        )
    free = (i for i in range(vocab_size) if i not in spec.specials)
    vocab = {ch: next(free) for _, ch in sorted(_bytes_to_unicode().items())}
    vocab.update({text: i for i, text in spec.specials.items()})
    vocab.update({f"<|dummy_{i}|>": i for i in free})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        unk_token=spec.pad,
        additional_special_tokens=[
            t for t in spec.specials.values() if t not in (spec.bos, spec.eos, spec.pad)
        ],
    )
    fast.chat_template = spec.template
    return fast


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


@torch.no_grad()
def load_dummy(name: str, torch_dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A dummy target of shape ``name``, created on ``device`` in ``torch_dtype``.

    The modules are built under ``torch.device(device)`` with every weight initialiser switched
    off (transformers' ``no_init_weights``: an 8B model's default init on the host takes
    minutes), then each weight is filled once, on the device, from a seeded generator: matrices
    ~ N(0, initializer_range), norm weights 1, biases 0. Buffers computed at construction
    (rotary frequencies) are real. ``device="meta"`` builds the shapes without memory.
    """
    from transformers import AutoModelForCausalLM

    cfg = dummy_config(name)
    shape = DUMMY_SHAPES[name]
    tok = dummy_tokenizer(cfg.vocab_size, shape.tokenizer)
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if device.type != "meta":
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        for pname, p in model.named_parameters():  # tied weights are listed once
            if p.dim() >= 2:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
            elif pname.endswith("bias"):
                p.zero_()
            else:  # RMSNorm weights
                p.fill_(1.0)
    logger.warning(
        "%s%s has random weights (shaped like %s): its outputs are meaningless; use it "
        "for speed measurements only",
        DUMMY_PREFIX,
        name,
        shape.like,
    )
    source = {
        "kind": "dummy",
        "shape": name,
        "like": shape.like,
        "note": "random weights, byte-level tokenizer: for speed measurements only",
    }
    return model, tok, DUMMY_PREFIX + name, source

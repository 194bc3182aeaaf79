"""`slow`: the real default target (SmolLM2-135M-Instruct). Batched to stay within the CI budget."""

import pytest

from redraft.bench.ties import first_divergence
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What is the capital of France? Answer in one word, then explain why it is famous.",
    "List five tips for writing clean code.",
    "Explain what a hash table is to a beginner.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python? Show two ways.",
    "Give me a short recipe for pancakes.",
    "What are the differences between TCP and UDP?",
]


def chats():
    return [[{"role": "user", "content": p}] for p in PROMPTS]


def mix_for(target):
    """Cheap drafters (the ReDrafter head's exactness is covered on tiny models): context lookup
    with q=1 and q=3 give real, partly accepted trees on chat text."""
    V = target.vocab_size
    return [
        ContextNGramDrafter(V, q=1, k=8, w=4),
        ContextNGramDrafter(V, q=3, k=2, w=8, name="context-q3"),
    ]


def test_fp32_greedy_speculative_equals_plain_greedy(default_target):
    ref = plain_greedy(default_target, chats(), max_new_tokens=64)
    dec = SpeculativeDecoder(default_target, mix_for(default_target), budget=8)
    out = dec.generate(chats(), max_new_tokens=64)
    for o, r, p in zip(out, ref, PROMPTS):
        assert o.tokens == r.tokens, p
    calls = sum(o.stats.target_calls for o in out)
    assert sum(len(o.tokens) for o in out) / calls > 1.0  # the drafts were used


def test_bf16_divergences_happen_only_at_near_ties(default_target):
    """bf16 batched verify and one-token steps round differently; an argmax may flip only where
    the two candidate tokens are within rounding of each other. The float32 model is the referee:
    at every divergence both tokens must be among its top 3 and their logits within 1.0."""
    from redraft.models import load_target

    target = load_target("default", dtype="bfloat16", device="cpu")
    ref = plain_greedy(target, chats(), max_new_tokens=32)
    out = SpeculativeDecoder(target, mix_for(target), budget=8).generate(chats(), max_new_tokens=32)
    matched, gaps = 0, []
    for k, (o, r) in enumerate(zip(out, ref)):
        d = first_divergence(
            default_target, default_target.chat_ids(chats()[k]), o.tokens, r.tokens
        )
        if d is None:
            matched += 1
            continue
        gaps.append(round(d.gap, 3))
        assert d.near_tie, (k, d.describe())
    print(
        f"bf16: {matched}/{len(PROMPTS)} prompts identical to plain bf16 greedy; "
        f"|logit gap| of the two tokens at each divergence (fp32 referee): {gaps}"
    )

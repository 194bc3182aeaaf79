"""`slow` + `cuda`: the real default target (SmolLM2-135M-Instruct) on the GPU, as
tests/infer/test_default_target.py does on the CPU (stage b of dev/gpu/gpu-run.sh runs these:
they need the GGUF, which travels in parts 2 and 3 of the bundle)."""

import pytest
import torch
from cuda_helpers import DEVICE

from redraft.infer import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter

pytestmark = [pytest.mark.slow, pytest.mark.cuda]

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


def drafters(target):
    V = target.vocab_size
    return [
        ContextNGramDrafter(V, q=1, k=8, w=4),
        ContextNGramDrafter(V, q=3, k=2, w=8, name="context-q3"),
    ]


@pytest.fixture(scope="module")
def fp32_target():
    from redraft.models import load_target

    return load_target("default", dtype="float32", device=DEVICE)


def test_fp32_greedy_speculative_equals_plain_greedy_on_cuda(fp32_target):
    ref = plain_greedy(fp32_target, chats(), max_new_tokens=64)
    out = SpeculativeDecoder(fp32_target, drafters(fp32_target), budget=8).generate(
        chats(), max_new_tokens=64
    )
    for o, r, p in zip(out, ref, PROMPTS):
        assert o.tokens == r.tokens, p
    assert sum(len(o.tokens) for o in out) / sum(o.stats.target_calls for o in out) > 1.0


def test_bf16_divergences_happen_only_at_near_ties_on_cuda(fp32_target):
    from redraft.models import load_target

    target = load_target("default", dtype="bfloat16", device=DEVICE)
    ref = plain_greedy(target, chats(), max_new_tokens=32)
    out = SpeculativeDecoder(target, drafters(target), budget=8).generate(
        chats(), max_new_tokens=32
    )
    matched, gaps = 0, []
    for k, (o, r) in enumerate(zip(out, ref)):
        if o.tokens == r.tokens:
            matched += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(o.tokens, r.tokens)) if a != b)
        prompt = fp32_target.chat_ids(chats()[k])
        with torch.no_grad():
            logits = (
                fp32_target.model(torch.tensor([prompt + r.tokens[:i]], device=DEVICE))
                .logits[0, -1]
                .float()
            )
        a, b = o.tokens[i], r.tokens[i]
        gaps.append(round(float((logits[a] - logits[b]).abs()), 3))
        assert {a, b} <= set(logits.topk(3).indices.tolist()), (k, i, a, b)
    print(
        f"bf16 on {DEVICE}: {matched}/{len(PROMPTS)} prompts identical to plain bf16 greedy; "
        f"|fp32 logit gap| at each divergence: {gaps}"
    )
    assert all(g < 1.0 for g in gaps), gaps

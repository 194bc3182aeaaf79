"""``redraft-vllm replay``: how redraft's proposer would draft for vLLM, measured without vLLM's
timing noise: the target's greedy outputs of the benchmark prompts are replayed step by step, and
each step's chain is scored against what the target really produced (accepted = the leading
tokens that match; the step then advances by those plus one, as vLLM's verify would).

It reports tau (tokens per target call, the prefill included) and the draft tokens sent per step
(what the verify pays for) per dataset, for each proposer setting given and for vLLM's own
``ngram`` proposer when vLLM is installed: a deterministic way to choose ``min_value`` and ``k``
on one's own prompts before timing anything.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def greedy_outputs(target, datasets, n: int, max_new_tokens: int) -> dict:
    """``{dataset: [(prompt ids, greedy output ids), ...]}`` (redraft's plain greedy)."""
    from redraft.data.prompts import load_prompts
    from redraft.infer.decoder import plain_greedy

    out = {}
    for ds in datasets:
        ids = [
            target.tokenizer(p, add_special_tokens=False)["input_ids"]
            if isinstance(p, str)
            else target.chat_ids(p)
            for p in load_prompts(ds, n)
        ]
        gens = plain_greedy(target, ids, max_new_tokens=max_new_tokens)
        out[ds] = [(list(i), list(g.tokens)) for i, g in zip(ids, gens)]
    return out


def replay(propose, pairs) -> dict:
    """Replay ``pairs`` of (prompt, output) through ``propose(context, sampled) -> chain``."""
    tokens = calls = drafted = 0
    for prompt, out in pairs:
        if not out:
            continue
        ctx, pos, sampled, n_calls = list(prompt) + [out[0]], 1, [out[0]], 1  # the prefill
        while pos < len(out):
            chain = list(propose(ctx, sampled))[: len(out) - pos]
            acc = 0
            while acc < len(chain) and chain[acc] == out[pos + acc]:
                acc += 1
            sampled = out[pos : pos + acc + 1]
            ctx += sampled
            pos += len(sampled)
            n_calls += 1
            drafted += len(chain)
        tokens += len(out)
        calls += n_calls
    return {"tau": tokens / max(calls, 1), "drafted_per_step": drafted / max(calls, 1)}


def vllm_config(model_dir, vocab_size, k: int, max_len: int):
    """The fields of vLLM's ``VllmConfig`` that :class:`redraft.vllm.Proposer` reads, for using
    the proposer outside vLLM (the replay, tests)."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(
            max_model_len=max_len,
            tokenizer=str(model_dir),
            model=str(model_dir),
            trust_remote_code=False,
            hf_config=SimpleNamespace(vocab_size=vocab_size),
        ),
    )


def redraft_propose(model_dir, vocab_size: int, k: int, settings, max_len: int = 8192):
    """A ``propose(context, sampled)`` of :class:`redraft.vllm.Proposer` with ``settings``."""
    from redraft.vllm.proposer import Proposer

    cfg = vllm_config(model_dir, vocab_size, k, max_len)
    p = Proposer(cfg, settings)
    tok = np.zeros((1, max_len), dtype=np.int32)

    def propose(ctx, sampled):
        tok[0, : len(ctx)] = ctx
        return p.propose([sampled], np.array([len(ctx)], np.int32), tok)[0]

    return propose


def vllm_ngram_propose(k: int, lo: int = 1, hi: int = 4):
    """vLLM's own ``ngram`` proposal (its numba kernel), or None without vLLM."""
    try:
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as longest_match,
        )
    except ImportError:
        return None
    return lambda ctx, sampled: list(longest_match(np.asarray(ctx, np.int32), lo, hi, 1 << 30, k))

"""Prefix caching: the block store (sharing, least recently used out, prefixes outliving what
extends them) and the engine reusing it (outputs equal to prefilling whole, fewer prompt tokens
prefilled, the bound held)."""

import pytest
import torch

from redraft.infer import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter
from redraft.infer.engine.prefix import BLOCK, PrefixCache
from redraft.infer.runner.cost import CostCurve

CURVE = CostCurve([1, 8, 64], [1.0, 1.2, 2.0])


def _kv(n, seed=0):
    """Entries of ``n`` tokens, ``[layers 2, 2, kv_heads 3, n, d 4]``, each token's distinct."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 3, n, 4, generator=g)


def test_match_finds_the_stored_blocks_and_copy_writes_their_entries():
    pc = PrefixCache(1000)
    toks, kv = list(range(100, 140)), _kv(40)
    pc.store(toks, kv)
    assert pc.tokens == 2 * BLOCK  # whole blocks only: 40 tokens keep 32
    m, blocks = pc.match(toks + [7, 8], limit=41)
    assert m == 2 * BLOCK
    out = torch.zeros(2, 2, 3, 50, 4)
    pc.copy(blocks, m, out)
    assert torch.equal(out[:, :, :, :m], kv[:, :, :, :m]) and not out[:, :, :, m:].any()
    # the limit cuts the last block (a prompt's last token is always prefilled); a block the
    # prompt ends inside is not matched
    assert pc.match(toks[:32], limit=31)[0] == 31
    assert pc.match(toks[:20], limit=19)[0] == 16
    assert pc.match(toks, limit=0)[0] == 0
    # a different first token: nothing, though every later block's tokens are the same
    assert pc.match([1] + toks[1:], limit=40)[0] == 0
    # the same tokens under another first block are another prefix
    assert pc.match(toks[BLOCK:] + toks, limit=40)[0] == 0
    assert pc.reused == 2 * BLOCK + 31 + 16


def test_requests_sharing_a_prefix_share_its_blocks_and_stale_leaves_go_first():
    pc = PrefixCache(3 * BLOCK)
    a = list(range(3 * BLOCK))
    b = a[:BLOCK] + list(range(500, 500 + 2 * BLOCK))  # a's first block, then its own
    pc.store(a, _kv(len(a), 1))
    pc.store(b, _kv(len(b), 2))
    # 5 blocks stored, 3 kept: a's second and third (least recently used) went, the shared first
    # block stayed, though it was stored first
    assert pc.tokens == 3 * BLOCK
    assert pc.match(b, limit=len(b))[0] == 3 * BLOCK
    assert pc.match(a, limit=len(a))[0] == BLOCK
    m, blocks = pc.match(a, limit=len(a))
    assert torch.equal(blocks[0], _kv(len(a), 1)[:, :, :, :BLOCK])  # a's entries, not b's
    # a bound under one block keeps nothing
    none = PrefixCache(BLOCK - 1)
    none.store(a, _kv(len(a)))
    assert none.tokens == 0 and none.match(a, len(a))[0] == 0


def _dec(target, tables, **kw):
    V = target.vocab_size
    return SpeculativeDecoder(
        target,
        [NGrammysDrafter(tables, V), ContextNGramDrafter(V, name="ctx")],
        cost_curve=CURVE,
        **kw,
    )


@pytest.mark.parametrize("chunk", ["auto", 0, 5])
def test_a_repeated_and_a_continued_prompt_reuse_the_cache_and_decode_as_plain_greedy(
    tiny_target, tiny_tables, chunk
):
    V = tiny_target.vocab_size
    first = [(5 * j + 3) % V for j in range(41)]
    other = [(11 * j + 2) % V for j in range(23)]
    dec = _dec(tiny_target, tiny_tables, prefill_chunk=chunk)
    fed = []  # prompt tokens each prefill forward (or piece riding in a verify) computed
    prefill, riding = dec.verifier.prefill, dec.verifier.verify_with_piece
    dec.verifier.prefill = lambda p, *a, **k: fed.append(sum(map(len, p))) or prefill(p, *a, **k)
    dec.verifier.verify_with_piece = lambda s, c, p, *a: (
        fed.append(sum(map(len, p))) or riding(s, c, p, *a)
    )
    g1 = dec.generate([first, other], max_new_tokens=20)
    assert [g.stats.cached_tokens for g in g1] == [0, 0]
    # the same prompt again, and a second turn: the first turn's prompt and answer, then more
    turn2 = first + g1[0].tokens + [(7 * j + 1) % V for j in range(9)]
    fed.clear()
    g2 = dec.generate([first, turn2], max_new_tokens=20)
    ref = plain_greedy(tiny_target, [first, turn2], max_new_tokens=20)
    assert [g.tokens for g in g2] == [r.tokens for r in ref]
    assert g2[0].tokens == g1[0].tokens
    cached = [g.stats.cached_tokens for g in g2]
    # whole blocks of what the first request held (its prompt and answer but the last token)
    assert cached[0] == (len(first) - 1) // BLOCK * BLOCK
    assert cached[1] == (len(first) + len(g1[0].tokens) - 1) // BLOCK * BLOCK
    assert sum(fed) == len(first) + len(turn2) - sum(cached)
    # the stored entries are the ones a fresh prefill of the prompt computes (their positions)
    cache = dec.verifier.new_cache(1, 64)
    prefill([first], cache)
    m, blocks = dec.prefix_cache.match(first, len(first) - 1)
    got = torch.zeros_like(cache.kv[:, :, 0, :, :m])
    PrefixCache.copy(blocks, m, got)
    assert torch.allclose(got, cache.kv[:, :, 0, :, :m], atol=1e-5, rtol=1e-4)


def test_the_engine_keeps_the_bound_and_off_means_every_prompt_prefilled(tiny_target, tiny_tables):
    V = tiny_target.vocab_size
    prompts = [[(13 * i + 7 * j + 1) % V for j in range(35)] for i in range(6)]
    dec = _dec(tiny_target, tiny_tables, prefix_cache=4 * BLOCK)
    eng = dec.engine()
    for p in prompts:
        eng.add(p, SamplingParams.checked(max_new_tokens=12))
    while eng.has_work:
        eng.step()
        assert dec.prefix_cache.tokens <= 4 * BLOCK
    assert dec.prefix_cache.tokens == 4 * BLOCK  # six requests of 46 tokens held: full
    off = _dec(tiny_target, tiny_tables, prefix_cache=0)
    assert off.prefix_cache is None
    off.generate([prompts[0], prompts[0]], max_new_tokens=4)  # would fill a cache
    g = off.generate([prompts[0]], max_new_tokens=4)
    assert g[0].stats.cached_tokens == 0


def test_an_idle_burst_sharing_a_cached_prefix_is_prefilled_before_it_decodes(tiny_target):
    """A prefix from the cache is not a piece cut off a long prompt: a burst of prompts behind
    a cached system prompt is prefilled whole in the idle step (forward after forward), as
    without the cache, not one forward's rows first with the others riding piece by piece."""
    V = tiny_target.vocab_size
    system = [(5 * j + 3) % V for j in range(40)]
    dec = SpeculativeDecoder(tiny_target, [], budget=0, cost_curve=CURVE)
    eng = dec.engine()
    eng.add(system, SamplingParams.checked(max_new_tokens=2))  # leaving, it stores 32 tokens
    while eng.has_work:
        eng.step()
    eng._pacer.ref = 100.0  # the idle allowance never runs out here
    eng._pacer.fits = lambda steps=1.0, fused=False, capped=True: lambda N, S: N <= 20
    fed = []
    prefill = eng.verifier.prefill
    eng.verifier.prefill = lambda p, *a, **k: fed.append(len(p)) or prefill(p, *a, **k)
    burst = [system[:32] + [(7 * i + 3 * j + 1) % V for j in range(10)] for i in range(4)]
    rids = [eng.add(p, SamplingParams.checked(max_new_tokens=6)) for p in burst]
    eng.step()
    assert not eng.prefilling and sorted(r.rid for r in eng.rows) == sorted(rids)
    assert fed == [2, 2]  # 20 tokens a forward: two rows' last 10 each
    assert all(r.stats.cached_tokens == 32 for r in eng.rows)
    while eng.has_work:
        eng.step()


@pytest.mark.parametrize("whole", [False, True])
def test_an_idle_burst_with_whole_prompts_prefills_the_long_ones_too(tiny_target, whole):
    """Under "auto" a long prompt's pieces ride with the rows that joined (their first tokens
    sooner); ``whole_prompts`` (``generate()``: the caller waits for the batch) prefills every
    prompt in the idle step, forward after forward, and nothing rides."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, cost_curve=CURVE)
    eng = dec.engine()
    eng.whole_prompts = whole
    eng._pacer.ref = 100.0  # the idle allowance never runs out here
    eng._pacer.fits = lambda steps=1.0, fused=False, capped=True: lambda N, S: N <= 20
    short = [[(7 * i + 3 * j + 1) % V for j in range(10)] for i in range(2)]
    long = [(5 * j + 3) % V for j in range(50)]
    for p in [*short, long]:
        eng.add(p, SamplingParams.checked(max_new_tokens=6))
    eng.step()
    assert len(eng.rows) == (3 if whole else 2)
    assert not eng.prefilling if whole else eng.prefilling[0].filled == 20
    while eng.has_work:
        eng.step()
    assert eng.totals["fused"] == (0 if whole else 2)  # the long prompt's later pieces


def test_generate_prefills_every_prompt_before_it_decodes(tiny_target, monkeypatch):
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, cost_curve=CURVE)
    prompts = [[(7 * i + 3 * j + 1) % V for j in range(10 + 60 * i)] for i in range(3)]
    seen = []
    step = type(dec.engine()).step
    monkeypatch.setattr(
        type(dec.engine()), "step", lambda self: seen.append(self.whole_prompts) or step(self)
    )
    out = dec.generate(prompts, max_new_tokens=4)
    assert seen and all(seen)
    assert [o.tokens for o in out] == [r.tokens for r in plain_greedy(tiny_target, prompts, 4)]
    list(dec.generate(prompts, max_new_tokens=4, stream=True))
    assert not seen[-1]

"""The compiled attention of CPU verify forwards (redraft/infer/runner/tree_attention.py): the
same attention as SDPA over the dense mask for rows of different lengths, trees and shared
key/value heads; plain decoding through it gives the tokens SDPA gives."""

import numpy as np
import pytest
import torch

from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.runner import tree_attention as ta

pytestmark = pytest.mark.skipif(not ta.available(), reason="numba is not installed")


class _Attn:
    num_key_value_groups = 3


def _case(lengths, n, kv=2, g=3, d=16, capacity=48, seed=0):
    """Queries, the cache's key/value views, the dense additive mask SDPA gets and the rows."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    buf = torch.randn(2, B + 1, kv, capacity, d, generator=gen)  # one slot more: a view
    q = torch.randn(B, kv * g, n, d, generator=gen)
    anc = torch.rand(B, n, n, generator=gen) < 0.5
    anc = torch.tril(anc) | torch.eye(n, dtype=torch.bool)  # ancestors come first; and self
    span = max(lengths) + n
    key, value = buf[0, :B, :, :span], buf[1, :B, :, :span]
    L = torch.tensor(lengths)
    rel = torch.arange(span)[None] - L[:, None]
    tree = anc.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(B, n, span))
    vis = (rel < 0)[:, None, :] | (tree & (rel < n)[:, None, :])
    mask = torch.zeros(vis.shape).masked_fill_(~vis, torch.finfo(torch.float32).min)[:, None]
    return q, key, value, mask, np.array(lengths, np.int64), anc.numpy()


@pytest.mark.parametrize(("lengths", "n"), [([5, 30, 17], 1), ([9], 1), ([3, 20], 6), ([25], 7)])
def test_it_is_sdpa_over_the_dense_mask(lengths, n):
    q, key, value, mask, L, anc = _case(lengths, n)
    g = q.shape[1] // key.shape[1]
    want = torch.nn.functional.scaled_dot_product_attention(
        q,
        key.repeat_interleave(g, 1),
        value.repeat_interleave(g, 1),
        attn_mask=mask,
        scale=0.3,
    ).transpose(1, 2)  # [B, n, heads, d]
    with ta.with_tree(L, anc):
        assert ta.supports(_Attn(), q, key, {"scaling": 0.3})
        got = ta.tree_attention(_Attn(), q, key, value, scaling=0.3)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # a row's columns past its length and its tree are not read: garbage there changes nothing
    key[0, :, L[0] + n :] = float("nan")
    with ta.with_tree(L, anc):
        again = ta.tree_attention(_Attn(), q, key, value, scaling=0.3)
    assert torch.equal(again, got)


def test_only_float32_on_the_cpu_with_the_rows_set():
    q, key, value, mask, L, anc = _case([4, 8], 1)
    assert not ta.supports(_Attn(), q, key, {})  # no rows set
    with ta.with_tree(L, anc):
        assert not ta.supports(_Attn(), q.bfloat16(), key.bfloat16(), {})
        assert not ta.supports(_Attn(), q, key, {"softcap": 30.0})
        assert ta.supports(_Attn(), q, key, {})


def test_plain_decoding_through_it_gives_sdpas_tokens(tiny_target, monkeypatch):
    V = tiny_target.vocab_size
    prompts = [[(7 * i + 3 * j + 1) % V for j in range(5 + 9 * i)] for i in range(4)]
    calls = []
    real = ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    on = SpeculativeDecoder(tiny_target, [], compiled_attention=True)
    got = on.generate(prompts, max_new_tokens=24)
    assert calls  # the steps attended through it
    calls.clear()
    off = SpeculativeDecoder(tiny_target, [], compiled_attention=False)
    want = off.generate(prompts, max_new_tokens=24)
    assert not calls
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.tokens for g in got] == [r.tokens for r in plain_greedy(tiny_target, prompts, 24)]


def test_only_one_row_with_a_tree_stays_with_sdpa():
    assert ta.pays(1, 1) and ta.pays(16, 1)
    assert ta.pays(2, ta.MAX_BATCH_TOKENS) and not ta.pays(2, ta.MAX_BATCH_TOKENS + 1)
    assert not ta.pays(1, 2)


def test_a_batch_of_small_trees_decodes_as_plain_greedy_through_it(tiny_target, monkeypatch):
    """Trees of the target's own continuation (a right path and a wrong sibling): accepted
    in part, the output plain greedy's."""
    from test_decoder import OracleDrafter

    from redraft.infer.runner.cost import CostCurve

    V = tiny_target.vocab_size
    prompts = [[(5 * i + 3 * j) % V for j in range(30 + 7 * i)] for i in range(3)]
    ref = plain_greedy(tiny_target, prompts, 32)
    sizes = []
    real = ta.tree_attention
    monkeypatch.setattr(
        ta, "tree_attention", lambda m, q, *a, **k: sizes.append(q.shape[2]) or real(m, q, *a, **k)
    )
    curve = CostCurve([1, 8, 64], [1.0, 1.05, 2.0])  # trees nearly free: they are drafted
    oracle = OracleDrafter({i: r.tokens for i, r in enumerate(ref)}, L=2)
    dec = SpeculativeDecoder(tiny_target, [oracle], cost_curve=curve, max_nodes=3)
    got = dec.generate(prompts, max_new_tokens=32)
    assert [g.tokens for g in got] == [r.tokens for r in ref]
    assert max(sizes) > 1 and max(sizes) <= ta.MAX_BATCH_TOKENS  # trees went through it
    assert sum(g.stats.target_calls for g in got) < sum(len(g.tokens) for g in got)

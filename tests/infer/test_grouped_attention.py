"""Rows of very different lengths attend in runs of consecutive rows on the CPU: the same output
as one call over the longest row, and the engine's outputs stay exact."""

import torch

from redraft.infer import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter
from redraft.infer.runner.grouped_attention import (
    CALL_COST,
    NAME,
    grouped,
    grouped_sdpa,
    packed_sdpa,
    row_groups,
)


def test_row_groups_split_only_where_it_saves_reads():
    assert row_groups([10, 12, 11], 2) is None  # similar lengths: one call
    assert row_groups([100], 1) is None
    # consecutive rows only (views, nothing gathered): a long row between short ones is a run
    assert row_groups([20, 4000, 30, 25], 3) == [
        (slice(0, 1), 23),
        (slice(1, 2), 4003),
        (slice(2, 4), 33),
    ]
    assert row_groups([20, 30, 25, 4000], 3) == [(slice(0, 3), 33), (slice(3, 4), 4003)]
    # the runs cover the batch in order, each over its longest row plus n
    lengths = [45, 48, 52, 61, 112, 82, 120, 174, 263, 701, 50]
    runs = row_groups(lengths, 1)
    assert [r.start for r, _ in runs] == [0] + [r.stop for r, _ in runs[:-1]]
    assert runs[-1][0].stop == len(lengths)
    assert all(span == max(lengths[r]) + 1 for r, span in runs)
    # never more columns read than one call over the longest row, calls counted
    read = sum((r.stop - r.start) * s + CALL_COST for r, s in runs)
    assert read < len(lengths) * (max(lengths) + 1) + CALL_COST


def test_a_row_leaving_does_not_gather_the_rows_of_a_group(monkeypatch):
    """The last row fills a leaving row's slot, so rows of similar length stop being
    neighbours; the runs stay views of the cache (no index_select of its keys and values)."""
    calls = []
    orig = torch.Tensor.index_select
    monkeypatch.setattr(
        torch.Tensor, "index_select", lambda self, *a: calls.append(a) or orig(self, *a)
    )
    g = torch.Generator().manual_seed(3)
    lengths = [30, 32, 700, 35, 40, 300]  # the long row moved between the short ones
    B, H, KV, n, d, span = len(lengths), 4, 2, 1, 8, 701
    q = torch.randn(B, H, n, d, generator=g)
    k = torch.randn(B, KV, span, d, generator=g)
    v = torch.randn(B, KV, span, d, generator=g)
    vis = torch.arange(span)[None, :] < torch.tensor(lengths)[:, None] + 1
    mask = torch.zeros(B, 1, n, span).masked_fill_(~vis[:, None, None], float("-inf"))
    ref, _ = grouped_sdpa(_Attn(), q, k, v, mask, scaling=d**-0.5)
    with grouped(row_groups(lengths, n)):
        out, _ = grouped_sdpa(_Attn(), q, k, v, mask, scaling=d**-0.5)
    assert not calls
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


class _Attn(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_grouped_sdpa_equals_one_call_over_the_whole_span():
    g = torch.Generator().manual_seed(0)
    B, H, KV, n, d, span = 4, 4, 2, 3, 8, 50
    q = torch.randn(B, H, n, d, generator=g)
    k = torch.randn(B, KV, span, d, generator=g)
    v = torch.randn(B, KV, span, d, generator=g)
    lengths = [5, 47, 9, 7]
    cols = torch.arange(span)
    vis = cols[None, None, :] < (
        torch.tensor(lengths)[:, None, None] + 1 + torch.arange(n)[None, :, None]
    )
    mask = torch.zeros(B, 1, n, span).masked_fill_(~vis[:, None], float("-inf"))
    module = _Attn()
    ref, _ = grouped_sdpa(module, q, k, v, mask, scaling=d**-0.5)  # no groups set: plain sdpa
    groups = row_groups(lengths, n)
    assert groups is not None and len(groups) > 1
    with grouped(groups):
        out, _ = grouped_sdpa(module, q, k, v, mask, scaling=d**-0.5)
    assert out.shape == (B, n, H, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_packed_query_heads_attend_as_repeated_keys_do_and_the_mask_is_repeated_once(
    monkeypatch,
):
    """transformers copies the keys and values per query head (``repeat_kv``) for more than one
    query token; packed_sdpa packs the query heads of a key/value head into its rows instead."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    module = _Attn()
    for B, n, span in ((2, 5, 40), (1, 17, 300), (3, 2, 9)):
        q = torch.randn(B, 4, n, 8, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
        k, v = torch.randn(2, B, 2, span, 8, generator=g)
        mask = torch.zeros(B, 1, n, span)
        mask[..., span - 3 :] = float("-inf")
        mask[0, 0, 0, :2] = float("-inf")  # rows differ: a mask row per query token
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        out, _ = packed_sdpa(module, q, k, v, mask, scaling=0.3)
        assert out.shape == ref.shape == (B, n, 4, 8) and out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # inside one verifier forward (grouped()), every layer reuses the first layer's repeated mask
    calls = []
    orig_repeat = torch.Tensor.repeat
    monkeypatch.setattr(
        torch.Tensor, "repeat", lambda self, *a: calls.append(a) or orig_repeat(self, *a)
    )
    with grouped(None):
        for _ in range(3):  # three layers
            packed_sdpa(module, q, k, v, mask, scaling=0.3)
    assert len(calls) == 1
    packed_sdpa(module, q, k, v, mask, scaling=0.3)  # outside a forward: made per call
    assert len(calls) == 2


def test_a_long_row_among_short_ones_decodes_exactly(tiny_target):
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [ContextNGramDrafter(V)], budget=6)
    assert dec.verifier._grouped  # a CPU target runs the grouped attention
    assert tiny_target.model.config._attn_implementation == NAME
    long = [(7 * j + 3) % V for j in range(90)]
    prompts = [[1, 2, 3], long, [4, 5], [6, 7, 8, 9]]
    eng = dec.engine()
    ids = {eng.add(p, SamplingParams.checked(max_new_tokens=12)): i for i, p in enumerate(prompts)}
    out = {}
    while eng.has_work:
        for ev in eng.step():
            if ev.done:
                out[ids[ev.index]] = ev.generation.tokens
    for i, p in enumerate(prompts):
        assert out[i] == plain_greedy(tiny_target, [p], max_new_tokens=12)[0].tokens


def test_a_static_verifier_packs_the_query_heads_too(tiny_target_dir):
    """The CUDA path (a static verify, captured in a graph there) attends packed as well, not
    through transformers' per-head copy of the cache; its tree hidden states are those of
    plain ``sdpa`` (the same attention), and it never splits rows in groups (one fixed span)."""
    from redraft.infer.runner.step_input import chain_step
    from redraft.infer.runner.verify import Verifier
    from redraft.models import load_target

    target = load_target(str(tiny_target_dir), dtype="float32", device="cpu")  # switched below
    assert target.model.config.num_attention_heads > target.model.config.num_key_value_heads
    outs = {}
    for impl in ("sdpa", NAME):
        ver = Verifier(target, static=True)
        assert target.model.config._attn_implementation == NAME and not ver._grouped
        if impl == "sdpa":  # the reference: transformers' own attention (repeat_kv for n > 1)
            target.model.set_attn_implementation("sdpa")
        cache = ver.new_cache(3, 64)
        with torch.inference_mode():
            ver.prefill([[5, 6, 7, 8], [9, 10], [11, 12, 13]], cache)
            cache.batch, cache.host_lengths = 3, [4, 2, 3]
            outs[impl] = ver.verify(chain_step([4, 2, 3], 5, ver.device), cache).clone()
    torch.testing.assert_close(outs[NAME], outs["sdpa"], rtol=1e-5, atol=1e-5)


def test_a_long_piece_is_not_packed_its_repeated_mask_would_outgrow_the_copies(monkeypatch):
    """Packing holds a ``[B, 1, g n, S]`` mask for the whole forward; beyond ``g n > 2 H d``
    (here 2 x 4 x 8 = 64: pieces of more than 32 tokens) that is more than the keys and values
    repeat_kv copies per layer, so such a piece takes transformers' path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, g = _Attn(), torch.Generator().manual_seed(2)
    repeats = []
    orig_repeat = torch.Tensor.repeat
    monkeypatch.setattr(
        torch.Tensor, "repeat", lambda self, *a: repeats.append(a) or orig_repeat(self, *a)
    )
    for n, packed in ((32, True), (33, False)):
        q = torch.randn(1, 4, n, 8, generator=g)
        k, v = torch.randn(2, 1, 2, 60, 8, generator=g)
        mask = torch.zeros(1, 1, n, 60)
        mask[..., 50:] = float("-inf")
        repeats.clear()
        out, _ = packed_sdpa(module, q, k, v, mask, scaling=0.3)
        assert bool(repeats) == packed, n
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)

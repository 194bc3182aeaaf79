"""The suffix drafter: tree paths, groups, request life cycle, the global tree's bound, and
greedy decoding with it equal to plain greedy."""

import numpy as np
import pytest
import torch

pytest.importorskip("arctic_inference.suffix_decoding")

from redraft.errors import ConfigError  # noqa: E402
from redraft.infer.drafters.suffix import SuffixDrafter, path_groups, tree_paths  # noqa: E402
from redraft.infer.spec.drafter import HostState  # noqa: E402
from redraft.infer.spec.paths import PAD  # noqa: E402


def _host(rows, prompt_lengths=None):
    seqs = [np.asarray(r, np.int64) for r in rows]
    n = [len(s) - 1 for s in seqs] if prompt_lengths is None else prompt_lengths
    return HostState(seqs, np.array([s[-1] for s in seqs]), np.array(n, np.int64))


def _paths(draft, b=0):
    """Row ``b``'s paths as token lists (PAD cut)."""
    return [[int(t) for t in p if t >= 0] for p in np.asarray(draft.tokens)[b]]


def test_tree_paths_are_root_to_leaf_most_probable_first():
    # 5 -> 6 (leaf, .5); 5 -> 7 -> 8 (leaf, .3); 9 under the root (leaf, .6)
    toks, parents, probs = [5, 6, 7, 8, 9], [-1, 0, 0, 2, -1], [0.9, 0.5, 0.4, 0.3, 0.6]
    paths, prob = tree_paths(toks, parents, probs, max_paths=8, max_len=4)
    assert paths.tolist() == [[9, PAD, PAD, PAD], [5, 6, PAD, PAD], [5, 7, 8, PAD]]
    assert prob.tolist() == pytest.approx([0.6, 0.5, 0.3])
    paths, _ = tree_paths(toks, parents, probs, max_paths=2, max_len=2)
    assert paths.tolist() == [[9, PAD], [5, 6]]
    assert tree_paths([], [], [], 4, 3)[0].shape == (0, 3)


def test_path_groups_order_match_length_then_probability():
    g = path_groups(1, np.array([0.9, 0.6, 0.3, 0.1]))
    assert g.tolist() == [0, 1, 2, 3]
    assert path_groups(4, np.array([0.9])).tolist() == [4]
    assert path_groups(30, np.array([0.1])).tolist() == [15]  # the last of 16 groups


def test_a_request_drafts_from_its_own_prompt():
    d = SuffixDrafter(max_paths=4, max_tokens_per_path=8, min_token_prob=0.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 9]
    d.add_rows_host(_host([prompt + [1, 2, 3]], [len(prompt)]), 0)
    dr = d.propose_host(_host([prompt + [1, 2, 3]], [len(prompt)]))
    # the match "1 2 3" (3 tokens) earns up to 3 tokens: what followed it in the prompt
    assert _paths(dr)[0] == [4, 5, 6]
    assert d.global_requests == 1  # the request's output goes to the global tree as it grows


def test_a_long_match_drafts_a_whole_path_past_half_the_tree_depth():
    # a repeated answer: after 20 matched tokens the next 20 are drafted, not 24 - 20 = 4 (the
    # trees are twice as deep as a path; at vLLM's depth of 24 a draft stops at 12 tokens)
    answer = list(range(100, 160))
    d = SuffixDrafter(max_paths=2, max_tokens_per_path=20, min_token_prob=0.0)
    d.add_rows_host(_host([[5, 6] + answer + [7] + answer[:20]], [2]), 0)
    dr = d.propose_host(_host([[5, 6] + answer + [7] + answer[:20]], [2]))
    assert _paths(dr)[0] == answer[20:40]
    shallow = SuffixDrafter(max_paths=2, max_tokens_per_path=20, min_token_prob=0.0, max_depth=24)
    shallow.add_rows_host(_host([[5, 6] + answer + [7] + answer[:20]], [2]), 0)
    got = _paths(shallow.propose_host(_host([[5, 6] + answer + [7] + answer[:20]], [2])))[0]
    assert got == answer[20 : 20 + len(got)] and len(got) <= 12


def test_suffix_factor_earns_more_tokens_per_matched_token():
    from redraft.infer import DecoderConfig
    from redraft.infer.loader import suffix_drafter

    d = suffix_drafter(DecoderConfig(suffix_factor=2.0, suffix_w=8, ngram_k=4))
    d.min_token_prob = 0.0
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    d.add_rows_host(_host([prompt + [1, 2, 3]], [len(prompt)]), 0)
    dr = d.propose_host(_host([prompt + [1, 2, 3]], [len(prompt)]))
    assert _paths(dr)[0] == [4, 5, 6, 7, 8, 9]  # a match of 3 earns 2 * 3 tokens


def test_a_later_request_drafts_from_an_earlier_ones_output_and_not_without_the_global_tree():
    out = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    for max_tokens, drafts in ((1000, True), (0, False)):
        d = SuffixDrafter(
            max_paths=4, max_tokens_per_path=8, min_token_prob=0.0, max_tokens=max_tokens
        )
        first = [7, 8] + out
        d.add_rows_host(_host([first[:3]], [2]), 0)
        d.propose_host(_host([first[:6]], [2]))  # output grows between steps
        d.retire_rows_host(_host([first], [2]), [0])  # finished: its last tokens count too
        d.select_rows(torch.zeros(0, dtype=torch.long))
        assert d.rows == [] and d.trees.active == 0
        # another prompt; its output so far repeats the start of the first output
        second = [9, 9, 9, 40, 41, 42, 43]
        d.add_rows_host(_host([second], [3]), 0)
        got = _paths(d.propose_host(_host([second], [3])))
        if drafts:
            assert got[0] == [44, 45, 46, 47]  # 4 matched tokens earn 4
        else:
            assert got == []


def test_the_global_tree_holds_at_most_max_tokens_and_evicts_the_oldest_first():
    d = SuffixDrafter(max_tokens=25, min_token_prob=0.0)
    outputs = [[100 + 10 * i + j for j in range(10)] for i in range(6)]
    for i, o in enumerate(outputs):
        seq = [1, 2] + o
        d.add_rows_host(_host([seq[:3]], [2]), 0)
        d.retire_rows_host(_host([seq], [2]), [0])
        d.select_rows(torch.zeros(0, dtype=torch.long))
        assert d.trees.held_tokens <= 25
        assert d.global_requests == min(i + 1, 2)
    assert list(d.trees.held) == [4, 5]  # the two newest requests

    def drafts_from(o):
        probe = [3, 3, o[0], o[1], o[2]]
        d.add_rows_host(_host([probe], [2]), 0)
        got = _paths(d.propose_host(_host([probe], [2])))
        d.retire_rows_host(_host([probe], [2]), [0])
        d.select_rows(torch.zeros(0, dtype=torch.long))
        return bool(got) and got[0][0] == o[3]

    assert drafts_from(outputs[5]) and not drafts_from(outputs[0])


def test_rows_stay_aligned_when_the_batch_changes():
    d = SuffixDrafter(max_paths=2, max_tokens_per_path=4, min_token_prob=0.0, max_tokens=0)
    a = [1, 2, 3, 1, 2]  # "1 2" -> 3
    b = [5, 6, 7, 5, 6]  # "5 6" -> 7
    d.add_rows_host(_host([a, b], [5, 5]), 0)
    d.retire_rows_host(_host([a, b], [5, 5]), [0])
    d.select_rows(torch.tensor([1]))
    got = _paths(d.propose_host(_host([b], [5])))
    assert got[0][0] == 7
    c = [8, 9, 4, 8, 9]
    d.add_rows_host(_host([b, c], [5, 5]), 1)
    dr = d.propose_host(_host([b, c], [5, 5]))
    assert _paths(dr, 0)[0][0] == 7 and _paths(dr, 1)[0][0] == 4


def test_a_negative_bound_is_a_clear_error():
    with pytest.raises(ConfigError, match="max_tokens=-1"):
        SuffixDrafter(max_tokens=-1)


def test_greedy_equals_plain_greedy_alone_and_in_a_mix_and_a_repeat_accepts_more(
    tiny_target, tiny_tables, tiny_prompts
):
    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
    from redraft.infer.drafters.ngram import NGrammysDrafter
    from redraft.infer.runner.cost import CostCurve

    V = tiny_target.vocab_size
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=32)
    curve = CostCurve([1, 8, 64], [1.0, 1.2, 2.0])  # fixed: the test stays deterministic
    for drafters in ([SuffixDrafter()], [NGrammysDrafter(tiny_tables, V), SuffixDrafter()]):
        dec = SpeculativeDecoder(tiny_target, drafters, cost_curve=curve)
        out = dec.generate(tiny_prompts, max_new_tokens=32)
        for o, r in zip(out, ref):
            assert o.tokens == r.tokens
    # one decoder, the same prompt twice: the second request drafts from the first's output
    suffix = SuffixDrafter()
    dec = SpeculativeDecoder(tiny_target, [suffix], cost_curve=curve)
    first = dec.generate(tiny_prompts[0], max_new_tokens=48)[0]
    second = dec.generate(tiny_prompts[0], max_new_tokens=48)[0]
    assert (
        second.tokens == first.tokens == plain_greedy(tiny_target, tiny_prompts[:1], 48)[0].tokens
    )
    assert second.stats.target_calls < first.stats.target_calls
    assert second.stats.tokens_per_call > 3
    assert suffix.global_requests == 2


def test_a_decoder_that_forgets_drafts_and_prefills_a_repeated_prompt_afresh(
    tiny_target, tiny_prompts
):
    """``SpeculativeDecoder.forget``: the prefix cache and the global tree are emptied, so a
    repeated prompt is prefilled whole and drafted as the first time (what redraft-bench gives
    every pass, as vLLM's fresh engines get); the output is the same."""
    from redraft.infer.decoder import SpeculativeDecoder
    from redraft.infer.runner.cost import CostCurve

    suffix = SuffixDrafter()
    curve = CostCurve([1, 8, 64], [1.0, 1.2, 2.0])
    dec = SpeculativeDecoder(tiny_target, [suffix], cost_curve=curve)
    prompt = list(tiny_prompts[0]) * 3  # a whole block or more to cache
    first = dec.generate([prompt], max_new_tokens=48)[0]
    again = dec.generate([prompt], max_new_tokens=48)[0]
    assert again.stats.cached_tokens > 0 and again.stats.target_calls < first.stats.target_calls
    # the last row has finished but not left the batch yet: forget drops it first, or it would
    # store its entries and output as it leaves
    assert dec.prefix_cache.tokens > 0 and suffix.global_requests == 2
    dec.forget()
    assert dec.prefix_cache.tokens == 0 and suffix.global_requests == 0
    fresh = dec.generate([prompt], max_new_tokens=48)[0]
    assert fresh.tokens == first.tokens
    assert fresh.stats.cached_tokens == 0
    assert fresh.stats.target_calls > again.stats.target_calls  # no answer to draft from
    running = dec.stream(prompt, max_new_tokens=4)
    next(running)  # a request is decoding
    with pytest.raises(RuntimeError, match="between them"):
        dec.forget()

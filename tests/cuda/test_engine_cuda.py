"""The engine's state across requests on CUDA: the prefix cache's blocks reused by a repeated
prompt and a second turn, the suffix drafter's global tree, and ``forget()`` emptying both, every
output equal to plain greedy (float32). Same checks as tests/infer/test_prefix_cache.py and
tests/infer/test_suffix.py on the CPU."""

import importlib.util

import pytest
from cuda_helpers import DEVICE

from redraft.infer import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter
from redraft.infer.drafters.suffix import SuffixDrafter
from redraft.infer.engine.prefix import BLOCK
from redraft.infer.loader import load_ngram_tables

pytestmark = pytest.mark.cuda


def test_cached_prefixes_and_forget_decode_as_plain_greedy_on_cuda(cuda_target, cuda_tables_dir):
    target = cuda_target
    assert target.device.type == DEVICE
    V = target.vocab_size
    tables = load_ngram_tables(cuda_tables_dir, target)
    drafters = [NGrammysDrafter(tables, V), ContextNGramDrafter(V, name="ctx")]
    suffix = None
    if importlib.util.find_spec("arctic_inference") is not None:  # not on every GPU image
        suffix = SuffixDrafter(max_paths=4, max_tokens_per_path=8, min_token_prob=0.0)
        drafters.append(suffix)
    dec = SpeculativeDecoder(target, drafters)
    first = [(5 * j + 3) % V for j in range(41)]
    other = [(11 * j + 2) % V for j in range(23)]
    g1 = dec.generate([first, other], max_new_tokens=24)
    assert [g.stats.cached_tokens for g in g1] == [0, 0]
    turn2 = first + g1[0].tokens + [(7 * j + 1) % V for j in range(9)]
    prompts = [first, turn2, other]
    ref = plain_greedy(target, prompts, max_new_tokens=24)
    g2 = dec.generate(prompts, max_new_tokens=24)
    assert [g.tokens for g in g2] == [r.tokens for r in ref]
    cached = [g.stats.cached_tokens for g in g2]
    assert cached[0] == (len(first) - 1) // BLOCK * BLOCK
    assert cached[1] == (len(first) + len(g1[0].tokens) - 1) // BLOCK * BLOCK
    assert dec.prefix_cache.tokens > 0 and (suffix is None or suffix.global_requests == 5)
    dec.forget()
    assert dec.prefix_cache.tokens == 0 and (suffix is None or suffix.global_requests == 0)
    g3 = dec.generate(prompts, max_new_tokens=24)
    assert [g.stats.cached_tokens for g in g3] == [0, 0, 0]
    assert [g.tokens for g in g3] == [r.tokens for r in ref]

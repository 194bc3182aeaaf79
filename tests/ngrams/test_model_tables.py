"""Model-derived tables equal their definitions computed directly on the tiny target."""

import pytest
import torch

from redraft.ngrams.model_tables import (
    _prefix_state,
    _prefixed_hidden,
    _single_token_hidden,
    bigram_context,
    build_bigram,
    build_extended,
    build_extended_with_model,
    build_unigram,
    unigram_probs,
)


def test_unigram_equals_formula(tiny_target):
    V = tiny_target.input_embedding.weight.double()  # [vocab, H]
    U = tiny_target.output_head.weight.double()
    u_bar = U.mean(0)
    # d(x) = ||u_x - ū||_V = ||V (u_x - ū)||₂, straight from the definition (no Gram matrix):
    # row x of (U - ū) Vᵀ is V (u_x - ū).
    d = torch.linalg.vector_norm((U - u_bar) @ V.T, dim=1)
    expected = torch.exp(-d) / torch.exp(-d).sum()
    torch.testing.assert_close(unigram_probs(tiny_target), expected, rtol=1e-9, atol=1e-12)
    ids, probs = build_unigram(tiny_target, k=7)
    top = torch.topk(expected, 7)
    assert ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(probs, top.values.float())


def _reference_rows(target, prefix=()):
    seqs = torch.tensor([list(prefix) + [x] for x in range(target.vocab_size)])
    with torch.no_grad():
        return torch.softmax(target.model(input_ids=seqs).logits[:, -1].double(), -1)  # [V, V]


def test_bigram_context_is_the_start_of_text_token(tiny_target, llama2_target_dir):
    from transformers import AutoTokenizer

    tok = tiny_target.tokenizer  # ChatML, no BOS added: the <|endoftext|> document separator
    assert bigram_context(tok) == tok.convert_tokens_to_ids("<|endoftext|>") == 0
    llama2 = AutoTokenizer.from_pretrained(str(llama2_target_dir))  # no separator: its bos_token
    assert bigram_context(llama2) == llama2.bos_token_id


@pytest.mark.parametrize("fast_path", [True, False], ids=["shortcut", "model-forward"])
def test_bigram_rows_equal_model_softmax_topk(tiny_target, fast_path):
    ids, probs = build_bigram(
        tiny_target, k=6, batch_size=100, dtype="float32", fast_path=fast_path, progress=False
    )
    ref = torch.topk(
        _reference_rows(tiny_target, prefix=(0,)), 6
    )  # rows are p(· | [<|endoftext|>, x])
    assert ids.shape == (tiny_target.vocab_size, 6) and ids.dtype == torch.int32
    torch.testing.assert_close(probs.double(), ref.values, rtol=1e-4, atol=1e-6)
    # Ids equal wherever the reference has no near-tie that rounding could flip.
    gaps = (ref.values[:, :-1] - ref.values[:, 1:]).min(-1).values
    clear = gaps > 1e-5
    assert clear.float().mean() > 0.9
    assert torch.equal(ids[clear].long(), ref.indices[clear])


def test_shortcuts_equal_model_forward_hidden_states(tiny_target):
    model, x = tiny_target.model, torch.arange(0, tiny_target.vocab_size, 7)
    with torch.no_grad():
        ref = model.model(input_ids=x[:, None]).last_hidden_state[:, -1]
        torch.testing.assert_close(_single_token_hidden(model, x), ref, rtol=1e-5, atol=1e-5)
        seq = torch.stack([torch.full_like(x, 5), x], 1)  # [prefix, x]
        ref = model.model(input_ids=seq).last_hidden_state[:, -1]
        got = _prefixed_hidden(model, x, _prefix_state(model, 5, x.device))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bigram_without_prefix_uses_the_lone_token(tiny_target):
    ids, probs = build_bigram(tiny_target, k=4, dtype="float32", bos=None, progress=False)
    ref = torch.topk(_reference_rows(tiny_target), 4)
    torch.testing.assert_close(probs.double(), ref.values, rtol=1e-4, atol=1e-6)
    prefixed, _ = build_bigram(tiny_target, k=4, dtype="float32", progress=False)
    assert not torch.equal(ids, prefixed)  # the prefix changes the rows


def test_bigram_bf16_keeps_fp32_ranking_mostly(tiny_target):
    ids32, p32 = build_bigram(tiny_target, k=3, dtype="float32", progress=False)
    ids16, p16 = build_bigram(tiny_target, k=3, dtype="bfloat16", progress=False)
    assert (ids16[:, 0] == ids32[:, 0]).float().mean() > 0.9
    assert (p16 - p32).abs().max() < 0.1
    assert tiny_target.dtype == torch.float32  # the caller's model is not cast


def test_extended_equals_chaining_by_hand():
    g = torch.Generator().manual_seed(0)
    bigram = torch.randint(0, 30, (30, 4), generator=g, dtype=torch.int32)
    ext = build_extended(bigram, w=5)
    assert ext.shape == (30, 4, 5) and ext.dtype == torch.int32
    for x in range(30):
        for j in range(4):
            chain = [int(bigram[x, j])]
            while len(chain) < 5:
                chain.append(int(bigram[chain[-1], 0]))
            assert ext[x, j].tolist() == chain
    assert build_extended(bigram, w=3, k=2).shape == (30, 2, 3)


def test_extended_with_model_equals_greedy_decoding(tiny_target):
    bigram, _ = build_bigram(tiny_target, k=2, dtype="float32", progress=False)
    ext = build_extended_with_model(
        tiny_target, bigram, w=4, batch_size=300, dtype="float32", progress=False
    )
    assert ext.shape == (tiny_target.vocab_size, 2, 4)
    assert torch.equal(ext[:, :, 0], bigram)
    for x, j in [(0, 0), (5, 1), (100, 0), (383, 1)]:
        seq = [0, x, int(bigram[x, j])]  # after the same start-of-text token as the rows
        for _ in range(3):  # greedy, full forward each step (no cache)
            with torch.no_grad():
                seq.append(
                    int(tiny_target.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                )
        assert ext[x, j].tolist() == seq[2:]


@pytest.mark.slow
def test_default_target_bigram_rows_equal_model_softmax(default_target):
    tokens = torch.tensor([0, 2, 28, 198, 1000, 4321, 30000, 49151])
    ids, probs = build_bigram(default_target, k=10, dtype="float32", tokens=tokens, progress=False)
    assert bigram_context(default_target.tokenizer) == 0  # SmolLM2's <|endoftext|>
    with torch.no_grad():
        seq = torch.stack([torch.zeros_like(tokens), tokens], 1)
        logits = default_target.model(input_ids=seq).logits[:, -1]
    ref = torch.topk(torch.softmax(logits.double(), -1), 10)
    torch.testing.assert_close(probs.double(), ref.values, rtol=1e-3, atol=1e-4)  # summation order
    assert torch.equal(ids[:, :3].long(), ref.indices[:, :3])
    ids16, _ = build_bigram(default_target, k=10, dtype="bfloat16", tokens=tokens, progress=False)
    assert (ids16[:, 0].long() == ref.indices[:, 0]).float().mean() >= 0.75

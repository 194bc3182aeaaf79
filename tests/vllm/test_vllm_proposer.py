"""redraft's vLLM proposer without vLLM: settings, start-up errors, drafting, learning, export.
The proposer reads only a few fields of vLLM's config, faked here (conftest.fake_vllm_config)."""

import json

import numpy as np
import pytest
from vllm_helpers import fake_vllm_config, save_test_tables  # noqa: I001

from redraft.errors import ArtifactError, ConfigError, FingerprintMismatchError
from redraft.vllm.proposer import Proposer, trigram_chains
from redraft.vllm.settings import (
    CLASS_PATH,
    ProposerSettings,
    read_settings,
    speculative_config,
)


def _batch(rows, width=256):
    """vLLM's inputs for rows of token lists: (sampled, num_tokens_no_spec, token_ids_cpu)."""
    tok = np.zeros((max(len(rows), 4), width), dtype=np.int32)
    n = np.zeros(len(tok), dtype=np.int32)
    for i, r in enumerate(rows):
        tok[i, : len(r)] = r
        n[i] = len(r)
    return [[r[-1]] if r else [] for r in rows], n, tok


FULL = ProposerSettings(min_value=0.0, cost="off")  # every candidate token kept


@pytest.fixture
def proposer(tiny_target_dir, config_env):
    return Proposer(fake_vllm_config(tiny_target_dir, k=4), FULL)


# ------------------------------------------------------------------ settings


def test_settings_from_json_and_yaml_file(tmp_path, config_env):
    env = {config_env: '{"q_min": 2, "q_max": 3, "paths": 5}'}
    s = read_settings(env)
    assert (s.q_min, s.q_max, s.paths, s.ngrams) == (2, 3, 5, None)
    f = tmp_path / "proposer.yaml"
    f.write_text("ngrams: some/dir\nmin_value: 0.25\ndrafters: [context]\n")
    s = read_settings({config_env: str(f)})
    assert (s.ngrams, s.min_value, s.drafters) == ("some/dir", 0.25, ["context"])
    assert read_settings({}) == ProposerSettings()
    d = read_settings({})
    assert (d.min_value, d.min_value_per_row, d.cost) == (0.03, 0.0, "measured")


@pytest.mark.parametrize(
    "value, words",
    [
        ('{"q_mni": 2}', "q_mni"),
        ('{"q_min": 3, "q_max": 2}', "q_min=3"),
        ('{"min_value": 1.5}', "min_value=1.5"),
        ('{"cost": "fixed"}', "cost='fixed'"),
        ('{"drafters": ["context", "eagle"]}', "eagle"),
        ("{not json", "not valid JSON"),
        ("/no/such/settings.yaml", "/no/such/settings.yaml"),
    ],
)
def test_bad_settings_name_the_value(value, words, config_env):
    with pytest.raises(ConfigError, match="REDRAFT_VLLM_CONFIG") as e:
        read_settings({config_env: value})
    assert words in str(e.value)


def test_speculative_config_puts_the_settings_in_the_environment(monkeypatch, config_env):
    import importlib
    import os

    spec = speculative_config(6, ngrams="tables/dir", paths=3)
    assert spec == {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": 6}
    assert json.loads(os.environ[config_env])["ngrams"] == "tables/dir"
    module, _, name = CLASS_PATH.rpartition(".")
    assert getattr(importlib.import_module(module), name) is Proposer  # what vLLM imports
    with pytest.raises(ConfigError, match="bogus"):
        speculative_config(5, bogus=1)


# ------------------------------------------------------------------ start-up errors


def test_missing_tables_fail_at_start_naming_the_path(tiny_target_dir, config_env):
    with pytest.raises(ArtifactError, match="/no/such/tables"):
        Proposer(fake_vllm_config(tiny_target_dir), ProposerSettings(ngrams="/no/such/tables"))


def test_tables_of_another_tokenizer_fail_at_start(tiny_target_dir, tmp_path, config_env):
    from types import SimpleNamespace

    from redraft.ngrams.tables import save_tables

    other = SimpleNamespace(vocab_size=384)
    d = save_tables(
        tmp_path / "other",
        {"vocab_size": other.vocab_size, "tokenizer_fingerprint": "sha256:0000000000000000"},
        extended=np.zeros((384, 2, 3), np.int32),
    )
    with pytest.raises(FingerprintMismatchError, match="sha256:0000000000000000"):
        Proposer(fake_vllm_config(tiny_target_dir), ProposerSettings(ngrams=str(d)))


def test_drafters_without_their_tables_fail_at_start(tiny_target_dir, config_env):
    with pytest.raises(ConfigError, match="ngrammys.*extended"):
        Proposer(fake_vllm_config(tiny_target_dir), ProposerSettings(drafters=["ngrammys"]))


# ------------------------------------------------------------------ drafting


def test_context_chain_continues_the_earlier_occurrence(proposer):
    row = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12]
    out = proposer.propose(*_batch([row]))
    assert out[0] == [13, 14, 20, 21]  # what followed "10 11 12" before, k = 4 tokens
    assert proposer.proposed_tokens == 4


def test_rows_without_sampled_tokens_get_no_chain(proposer):
    row = [10, 11, 12, 13, 10, 11, 12]
    sampled, n, tok = _batch([row, row])
    sampled[1] = []  # vLLM: no token sampled for this row (a prefill chunk)
    out = proposer.propose(sampled, n, tok)
    assert out[0] == [13, 10, 11, 12] and out[1] == []
    assert proposer.propose([[], []], n, tok) == [[], []]


def test_nothing_to_match_proposes_nothing(proposer):
    assert proposer.propose(*_batch([[1, 2, 3, 4, 5]])) == [[]]


def test_chain_never_passes_the_model_length(tiny_target_dir, config_env):
    p = Proposer(fake_vllm_config(tiny_target_dir, k=4, max_model_len=12), FULL)
    row = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12]  # 10 tokens: room for 1 draft + the bonus
    assert p.propose(*_batch([row])) == [[13]]


def test_min_value_cuts_chains_below_the_estimated_acceptance(tiny_target_dir, config_env):
    cfg = fake_vllm_config(tiny_target_dir, k=4)
    row = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12]
    # the prior rate is 0.3 a depth: 0.3, 0.09, ... ; a floor of 0.2 keeps one token
    floor = ProposerSettings(cost="off")
    assert Proposer(cfg, floor.replace(min_value=0.2)).propose(*_batch([row])) == [[13]]
    assert Proposer(cfg, floor.replace(min_value=0.5)).propose(*_batch([row])) == [[]]
    # a second row raises the floor by min_value_per_row
    p = Proposer(cfg, floor.replace(min_value=0.05, min_value_per_row=0.3))
    assert p.propose(*_batch([row]))[0] == [13, 14]
    assert p.propose(*_batch([row, row])) == [[], []]


def test_learning_from_what_was_sampled(proposer):
    row = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12]
    proposer.propose(*_batch([row]))  # proposed 13 14 20 21
    tries0 = proposer.stats.tries.sum()
    # vLLM accepted 13 14 and sampled 99 after them: 3 new tokens
    proposer.propose([[13, 14, 99]], *_batch([row + [13, 14, 99]])[1:])
    assert proposer.stats.tries.sum() > tries0
    # the chain's group (match of 3 tokens, rank 0) of the context drafter (owner 0)
    hits, tries = proposer.stats.hits[0].sum(0), proposer.stats.tries[0].sum(0)  # [depth]
    assert hits[0] > 0 and hits[1] > 0  # depths 0 and 1 were right
    assert tries[2] > 0 and hits[2] == 0  # depth 2 was tried and wrong
    assert tries[3] == 0  # never reached


def test_a_new_request_in_the_row_is_not_learned_from(proposer):
    row = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12]
    proposer.propose(*_batch([row]))
    other = [7, 8, 9, 30, 31, 32, 33, 34, 35, 36, 40]  # the row now holds another request
    proposer.propose([[40]], *_batch([other])[1:])
    assert proposer.stats.tries.sum() == 0


def test_deterministic_for_every_rank(tiny_target_dir, config_env):
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(0, 20, 60)) for _ in range(3)]
    a, b = (Proposer(fake_vllm_config(tiny_target_dir), FULL) for _ in range(2))
    for step in range(5):
        batch = _batch([r[: 40 + step] for r in rows])
        assert a.propose(*batch) == b.propose(*batch)


def test_tables_add_model_and_corpus_candidates(tiny_target, tiny_target_dir, tmp_path, config_env):
    d = save_test_tables(tmp_path / "tables", tiny_target)
    p = Proposer(fake_vllm_config(tiny_target_dir, k=4), FULL.replace(ngrams=str(d)))
    assert p.drafters == ["context", "ngrammys", "trigram", "suffix"]
    p = Proposer(
        fake_vllm_config(tiny_target_dir, k=4),
        FULL.replace(ngrams=str(d), drafters=["ngrammys", "trigram"]),
    )
    row = [1, 2, 3]  # no context match: the chain comes from the tables
    out = p.propose(*_batch([row]))
    ext = p.host_tables.extended(np.array([3]))[0]  # [k, w] rows of token 3
    tri = trigram_chains(p.trigram, np.array([2]), np.array([3]), 4, 4)[0]
    cands = [list(r[:4]) for r in ext] + [list(r[r >= 0][:4]) for r in tri]
    assert out[0] and out[0] in [c[: len(out[0])] for c in cands]


def test_a_later_request_gets_an_earlier_ones_output_from_the_suffix_trees(
    tiny_target_dir, config_env
):
    out1 = [40, 41, 42, 43, 44, 45, 46, 47]
    first = [1, 2, 3] + out1
    cfg = fake_vllm_config(tiny_target_dir, k=4)
    chains = {}
    for drafters in (["context", "suffix"], ["context"]):
        p = Proposer(cfg, FULL.replace(drafters=drafters))
        for n in range(4, len(first) + 1):  # the first request decodes in row 0
            p.propose(*_batch([first[:n]]))
        # row 0 now holds another prompt whose output so far repeats the start of out1
        second = [9, 9, 9, 9, 40, 41, 42]
        chains[drafters[-1]] = p.propose(*_batch([second]))[0]
    assert chains["suffix"] == [43, 44, 45]  # 3 matched tokens earn 3 (SuffixDecoding's rule)
    assert chains["context"] == []  # the request's own tokens hold no match


def test_a_long_repeated_answer_fills_a_long_chain_from_the_suffix_trees(
    tiny_target_dir, config_env
):
    # k = 20: the trees are 40 deep, so a 20-token match drafts 20 (at vLLM's 24, 12 at most)
    answer = list(range(100, 150))
    p = Proposer(fake_vllm_config(tiny_target_dir, k=20), FULL.replace(drafters=["suffix"]))
    first = [1, 2] + answer
    for n in range(3, len(first) + 1):
        p.propose(*_batch([first[:n]]))
    second = [9, 9] + answer[:20]
    assert p.propose(*_batch([second]))[0] == answer[20:40]


def test_the_suffix_drafter_without_arctic_inference_fails_at_start(
    tiny_target_dir, config_env, monkeypatch
):
    import redraft.vllm.proposer as proposer_module

    monkeypatch.setattr(proposer_module, "suffix_available", lambda: False)
    cfg = fake_vllm_config(tiny_target_dir)
    assert Proposer(cfg, FULL).drafters == ["context"]
    with pytest.raises(ConfigError, match="arctic-inference"):
        Proposer(cfg, FULL.replace(drafters=["context", "suffix"]))


def test_trigram_chains_follow_the_most_probable_successor():
    from redraft.ngrams.trigrams import trigram_table_from_token_arrays

    seqs = [np.array([1, 2, 3, 4, 5]), np.array([1, 2, 3, 4, 5]), np.array([1, 2, 6, 7])]
    table = trigram_table_from_token_arrays(seqs, 10, t=4, progress=False)
    chains = trigram_chains(table, np.array([1]), np.array([2]), 4, 2)
    assert chains[0, 0].tolist() == [3, 4, 5, -1]  # (1,2)->3 twice, then 4, 5, then unseen
    assert chains[0, 1].tolist() == [6, 7, -1, -1]


# ------------------------------------------------------------------ export


def test_export_target_writes_a_folder_transformers_loads(tiny_target, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from redraft.vllm.export import export_target

    out = export_target(str(tiny_target.model.name_or_path), tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, tiny_target.model(x).logits)
    with pytest.raises(ConfigError, match="already holds a model"):
        export_target(str(tiny_target.model.name_or_path), out)


def test_config_command_writes_the_settings_and_the_serve_line(tmp_path, capsys, config_env):
    from redraft.vllm.cli import main

    (tmp_path / "tables").mkdir()
    out = tmp_path / "proposer.json"
    assert main(["config", "--ngrams", str(tmp_path / "tables"), "-k", "6", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert json.loads(out.read_text())["ngrams"] == str((tmp_path / "tables").resolve())
    assert line.startswith(f"{config_env}={out.resolve()} vllm serve MODEL --speculative-config ")
    spec = json.loads(line.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": 6}
    assert main(["config", "--drafters", "context,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_replay_scores_chains_against_the_real_continuation():
    from redraft.vllm.replay import replay

    out = [5, 6, 7, 8, 9, 10]

    def oracle(ctx, sampled):  # proposes the true next two tokens, then one wrong token
        n = len(ctx) - 3  # prompt of 3 tokens
        return out[n : n + 2] + [0]

    r = replay(oracle, [([1, 2, 3], out)])
    # prefill -> 5; then 6 7 accepted + 8 sampled; 9 10 accepted (the chain is cut at the end)
    assert r["tau"] == pytest.approx(6 / 3)
    assert r["drafted_per_step"] == pytest.approx((3 + 2) / 3)
    assert replay(lambda ctx, s: [], [([1], out)])["tau"] == 1.0


def test_earliest_longest_match_is_vllms_rule():
    from redraft.vllm.proposer import earliest_longest_match

    row = [7, 1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]  # "1 2 3" twice before: the earliest wins
    assert earliest_longest_match([row], 1, 4, 3, 4096)[0].tolist() == [9, 1, 2]
    # a longer match later beats a shorter one earlier
    row = [4, 3, 9, 6, 4, 3, 8, 0, 4, 3]  # "3" at 1 and 5, "4 3" at 0-1 and 4-5: earliest "4 3"
    assert earliest_longest_match([row], 1, 4, 2, 4096)[0].tolist() == [9, 6]
    assert earliest_longest_match([[1, 2, 3]], 1, 4, 2, 4096)[0].tolist() == [-1, -1]
    # outside the window nothing is found
    assert earliest_longest_match([[5, 6, 0, 0, 0, 5]], 1, 4, 1, 3)[0].tolist() == [-1]

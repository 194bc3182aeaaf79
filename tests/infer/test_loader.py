"""load_decoder / load_preset on the tiny target with a saved random ReDrafter head."""

import pytest

from redraft.errors import ConfigError, FingerprintMismatchError
from redraft.infer import load_decoder, load_preset, plain_greedy


@pytest.fixture(scope="module")
def head_dir(tiny_head, tmp_path_factory):
    path = tmp_path_factory.mktemp("head")
    tiny_head.save_pretrained(path)
    return path


def test_load_decoder_with_a_drafter_artifact(tiny_target, head_dir, tiny_prompts):
    dec = load_decoder(
        tiny_target, drafters=[str(head_dir)], budget=8, redrafter_width=3, redrafter_length=2
    )
    assert [d.name for d in dec.drafters] == ["redrafter", "context"]
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=16)
    assert [g.tokens for g in dec.generate(tiny_prompts, max_new_tokens=16)] == [
        r.tokens for r in ref
    ]
    with pytest.raises(ConfigError):
        load_decoder(tiny_target, budgett=3)


def test_drafter_for_another_tokenizer_is_refused(llama2_target_dir, head_dir):
    from redraft.models import load_target

    other = load_target(str(llama2_target_dir), dtype="float32", device="cpu")
    with pytest.raises(FingerprintMismatchError):
        load_decoder(other, drafters=[str(head_dir)])


def test_preset_skips_missing_artifacts(tiny_target_dir, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(
        f"target: {tiny_target_dir}\ndtype: float32\ndrafters: [checkpoints/nope]\nbudget: 4\n"
    )
    dec = load_preset(preset)
    assert [d.name for d in dec.drafters] == ["context"] and dec.config.budget == 4


def test_load_decoder_adds_aded_for_a_trigram_table(tiny_target, tmp_path, tiny_prompts):
    import numpy as np

    from redraft.models import load_target  # noqa: F401  (tiny_target is already loaded)
    from redraft.ngrams import build_trigram_table, count_trigrams, save_tables

    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=16)
    # a tri-gram table counted over the target's own greedy outputs: ADED's drafts then hit
    docs = [np.asarray(r.tokens, dtype=np.int32) for r in ref]
    table = build_trigram_table(count_trigrams(docs, tiny_target.vocab_size), t=4, min_count=1)
    save_tables(
        tmp_path,
        dict(tiny_target.artifact_metadata(), vocab_size=tiny_target.vocab_size),
        trigram=table,
    )
    plain = load_decoder(tiny_target, ngrams=[str(tmp_path)], budget=8)
    assert "aded" not in [d.name for d in plain.drafters]
    dec = load_decoder(tiny_target, ngrams=[str(tmp_path)], budget=8, aded=True)
    assert [d.name for d in dec.drafters][-1] == "aded"
    outs = dec.generate(tiny_prompts, max_new_tokens=16)
    assert [g.tokens for g in outs] == [r.tokens for r in ref]
    assert sum(g.stats.drafter_accepted["aded"] for g in outs) > 0

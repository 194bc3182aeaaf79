"""Property-based: whatever a caller passes to the decoding API, it either works or raises a
RedraftError with a message (never another exception, never a hang)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from redraft.errors import RedraftError
from redraft.infer import SpeculativeDecoder
from redraft.infer.drafters.ngram import ContextNGramDrafter

numbers = st.one_of(
    st.integers(-5, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
prompts = st.one_of(
    st.text(max_size=20),
    st.lists(st.integers(-3, 400), max_size=6),
    st.lists(st.lists(st.integers(0, 383), max_size=4), max_size=3),
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from(["user", "assistant", 3]),
                "content": st.one_of(st.text(max_size=8), st.integers()),
            },
        ),
        max_size=2,
    ),
    st.none(),
    st.integers(),
    st.just([]),
)
stops = st.one_of(
    st.none(),
    st.text(max_size=4),
    st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=3),
)


@pytest.fixture(scope="module")
def decoders(tiny_target):
    V = tiny_target.vocab_size
    return [
        SpeculativeDecoder(tiny_target, [ContextNGramDrafter(V)], budget=4),
        SpeculativeDecoder(tiny_target, [ContextNGramDrafter(V)], acceptance="rejection", budget=4),
    ]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=prompts,
    max_new_tokens=numbers,
    temperature=numbers,
    top_p=numbers,
    stop=stops,
    seed=st.one_of(st.none(), st.integers(-3, 2**64)),
    which=st.integers(0, 1),
)
def test_generate_succeeds_or_raises_a_redraft_error(
    decoders, prompt, max_new_tokens, temperature, top_p, stop, seed, which
):
    dec = decoders[which]
    n = (
        max_new_tokens
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
        else 0
    )
    if n > 6:  # keep runs short: large values are legal, not interesting
        max_new_tokens = 6
    try:
        out = dec.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
        )
    except RedraftError as exc:
        assert str(exc)
        return
    assert isinstance(max_new_tokens, int) and max_new_tokens >= 1
    assert math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1
    for g in out:
        assert 1 <= len(g.tokens) <= max_new_tokens and g.finish_reason in ("eos", "length", "stop")
        assert all(0 <= t < dec.target.vocab_size for t in g.tokens)


def test_a_tensor_batch_and_single_forms_decode_alike(decoders):
    dec = decoders[0]
    ids = [5, 17, 40, 3]
    a = dec.generate(ids, max_new_tokens=4)[0].tokens
    assert dec.generate(torch.tensor(ids), max_new_tokens=4)[0].tokens == a
    assert [g.tokens for g in dec.generate(torch.tensor([ids, ids]), max_new_tokens=4)] == [a, a]


@settings(max_examples=200, deadline=None)
@given(
    values=st.dictionaries(
        st.sampled_from(
            sorted(__import__("redraft.infer.config", fromlist=["FIELDS"]).FIELDS) + ["bogus"]
        ),
        numbers,
        max_size=4,
    )
)
@example(values={"prefill_chunk": "²"})  # a Unicode digit int() refuses
@example(values={"max_nodes": "١٢"})  # Arabic-Indic digits int() takes
def test_decoder_config_accepts_or_names_the_bad_setting(values):
    from redraft.errors import ConfigError
    from redraft.infer import DecoderConfig

    try:
        cfg = DecoderConfig.from_dict(values)
    except ConfigError as exc:
        # the error names a setting that was given (context_q and context_q_max name each other)
        assert exc.param in str(exc) and any(k in str(exc) for k in values)
        assert exc.param in values or {exc.param, "context_q", "context_q_max"} == {
            "context_q",
            "context_q_max",
        }
        return
    assert "bogus" not in values
    assert cfg.validate() is cfg

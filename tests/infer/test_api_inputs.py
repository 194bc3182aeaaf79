"""The Python API takes what users pass: NumPy arrays like tensors, a dict of sampling
parameters, ``stop_token_ids``; text that is not valid Unicode is a clear error naming it."""

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer import SamplingParams, SpeculativeDecoder
from redraft.infer.drafters.ngram import ContextNGramDrafter


@pytest.fixture(scope="module")
def dec(tiny_target):
    return SpeculativeDecoder(tiny_target, [ContextNGramDrafter(tiny_target.vocab_size)], budget=8)


def test_numpy_arrays_are_read_like_tensors(dec):
    ids = [5, 17, 42, 9, 3]
    want = dec.generate(torch.tensor(ids), max_new_tokens=6)[0].tokens
    assert dec.generate(np.array(ids), max_new_tokens=6)[0].tokens == want
    assert dec.generate(np.array(ids, dtype=np.int32), max_new_tokens=6)[0].tokens == want
    batch = dec.generate(np.array([ids, ids[::-1]]), max_new_tokens=6)
    assert [g.tokens for g in batch] == [want, dec.generate(ids[::-1], max_new_tokens=6)[0].tokens]
    assert dec.encode([np.array(ids), ids]) == [ids, ids]
    with pytest.raises(ConfigError, match="dtype float64"):
        dec.generate(np.array([1.0, 2.0]))


@pytest.mark.parametrize(
    "prompt,where",
    [
        ("abc\ud83d def", "prompt 0"),
        ([{"role": "user", "content": "hi \udc00"}], "prompt 0, message 0"),
    ],
)
def test_a_lone_surrogate_is_a_clear_error(dec, prompt, where):
    with pytest.raises(ConfigError) as info:
        dec.generate(prompt, max_new_tokens=2)
    assert (
        where in str(info.value)
        and "surrogate" in str(info.value)
        and "character" in str(info.value)
    )


def test_engine_add_takes_a_dict_of_sampling_parameters(dec):
    ids = [5, 17, 42, 9, 3]
    engine = dec.engine()
    rid = engine.add(ids, {"max_new_tokens": 3})
    out = [ev.generation for _ in range(50) if engine.has_work for ev in engine.step() if ev.done]
    assert len(out) == 1 and len(out[0].tokens) == 3 and rid == 0
    assert out[0].tokens == dec.generate(ids, max_new_tokens=3)[0].tokens
    with pytest.raises(ConfigError, match="unknown sampling parameter") as info:
        engine.add(ids, {"max_tokens": 3})
    assert info.value.param == "max_tokens"
    with pytest.raises(ConfigError) as info:
        engine.add(ids, {"max_new_tokens": 0})
    assert info.value.param == "max_new_tokens"
    with pytest.raises(ConfigError, match="SamplingParams or a dict"):
        engine.add(ids, 3)


def test_stop_token_ids_end_a_request(dec):
    ids = [5, 17, 42, 9, 3]
    full = dec.generate(ids, max_new_tokens=12)[0]
    stop = full.tokens[4]
    first = full.tokens.index(stop)
    engine = dec.engine()
    engine.add(ids, SamplingParams.checked(max_new_tokens=12, stop_token_ids=[stop]))
    done = [ev.generation for _ in range(50) if engine.has_work for ev in engine.step() if ev.done][
        0
    ]
    assert done.finish_reason == "stop" and done.tokens == full.tokens[: first + 1]
    assert done.text == dec.target.tokenizer.decode(full.tokens[:first], skip_special_tokens=True)
    with pytest.raises(ConfigError) as info:
        SamplingParams.checked(stop_token_ids=[-1])
    assert info.value.param == "stop_token_ids"

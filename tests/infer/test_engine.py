"""The step-level engine: requests join a running batch and leave it; outputs do not depend on
who else is in the batch; argument checks; incremental text."""

import copy
import random

import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
from redraft.infer.engine.text import TextStream
from redraft.infer.runner.cost import CostCurve

CURVE = CostCurve([1, 8, 64], [1.0, 1.2, 2.0])


def run_staggered(engine, prompts, params, join_at):
    """Add prompt i before step ``join_at[i]``; returns {request id: Generation} and the ids."""
    out, ids, step = {}, {}, 0
    while len(out) < len(prompts):
        for i, s in enumerate(join_at):
            if s == step:
                ids[engine.add(prompts[i], params[i])] = i
        for ev in engine.step():
            if ev.done:
                out[ids[ev.index]] = ev.generation
        step += 1
        assert step < 500
    return out


def test_requests_joining_a_running_batch_get_their_single_request_output(
    tiny_target, tiny_tables, tiny_head
):
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(
        tiny_target,
        [
            NGrammysDrafter(tiny_tables, V),
            ReDrafterDrafter(tiny_head, width=3, length=3),
            ContextNGramDrafter(V, name="ctx"),
        ],
        cost_curve=CURVE,
    )
    rng = random.Random(0)
    texts = [
        "Hello there",
        "def add(a, b):",
        "The quick brown fox",
        "import torch\nx =",
        "Paris is the",
        "for i in range(10):",
        "Speculative decoding",
        "How can I help",
    ]
    prompts = [dec.encode(t)[0] for t in texts]
    params = [SamplingParams.checked(max_new_tokens=rng.randint(3, 30)) for _ in texts]
    singles = [
        plain_greedy(tiny_target, [p], max_new_tokens=s.max_new_tokens)[0]
        for p, s in zip(prompts, params)
    ]
    out = run_staggered(dec.engine(), prompts, params, join_at=[0, 0, 1, 2, 2, 5, 9, 14])
    for i, single in enumerate(singles):
        assert out[i].tokens == single.tokens, texts[i]
        assert out[i].text == single.text
        assert out[i].finish_reason == single.finish_reason


def test_a_cancelled_request_leaves_and_the_others_are_unchanged(tiny_target, tiny_prompts):
    dec = SpeculativeDecoder(
        tiny_target, [ContextNGramDrafter(tiny_target.vocab_size)], cost_curve=CURVE
    )
    prompts = [dec.encode(p)[0] for p in tiny_prompts]
    ref = plain_greedy(tiny_target, prompts, max_new_tokens=20)
    engine = dec.engine()
    rids = [engine.add(p, SamplingParams.checked(max_new_tokens=20)) for p in prompts]
    done, seen = {}, {r: [] for r in rids}
    engine.step()
    engine.cancel(rids[1])
    while engine.has_work:
        for ev in engine.step():
            seen[ev.index] += ev.tokens
            if ev.done:
                done[ev.index] = ev.generation
    assert set(done) == {rids[0], rids[2]}
    assert engine.batch_size == 0 and not engine.has_work
    assert done[rids[0]].tokens == ref[0].tokens and done[rids[2]].tokens == ref[2].tokens
    # a request cancelled before it joined never runs
    rid = engine.add(prompts[0], SamplingParams.checked(max_new_tokens=5))
    engine.cancel(rid)
    assert not engine.has_work and engine.step() == []


def test_a_seeded_request_samples_the_same_whoever_shares_the_batch(tiny_target, tiny_tables):
    dec = SpeculativeDecoder(
        tiny_target,
        [NGrammysDrafter(tiny_tables, tiny_target.vocab_size)],
        acceptance="rejection",
        budget=8,
    )
    p = dec.encode("Hello there")[0]
    seeded = SamplingParams.checked(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=123)

    def alone_and_with(others):
        engine = dec.engine()
        rid = engine.add(p, seeded)
        for o in others:
            engine.add(dec.encode(o)[0], SamplingParams.checked(max_new_tokens=12, temperature=1.2))
        out = {}
        while engine.has_work:
            out.update({ev.index: ev.generation for ev in engine.step() if ev.done})
        return out[rid].tokens

    a = alone_and_with([])
    b = alone_and_with(["The quick brown fox", "def add(a, b):"])
    assert a == b
    # and it is plain sampling with the same seed: the i-th token is drawn with the i-th uniform
    plain = SpeculativeDecoder(tiny_target, [], acceptance="rejection", budget=0)
    engine = plain.engine()
    rid = engine.add(p, seeded)
    out = {}
    while engine.has_work:
        out.update({ev.index: ev.generation for ev in engine.step() if ev.done})
    assert out[rid].tokens == a
    assert len(set(a)) > 3  # really sampled (temperature 0.9), not a repeated argmax


def test_bad_arguments_are_config_errors_naming_the_argument(tiny_target):
    dec = SpeculativeDecoder(tiny_target, [])
    cases = [
        (dict(max_new_tokens=-5), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(seed=-1), "seed"),
    ]
    for kw, param in cases:
        with pytest.raises(ConfigError) as e:
            dec.generate("hi", **kw)
        assert e.value.param == param, kw
        assert param in str(e.value)
    V = tiny_target.vocab_size
    for prompt, param in (
        ([], "prompt"),
        (None, "prompt"),
        ([[]], "prompt"),
        ([5, V], "prompt"),
        ([-1, 3], "prompt"),
        ([{"role": "user"}], "messages"),
        ([{"content": "x"}], "messages"),
    ):
        with pytest.raises(ConfigError) as e:
            dec.generate(prompt)
        assert e.value.param == param, prompt
    ctx = tiny_target.model.config.max_position_embeddings
    with pytest.raises(ConfigError, match="context") as e:
        dec.generate([1] * ctx, max_new_tokens=1)
    with pytest.raises(ConfigError, match="context") as e:
        dec.generate([1, 2, 3], max_new_tokens=ctx)
    assert e.value.param == "max_new_tokens"
    with pytest.raises(ConfigError, match="temperature"):
        dec.generate("hi", temperature=0.5)  # greedy acceptance cannot sample


def test_a_bare_stop_string_is_one_stop_string(tiny_target, tiny_prompts):
    ref = plain_greedy(tiny_target, tiny_prompts[:1], max_new_tokens=30)[0]
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(set(stop)) > 1 and stop in text
    g = plain_greedy(tiny_target, tiny_prompts[:1], max_new_tokens=30, stop=stop)[0]
    assert g.finish_reason == "stop" and g.text == text[: text.index(stop)]
    for ch in set(stop):  # the old bug: any of its characters stopped the text
        if ch in text[: text.index(stop)]:
            assert g.text.count(ch) == text[: text.index(stop)].count(ch)


def test_incremental_text_equals_a_full_decode(tiny_target, llama2_target_dir):
    from redraft.models import load_target

    rng = random.Random(1)
    for tok in (tiny_target.tokenizer, load_target(str(llama2_target_dir), device="cpu").tokenizer):
        for _ in range(40):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
            stream, pieces, i = TextStream(tok), [], 0
            while i < len(ids):
                n = rng.randint(1, 4)
                pieces.append(stream.add(ids[i : i + n]))
                i += n
            pieces.append(stream.finish())
            full = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert "".join(pieces) == full == stream.text


def test_text_streams_call_the_fast_backend_only_where_decode_is_transformers_own(tiny_target):
    """The stream decodes through the ``tokenizers`` backend directly (what transformers' decode
    calls, without its argument conversion) for the tokenizers the test above checks against a
    full decode; a tokenizer class with its own ``decode`` is called through it."""
    from redraft.infer.engine.text import backend_decoder

    tok = tiny_target.tokenizer
    assert backend_decoder(tok) is tok._tokenizer
    assert TextStream(tok)._backend is tok._tokenizer

    class Shouting(type(tok)):
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    loud = copy.copy(tok)
    loud.__class__ = Shouting
    assert backend_decoder(loud) is None
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    stream = TextStream(loud)
    assert stream.add(ids) + stream.finish() == "HELLO WORLD"


def test_stop_strings_split_over_steps_never_reach_the_stream(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    full = tok.decode(ids)
    stop = "fox jumps"
    for chunk in (1, 2, 3):
        stream, out = TextStream(tok, (stop, "zzz")), ""
        for i in range(0, len(ids), chunk):
            out += stream.add(ids[i : i + chunk])
            assert stop not in out and not (out.endswith("fox") and not stream.stopped)
        out += stream.finish()
        assert stream.stopped and out == full[: full.index(stop)]


@pytest.mark.parametrize("budget", ["auto", 12])
def test_static_verify_gives_the_eager_output(
    tiny_target, tiny_tables, tiny_head, tiny_prompts, budget
):
    """Trees padded to fixed sizes and the cache in its static mode (what CUDA graphs capture)
    decode exactly like the dynamic path, in a batch with rows of different lengths."""
    V = tiny_target.vocab_size

    def drafters():
        return [NGrammysDrafter(tiny_tables, V), ReDrafterDrafter(tiny_head, width=3, length=3)]

    eager = SpeculativeDecoder(
        tiny_target, drafters(), budget=budget, cost_curve=CURVE, static_verify=False
    )
    static = SpeculativeDecoder(
        tiny_target, drafters(), budget=budget, cost_curve=CURVE, static_verify=True
    )
    assert static.verifier.static and not static.verifier.graphs  # no graphs on a CPU
    a = eager.generate(tiny_prompts, max_new_tokens=24)
    b = static.generate(tiny_prompts, max_new_tokens=24)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
    sizes = {s for s in (static.verifier.tree_size(n, limit=65) for n in range(1, 66))}
    assert sizes <= {1, 2, 4, 8, 16, 24, 32, 48, 64}


def test_a_decode_step_reads_the_device_once(tiny_target, tmp_path, monkeypatch):
    """With device-side drafters and static trees, a step's only device-to-host transfer is
    the packed result (on a GPU every other read would be a sync that stops the host)."""
    from redraft.bench.overhead import tiny_setup
    from redraft.infer.loader import make_drafters

    target, tables = tiny_setup(tmp_path)
    dec = SpeculativeDecoder(
        target, make_drafters(target, (), [tables]), cost_curve=CURVE, static_verify=True
    )
    engine = dec.engine()
    for text in ("The quick brown fox jumps over the lazy dog. The quick", "def add(a, b):"):
        engine.add(dec.encode(text)[0], SamplingParams.checked(max_new_tokens=40))
    engine.step()  # the join (prefill) reads the first tokens: not a decode step
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            if self.device.type != "meta":
                reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    steps = 0
    while engine.has_work and steps < 10:
        before = len(reads)
        engine.step()
        steps += 1
        assert reads[before:] == ["numpy"], reads[before:]  # StepReadout: the rule's picks, once
    assert steps >= 3


def test_seeded_rows_keep_the_target_distribution(tiny_target, tiny_tables):
    """Many requests, each with its own seed (inverse-CDF sampling from per-token uniforms): the
    second new token, the first one a verify step produces, follows
    sum_t1 p(t1) p(t2 | prompt, t1) (chi-square)."""
    from scipy.stats import chisquare

    from redraft.infer.drafters.ngram import TableDrafter

    ids = tiny_target.chat_ids([{"role": "user", "content": "Hello"}])
    n, V = 1500, tiny_target.vocab_size
    dec = SpeculativeDecoder(
        tiny_target, [TableDrafter(tiny_tables, "bigram", k=4)], acceptance="rejection", budget=4
    )
    engine = dec.engine()
    for seed in range(n):
        engine.add(ids, SamplingParams.checked(max_new_tokens=2, temperature=1.0, seed=seed))
    out = []
    while engine.has_work:
        out += [ev.generation for ev in engine.step() if ev.done]
    second = torch.tensor([g.tokens[1] for g in out if len(g.tokens) > 1])
    with torch.no_grad():
        p1 = tiny_target.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        p2 = (
            tiny_target.model(torch.tensor([ids + [t] for t in range(V)])).logits[:, -1].softmax(-1)
        )
    marg = (p1[:, None] * p2).sum(0).double()
    obs = torch.bincount(second, minlength=V).double()
    exp = marg / marg.sum() * obs.sum()
    keep = exp > 5
    obs_k = torch.cat([obs[keep], obs[~keep].sum()[None]])
    exp_k = torch.cat([exp[keep], exp[~keep].sum()[None]])
    assert chisquare(obs_k, exp_k / exp_k.sum() * obs_k.sum()).pvalue > 1e-3
    assert sum(g.stats.accepted_hist.get(1, 0) for g in out) > 30  # drafts were accepted


def test_an_engine_without_text_gives_the_same_tokens_and_refuses_stop_strings(
    tiny_target, tiny_tables
):
    """``text=False`` (distillation's engine): the same tokens, events and finish reasons as
    with text, empty text, no tokenizer call; stop strings refused (they need the text)."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [NGrammysDrafter(tiny_tables, V)], cost_curve=CURVE)
    prompts = [dec.encode(t)[0] for t in ("Hello there", "def add(a, b):", "Paris is the")]
    params = [
        SamplingParams.checked(max_new_tokens=n, stop_token_ids=[s])
        for n, s in ((12, 5), (20, 7), (9, 3))
    ]
    with_text = run_staggered(dec.engine(), prompts, params, [0, 1, 3])
    calls = []
    decode = tiny_target.tokenizer.decode
    tiny_target.tokenizer.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    try:
        no_text = run_staggered(dec.engine(text=False), prompts, params, [0, 1, 3])
    finally:
        tiny_target.tokenizer.decode = decode
    assert not calls
    assert any(g.text for g in with_text.values())
    for i in range(3):
        assert no_text[i].tokens == with_text[i].tokens
        assert no_text[i].finish_reason == with_text[i].finish_reason
        assert no_text[i].text == ""
    with pytest.raises(ConfigError, match="stop strings need the text") as e:
        dec.engine(text=False).add(prompts[0], {"max_new_tokens": 4, "stop": ["x"]})
    assert e.value.param == "stop"


def _engine_warnings(dec, thread: bool) -> list:
    """The warnings of making two engines over ``dec``, on a new thread or this one."""
    import threading
    import warnings

    caught = []

    def make():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            dec.engine()
            dec.engine()
        caught.extend(w)

    if not thread:
        make()
        return caught
    t = threading.Thread(target=make)
    t.start()
    t.join()
    return caught


def test_an_engine_on_another_thread_than_its_decoders_warns_once(tiny_target):
    """PyTorch's OpenMP team belongs to the thread that opened it: on a CPU, decoding on another
    thread than the one that built the decoder made each step 1.2-1.5x as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dec = SpeculativeDecoder(tiny_target, [])
        assert _engine_warnings(dec, thread=False) == []  # the decoder's own thread
        caught = _engine_warnings(dec, thread=True)
        assert len(caught) == 1 and caught[0].category is RuntimeWarning
        assert "another thread than the one that loaded the decoder" in str(caught[0].message)
        assert _engine_warnings(dec, thread=True) == []  # once per decoder
        torch.set_num_threads(1)  # one thread: no OpenMP team to share
        assert _engine_warnings(SpeculativeDecoder(tiny_target, []), thread=True) == []
    finally:
        torch.set_num_threads(threads)

"""Distillation replies from the engine equal Hugging Face ``generate``'s, token for token
(greedy), with stop ids, max_new_tokens, multi-turn conversations and a batch kept full."""

import json

import pytest

from redraft.bench.replies import run_generator
from redraft.data.distill import distill
from redraft.data.regenerate import _prompt_ids
from redraft.data.replies import HFReplies, ReplySettings, make_replies, use_replies
from redraft.infer.replies import EngineReplies

# ShareGPT records: one turn, two turns with a system prompt, three turns
CHATS = [
    {
        "id": "c0",
        "conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi"}],
    },
    {
        "id": "c1",
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "4."},
            {"from": "human", "value": "And 3+3?"},
            {"from": "gpt", "value": "6."},
        ],
    },
    {
        "id": "c2",
        "conversations": [
            {"from": "human", "value": v} if i % 2 == 0 else {"from": "gpt", "value": v}
            for i, v in enumerate(["def add(a, b):", "ok", "thanks", "sure", "bye", "bye"])
        ],
    },
    {
        "id": "c3",
        "conversations": [
            {"from": "human", "value": "Tell me about Paris."},
            {"from": "gpt", "value": "It is in France."},
        ],
    },
]
TEXTS = [
    "Hi",
    "Speculative decoding drafts tokens and the target verifies them",
    "print(x)",
    "What is the capital of France?",
    "List three colours.",
]


def run_all(gen, prompts):
    """At most ``batch_size`` in flight, refilled as replies finish (as distill does)."""
    return run_generator(gen, prompts, gen_batch(gen))


def gen_batch(gen):
    return gen.settings.batch_size


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [_prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]


def test_greedy_replies_equal_generate_with_a_stop_id_that_fires(tiny_target, prompts):
    eos = tuple(tiny_target.eos_token_ids)
    free = run_all(HFReplies(tiny_target, ReplySettings(12, eos, batch_size=5)), prompts)
    # a token the random model emits mid-reply in some rows: the stop id that ends them early
    stop = next(t for toks, _ in free for t in toks[2:8])
    settings = ReplySettings(12, (stop, *eos), batch_size=2)  # 2 in flight: rows leave and join
    hf = run_all(HFReplies(tiny_target, settings), prompts)
    eng = run_all(EngineReplies(tiny_target, settings), prompts)
    assert eng == hf
    assert any(stopped for _, stopped in hf) and any(not stopped for _, stopped in hf)
    for toks, stopped in hf:
        assert stop not in toks and (stopped or len(toks) == 12)


def test_distilled_records_are_the_same_from_both_generators(tiny_target, tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    data = f"sharegpt:{src}"
    kw = dict(max_new_tokens=6, batch_size=2, progress=False)
    hf, eng = tmp_path / "hf.jsonl", tmp_path / "engine.jsonl"
    a = distill(tiny_target, data, hf, replies=HFReplies, **kw)
    b = distill(tiny_target, data, eng, replies=EngineReplies, **kw)
    assert (a["generator"], b["generator"]) == ("hf-generate", "engine")
    by_id = lambda p: {r["id"]: r for r in map(json.loads, p.read_text().splitlines())}  # noqa: E731
    assert by_id(hf) == by_id(eng) and len(by_id(hf)) == len(CHATS)
    assert a["new_tokens"] == b["new_tokens"] > 0
    # the engine says where its time went: a row's reply is its prefill's token, then one per
    # decode step (a stop token is made, not kept); every prompt (a turn) prefilled, <= 2 rows
    e = b["engine"]
    turns = sum(c["from"] == "human" for r in CHATS for c in r["conversations"])
    assert "engine" not in a and len(CHATS) // 2 <= e["prefills"] <= turns  # 2 rows may share one
    assert b["new_tokens"] - turns <= e["row_steps"] <= b["new_tokens"] + turns
    assert 1.0 <= e["mean_batch"] <= 2.0 and e["steps"] >= e["row_steps"] / 2
    assert e["prefill_s"] > 0 and e["decode_s"] > 0


def test_multi_turn_conversations_continue_alike_from_both_generators(tiny_target, prompts):
    """With a stop id that fires, later turns are generated (each sees the earlier replies), in
    flight next to other conversations' first turns; both generators give the same records."""
    from redraft.data.distill import distill_stream
    from redraft.data.records import Record

    eos = tuple(tiny_target.eos_token_ids)
    free = run_all(HFReplies(tiny_target, ReplySettings(16, eos, batch_size=5)), prompts)
    stop = next(t for toks, _ in free for t in toks[1:4])
    users = ["Hi", "And then?", "Why?", "print(x)", "ok", "Tell me more."]
    records = [
        Record(
            id=f"r{i}",
            kind="chat",
            messages=[
                m
                for u in users[i:] + users[:i]
                for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "x"})
            ][:6],
            source="test",
        )
        for i in range(5)
    ]

    def out(factory):
        from collections import Counter

        gen = make_replies(tiny_target, ReplySettings(16, (stop, *eos), batch_size=3), factory)
        counts = Counter()
        recs = list(
            distill_stream(
                gen,
                tiny_target.tokenizer,
                records,
                capacity=3,
                max_prompt_tokens=512,
                counts=counts,
            )
        )
        return {r.id: r.messages for r in recs if r is not None}, counts

    (hf, c_hf), (eng, c_eng) = out(HFReplies), out(EngineReplies)
    assert hf == eng and c_hf == c_eng
    assert max(sum(m["role"] == "assistant" for m in msgs) for msgs in hf.values()) >= 2


def test_use_replies_sets_the_default_generator_for_a_block(tiny_target):
    s = ReplySettings(4, tuple(tiny_target.eos_token_ids))
    assert isinstance(make_replies(tiny_target, s), HFReplies)
    with use_replies(EngineReplies):
        assert isinstance(make_replies(tiny_target, s), EngineReplies)
        assert isinstance(make_replies(tiny_target, s, HFReplies), HFReplies)  # explicit wins
    assert isinstance(make_replies(tiny_target, s), HFReplies)


def test_sampled_EngineReplies_do_not_depend_on_the_batch(tiny_target, prompts):
    s1 = ReplySettings(8, tuple(tiny_target.eos_token_ids), temperature=1.0, seed=3, batch_size=1)
    s5 = ReplySettings(8, tuple(tiny_target.eos_token_ids), temperature=1.0, seed=3, batch_size=5)
    one = run_all(EngineReplies(tiny_target, s1), prompts)
    five = run_all(EngineReplies(tiny_target, s5), prompts)
    greedy = run_all(EngineReplies(tiny_target, ReplySettings(8, s1.stop_ids)), prompts)
    assert one == five and one != greedy


def test_the_benchmark_times_both_generators_on_the_same_prompts(tiny_target, prompts):
    from redraft.bench.replies import measure

    res = measure(tiny_target, prompts, {"hf": HFReplies, "engine": EngineReplies}, 5, 2, rounds=2)
    (n_hf, t_hf, r_hf, _), (n_en, t_en, r_en, _) = res["hf"], res["engine"]
    assert r_hf == r_en and n_hf == n_en == sum(len(t) for t, _ in r_hf) > 0
    assert t_hf > 0 and t_en > 0


def test_redraft_train_self_distills_with_the_generator_use_replies_sets(tiny_target, tmp_path):
    """The trainer (which may not import infer) makes its data with the injected engine."""
    import types

    from redraft.train.config import make_config
    from redraft.train.distilled import distilled_data
    from redraft.train.fingerprint import target_record

    src = tmp_path / "src.jsonl"
    src.write_text(
        "".join(json.dumps({**c, "id": f"x{i}-{c['id']}"}) + "\n" for i in range(8) for c in CHATS)
    )
    cfg = make_config(
        "tiny",
        {
            "output_dir": str(tmp_path / "run"),
            "data": f"sharegpt:{src}",
            "self_distill": "true",
            "distill_dir": str(tmp_path / "distilled"),
            "distill_limit": "3",
            "distill_max_new_tokens": "4",
            "eval_limit": "2",
        },
    )
    said = []
    env = types.SimpleNamespace(is_main=True, say=said.append, barrier=lambda: None)
    with use_replies(EngineReplies):
        out = distilled_data(cfg, tiny_target, target_record(tiny_target), env)
    made = [m for m in said if "new tokens in" in m]
    assert len(made) == 2 and all(m.endswith(", engine)") for m in made), said
    assert out.data.endswith("train.jsonl") and (tmp_path / "distilled" / "train.jsonl").is_file()


def test_replies_that_wait_to_join_together_are_the_same_and_pay_fewer_prefills(tiny_target):
    """``join_group``: poll returns once that many replies ended, so their next prompts share a
    prefill forward (on a GPU each eager prefill costs a fixed 34 ms); the replies do not change."""
    tok = tiny_target.tokenizer
    texts = [f"{w} number {i}" for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 4)]
    ps = [_prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    free = run_all(HFReplies(tiny_target, ReplySettings(10, (), batch_size=8)), ps)
    stop = next(t for toks, _ in free for t in toks[2:7])  # replies of different lengths
    settings = ReplySettings(10, (stop,), batch_size=8)
    hf = run_all(HFReplies(tiny_target, settings), ps)
    prefills = {}
    for k in (1, 4):
        gen = EngineReplies(tiny_target, settings)
        gen.join_group = k
        assert run_all(gen, ps) == hf
        prefills[k] = gen.stats()["prefills"]
    assert prefills[4] < prefills[1]


def test_the_join_group_follows_the_measured_costs(tiny_target):
    """sqrt(2 x rate x flying x c0 / step), at most a quarter of the batch, 1 before it is measured."""
    gen = EngineReplies(tiny_target, ReplySettings(10, (), batch_size=64))
    assert gen.group(64) == 1  # nothing measured yet
    gen.engine.steps, gen._finished, gen._c0 = 100, 20, 0.034
    gen.engine.totals.update(step_s=0.5 + 0.2, prefill_s=0.2)  # 5 ms per decode step
    assert gen.engine.fuse and gen.group(64) == 1  # pieces ride in the verify: no c0 to share
    gen.engine.fuse = False  # (as where verifies replay CUDA graphs)
    assert gen.group(64) == round((2 * 0.2 * 64 * 0.034 / 0.005) ** 0.5)  # 13
    gen._c0 = 0.5  # dear prefills: capped at a quarter of the batch
    assert gen.group(64) == 16
    gen._c0 = 0.0001  # a CPU-like case: a forward's fixed cost far below a step's
    assert gen.group(64) == 1
    assert gen.group(4) == 1  # a small batch never waits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculating_replies_are_the_plain_ones_in_fewer_steps(tiny_target, prompts, temperature):
    """``ReplySettings.speculate`` (the default): the engine drafts with the context n-gram
    drafter; greedy replies are the same tokens and seeded sampled ones the same draws, while a
    row's step makes more than one token where the drafts were accepted (the tiny random
    model's replies loop, so prompt lookup finds them)."""
    out, stats = {}, {}
    for speculate in (False, True):
        s = ReplySettings(
            40,
            tuple(tiny_target.eos_token_ids),
            temperature=temperature,
            seed=5,
            batch_size=1,
            speculate=speculate,
        )
        gen = EngineReplies(tiny_target, s)
        assert bool(gen.decoder.drafters) == speculate
        out[speculate] = run_all(gen, prompts)
        stats[speculate] = gen.stats()
    assert out[True] == out[False]
    assert stats[False]["tokens_per_row_step"] == 1.0
    if temperature == 0:
        assert stats[True]["tokens_per_row_step"] > 1.2
        assert stats[True]["row_steps"] < stats[False]["row_steps"]

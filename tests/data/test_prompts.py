"""Benchmark prompts: held-out conversations cut before the first reply; HumanEval."""

from data_helpers import sharegpt, write_jsonl

from redraft.data import heldout_prompts, humaneval_prompts, is_heldout


def test_heldout_prompts_are_heldout_and_end_before_the_first_reply(tmp_path):
    chats = [
        sharegpt(
            i,
            [
                ("system", f"sys {i}"),
                ("human", f"question {i}"),
                ("gpt", f"answer {i}"),
                ("human", "more"),
                ("gpt", "done"),
            ],
        )
        for i in range(200)
    ]
    spec = f"sharegpt:{write_jsonl(tmp_path / 'c.jsonl', chats)}"
    held = [i for i in range(200) if is_heldout(f"sg-{i}", 0.1)]
    prompts = heldout_prompts(spec, n=5, heldout_fraction=0.1)
    assert len(prompts) == 5
    for p in prompts:
        assert [m["role"] for m in p] == ["system", "user"]
        i = int(p[1]["content"].split()[-1])
        assert i in held and p[0]["content"] == f"sys {i}"
    assert prompts == heldout_prompts(spec, n=5, heldout_fraction=0.1)  # deterministic
    assert prompts != heldout_prompts(spec, n=5, heldout_fraction=0.1, seed=1)
    assert len(heldout_prompts(spec, n=10_000, heldout_fraction=0.1)) == len(
        held
    )  # all of them, in order


def test_default_heldout_prompts_come_from_sharegpt():
    prompts = heldout_prompts(n=3)
    assert len(prompts) == 3
    assert all(
        p[-1]["role"] == "user" and all(m["role"] != "assistant" for m in p) for p in prompts
    )


def test_humaneval_prompts_from_the_package():
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert humaneval_prompts(3) == prompts[:3]
    assert "def has_close_elements(" in prompts[0] and prompts[0].rstrip().endswith('"""')

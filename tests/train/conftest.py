"""Fixtures of the trainer tests: a learnable ShareGPT-format chat file for the tiny target."""

import json
import random

import pytest


def write_counting_chats(path, n: int = 300, seed: int = 0):
    """ShareGPT JSONL whose assistant replies count words in a cycle: a head can learn them."""
    words = "zero one two three four five six seven eight nine ten".split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            s, k = rng.randrange(len(words)), rng.randint(4, 10)
            reply = " ".join(words[(s + j) % len(words)] for j in range(k))
            conv = [
                {"from": "human", "value": f"count from {words[s]}"},
                {"from": "gpt", "value": reply},
            ]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    return path


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    return write_counting_chats(tmp_path_factory.mktemp("chats") / "chat.jsonl")


@pytest.fixture(scope="session")
def tiny_data(tiny_target, chat_file, tmp_path_factory):
    """(train, heldout) token datasets of chat_file for the tiny target, through redraft.data."""
    from redraft.data import build_token_dataset

    cache = tmp_path_factory.mktemp("data-cache")
    kw = dict(max_length=128, num_proc=1, cache_dir=cache, progress=False)
    spec = f"sharegpt:{chat_file}"
    return (
        build_token_dataset(spec, tiny_target.tokenizer, split="train", **kw),
        build_token_dataset(spec, tiny_target.tokenizer, split="heldout", **kw),
    )


@pytest.fixture(scope="session")
def other_target(tmp_path_factory):
    """A second tiny target: the same tokenizer (same fingerprint), other weights (seed 1)."""
    from redraft.models import load_target
    from redraft.testing import make_tiny_target_dir

    return load_target(
        str(make_tiny_target_dir(tmp_path_factory.mktemp("tiny-other"), seed=1)),
        dtype="float32",
        device="cpu",
    )

"""Helpers for the data tests: write small source files in every format."""

import gzip
import json


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2))
    return path


def write_jsonl(path, objs, gz=False):
    text = "".join(json.dumps(o) + "\n" for o in objs)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def write_parquet(path, objs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(objs), path)
    return path


def sharegpt(i, turns):
    """A ShareGPT record ``sg-i`` from (from, value) pairs."""
    return {"id": f"sg-{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


# Conversations with an assistant reply in every shape the mask must handle.
CHATS = [
    sharegpt(0, [("human", "Hello there"), ("gpt", "Hi! How can I help you today?")]),
    sharegpt(
        1,
        [
            ("system", "You are terse."),
            ("human", "What is 2+2?"),
            ("gpt", "4."),
            ("human", "And 3+3?"),
            ("gpt", "6, as before."),
        ],
    ),
    sharegpt(
        2,
        [
            ("user", "def add(a, b):"),
            ("chatgpt", "    return a + b\n"),
            ("human", "thanks"),
            ("bard", "You're welcome!"),
        ],
    ),
    sharegpt(
        3,
        [
            ("human", "Tell me about Paris."),
            ("assistant", "Paris is the capital of France.\n\nIt is big."),
        ],
    ),
]

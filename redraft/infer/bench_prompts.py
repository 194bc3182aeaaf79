"""``redraft-bench``'s prompts: the built-in datasets, MT-Bench and JSONL files, tokenised and
checked against the target's context (a prompt too long for it is skipped with a note)."""

from __future__ import annotations

import json
from pathlib import Path

from redraft.errors import DataError

MT_BENCH_HINT = (
    "MT-Bench's questions are FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl (80 lines); "
    "download it and pass --datasets mt-bench:PATH."
)


def load_prompts(dataset: str, n: int, chat_spec: str = "default-chat") -> list:
    """Prompts of a dataset: "chat" (held-out ShareGPT, chat messages), "code" (HumanEval, plain
    text to complete), "mt-bench:PATH" (the first turns of MT-Bench's ``question.jsonl``) or a
    JSONL file (lines with "messages", "prompt" or "text")."""
    if dataset == "chat":
        from redraft.data.prompts import heldout_prompts

        return heldout_prompts(chat_spec, n=n)
    if dataset == "code":
        from redraft.data.prompts import humaneval_prompts

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


def dataset_label(ds: str) -> str:
    """The name a dataset's results are filed under: chat, code, mt-bench or the file's stem."""
    if ds in ("chat", "code"):
        return ds
    if ds.startswith("mt-bench"):
        return "mt-bench"
    return Path(ds).stem


def fit_context(
    prompts: list[list[int]], context: int | None, max_new_tokens: int, dataset: str
) -> tuple[list, list]:
    """``(kept token lists, skipped)``: a prompt whose tokens plus ``max_new_tokens`` exceed the
    target's ``context`` is skipped (``{"prompt": index, "tokens": n}``) instead of aborting the
    run; a DataError when none is left."""
    if not context:
        return prompts, []
    kept, skipped = [], []
    for i, ids in enumerate(prompts):
        if len(ids) + max_new_tokens > context:
            skipped.append({"prompt": i, "tokens": len(ids)})
        else:
            kept.append(ids)
    if not kept:
        raise DataError(
            f"dataset {dataset!r}: every prompt ({len(prompts)}) is longer than the target's context of "
            f"{context} tokens less --max-new-tokens {max_new_tokens}; lower --max-new-tokens or use "
            f"a target with a longer context."
        )
    return kept, skipped

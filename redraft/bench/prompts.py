"""``redraft-bench``'s prompts, once loaded (:func:`redraft.data.prompts.load_prompts`): the name
a dataset's results are filed under, and the tokenised prompts checked against the target's
context (a prompt too long for it is skipped with a note)."""

from __future__ import annotations

from pathlib import Path

from redraft.errors import DataError


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

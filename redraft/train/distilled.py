"""Self-distilled training data: the target's own replies, made once and reused by every run.

A head learns the next tokens of its data; it is accepted when those are the *target's* next
tokens. ``self_distill: true`` (the shipped recipes) trains and evaluates on the target's greedy
replies to the prompts of ``--data`` instead of the data's own replies (which another model
wrote). :func:`distilled_data` makes them with :func:`redraft.data.distill.distill` (batched,
resumable: an interrupted run continues where it stopped) the first time and reuses them after.
The replies come from redraft's engine when the command runs under ``redraft.entry`` (the
``redraft-train`` and ``redraft-cache-features`` console scripts, ``redraft-demo``), else from
Hugging Face ``generate``; the cache does not record which (greedy replies are the same in
float32; in bfloat16 rounding flips near-ties with the batch shape, whichever generator)::

    <distill_dir>/train.jsonl      the train split of --data, at most distill_limit conversations
    <distill_dir>/heldout.jsonl    its held-out split, at most eval_limit (unless --eval-data is set)
    <distill_dir>/*.done.json      written when a file is complete: later runs generate nothing
    <distill_dir>/train.first-N.jsonl   a run asking for N conversations of a file made for more:
                                   the replies to the first N source conversations, so a run's
                                   records follow its settings, not what the cache holds

``distill_dir`` defaults to ``<redraft cache>/distilled/<target>-<hash>``, the hash over the
target's tokenizer and weights fingerprints and every setting that changes the replies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from redraft.train.config import TrainConfig

DONE_SUFFIX = ".done.json"


def distill_settings(cfg: TrainConfig, record: dict) -> dict:
    """Everything that decides the distilled replies (the cache key)."""
    return {
        "data": cfg.data,
        "heldout_fraction": cfg.heldout_fraction,
        "max_new_tokens": cfg.distill_max_new_tokens,
        "max_turns": cfg.distill_max_turns,
        "max_prompt_tokens": min(cfg.max_length, cfg.distill_max_prompt_tokens),
        "temperature": 0.0,
        "tokenizer_fingerprint": record.get("tokenizer_fingerprint"),
        "weights_fingerprint": record.get("weights_fingerprint"),
    }


def distill_dir(cfg: TrainConfig, record: dict) -> Path:
    """``cfg.distill_dir``, or the cache folder keyed by :func:`distill_settings`."""
    if cfg.distill_dir:
        return Path(cfg.distill_dir).expanduser()
    from redraft.models.target import CACHE_ROOT

    key = hashlib.sha256(
        json.dumps(distill_settings(cfg, record), sort_keys=True).encode()
    ).hexdigest()[:12]
    name = cfg.resolved_run_name().removeprefix("redrafter-")
    return CACHE_ROOT / "distilled" / f"{name}-{key}"


def _asked(path: Path, settings: dict) -> tuple[bool, int | None]:
    """``(finished, limit)``: ``path`` was finished with these settings for ``limit``
    conversations (None: all of them)."""
    done = path.with_name(path.name + DONE_SUFFIX)
    if not (done.is_file() and path.is_file()):
        return False, None
    try:
        meta = json.loads(done.read_text())
    except (OSError, json.JSONDecodeError):
        return False, None
    return meta.get("settings") == settings, meta.get("limit")


def _complete(path: Path, settings: dict, limit: int | None) -> bool:
    """``path`` was finished with these settings and at least ``limit`` conversations asked for."""
    finished, asked = _asked(path, settings)
    return finished and (asked is None or (limit is not None and asked >= limit))


def _view(path: Path, settings: dict, limit: int | None) -> Path:
    """The file a run with ``limit`` reads: ``path``, or ``<stem>.first-<limit>.jsonl`` when
    ``path`` was finished for more conversations (an earlier run asked for more)."""
    finished, asked = _asked(path, settings)
    if finished and limit is not None and (asked is None or asked > limit):
        return path.with_name(f"{path.stem}.first-{limit}{path.suffix}")
    return path


def _write_first(path: Path, view: Path, cfg: TrainConfig, split: str, limit: int) -> None:
    """``view``: the lines of ``path`` that answer the first ``limit`` source conversations of
    ``split``: the records a run with this limit alone makes, whatever else the cache holds
    (reading the source's ids costs well under a second; the file is rewritten only if it changed)."""
    from redraft.data.distill import first_ids
    from redraft.utils import atomic_write_text

    keep = first_ids(cfg.data, split, cfg.heldout_fraction, limit)
    with open(path, encoding="utf-8") as f:
        text = "".join(line for line in f if json.loads(line).get("id") in keep)
    if not (view.is_file() and view.read_text(encoding="utf-8") == text):
        atomic_write_text(view, text)


def ensure_split(
    target, cfg: TrainConfig, path: Path, split: str, limit: int | None, settings: dict, say
) -> None:
    """Make (or finish) ``path``: the target's replies to ``split`` of ``cfg.data`` (and its
    first-``limit`` view when it was made for more: :func:`_view`)."""
    from redraft.data.distill import distill

    if _complete(path, settings, limit):
        view = _view(path, settings, limit)
        if view != path:
            _write_first(path, view, cfg, split, limit)
            say(
                f"redraft-train: self-distilled {split} data found in {path} (made for "
                f"{_asked(path, settings)[1] or 'all'} conversations; the first {limit}: {view.name})"
            )
        else:
            say(f"redraft-train: self-distilled {split} data found in {path}")
        return
    say(
        f"redraft-train: self-distilling the {split} split of {cfg.data} ({limit or 'all'} conversations, "
        f"{cfg.distill_max_new_tokens} new tokens per reply) into {path}; resumable"
    )
    t0 = time.perf_counter()
    res = distill(
        target,
        cfg.data,
        path,
        max_new_tokens=cfg.distill_max_new_tokens,
        batch_size=cfg.distill_batch_size,
        limit=limit,
        split=split,
        heldout_fraction=cfg.heldout_fraction,
        max_prompt_tokens=settings["max_prompt_tokens"],
        seed=cfg.seed,
        max_turns=cfg.distill_max_turns,
    )
    dt = time.perf_counter() - t0
    say(
        f"redraft-train: {res.get('written', 0)} conversations, {res.get('new_tokens', 0)} new tokens in "
        f"{dt:.0f} s ({res.get('new_tokens', 0) / max(dt, 1e-9):.0f} tokens/s, {res['generator']})"
    )
    if "engine" in res:
        say(f"redraft-train: engine {res['engine']}")
    path.with_name(path.name + DONE_SUFFIX).write_text(
        json.dumps(
            {
                "settings": settings,
                "limit": limit,
                "result": {k: v for k, v in res.items() if k != "source"},
            },
            indent=1,
        )
    )


def distilled_data(cfg: TrainConfig, target, record: dict, env, train: bool = True) -> TrainConfig:
    """``cfg`` with ``data`` (and ``eval_data`` unless set) pointing at the self-distilled files,
    made on rank 0 when missing (the other ranks wait; ``train=False``: only the held-out file).
    ``cfg`` itself when not ``self_distill``."""
    if not cfg.self_distill:
        return cfg
    out = distill_dir(cfg, record)
    settings = distill_settings(cfg, record)
    train_file, held_file = out / "train.jsonl", out / "heldout.jsonl"
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if train:
            ensure_split(target, cfg, train_file, "train", cfg.distill_limit, settings, env.say)
        if not cfg.eval_data:
            ensure_split(target, cfg, held_file, "heldout", cfg.eval_limit, settings, env.say)
    env.barrier()
    train_file = _view(train_file, settings, cfg.distill_limit)  # rank 0 wrote the views
    held_file = _view(held_file, settings, cfg.eval_limit)
    return dataclasses.replace(
        cfg, data=f"sharegpt:{train_file}", eval_data=cfg.eval_data or f"sharegpt:{held_file}"
    )

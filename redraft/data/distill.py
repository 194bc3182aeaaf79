"""Self-distillation: regenerate every assistant turn of a chat dataset with the target.

A drafter is accepted most often when it learned the *target's* replies, not another model's.
``redraft-distill-data`` keeps each conversation's system and user turns, and replaces each
assistant turn with the target's own reply to the conversation so far (its earlier replies
included), in batches (left-padded ``model.generate``), greedy or sampled. The output is
ShareGPT-format JSONL, readable by every CLI as ``--data sharegpt:FILE.jsonl``::

    redraft-distill-data --target default --data default-chat --output checkpoints/distilled.jsonl \\
        --max-new-tokens 256 --batch-size 8 --limit 2000

Records are appended (and flushed) as soon as their conversation is done; running the same
command again skips every id already in the file, so an interrupted run resumes where it stopped.

Every argument, the output path, the data spec (it must hold conversations) and the device are
checked before the model loads; an error is one line on stderr and exit status 2, Ctrl-C exit
status 130. This module imports no torch at import time (``--help`` is instant).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from redraft.cli import ModelSettings
from redraft.data.records import DataStats, Record, is_heldout, record_to_sharegpt
from redraft.data.sources import iter_records, parse_spec
from redraft.errors import ConfigError, DataError, RedraftError
from redraft.utils import ArgumentParser, HelpFormatter

PROG = "redraft-distill-data"
# Sources whose records are documents (code files), never conversations.
DOCUMENT_KINDS = ("default-code", "code-dir", "stack")

logger = logging.getLogger(__name__)


def read_done_ids(path: Path) -> set[str]:
    """Ids already written to ``path``. A last line cut by a crash is removed from the file."""
    done: set[str] = set()
    if not path.exists():
        return done
    good_end = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # cut mid-write: drop it below
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(
                    f"{path} line {lineno} is not JSON ({exc}); it is not an output of "
                    f"{PROG}. Pass a new --output file."
                ) from exc
            if not isinstance(obj, dict) or "id" not in obj:
                raise DataError(
                    f"{path} line {lineno} is a JSON value without an 'id'; it is not an "
                    f"output of {PROG}. Pass a new --output file."
                )
            done.add(str(obj["id"]))
            good_end += len(line)
    if good_end < path.stat().st_size:
        logger.warning(
            "%s ends with an incomplete line (an interrupted run); removing it and resuming", path
        )
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def generate_replies(
    target, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float
) -> list[tuple[list[int], bool]]:
    """One batched ``generate`` over left-padded prompts.

    Returns, per prompt, the new token ids up to (not including) the first end-of-sequence token,
    and whether it stopped by itself (False: it ran into ``max_new_tokens``).
    """
    import torch

    tok, model = target.tokenizer, target.model
    eos = target.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    # [B, width]: left padding so every prompt's last token sits in the last column
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    sample = temperature > 0
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(target.device),
            attention_mask=attention.to(target.device),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=0 if sample else None,  # no hidden top-k cut
            pad_token_id=pad,
            eos_token_id=eos,
        )
    new = out[:, width:].cpu()  # [B, <= max_new_tokens]
    is_eos = torch.isin(new, torch.tensor(eos))
    has_eos = is_eos.any(dim=1)
    # first eos position per row (the row length when there is none), vectorised
    stop = torch.where(
        has_eos,
        is_eos.int().argmax(dim=1),
        torch.full_like(has_eos, new.shape[1], dtype=torch.long),
    )
    return [(new[i, : int(stop[i])].tolist(), bool(has_eos[i])) for i in range(len(prompts))]


def distill_batch(
    target,
    records: list[Record],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    max_prompt_tokens: int,
    counts: dict,
    max_turns: int | None = None,
) -> list[Record]:
    """Regenerate the assistant turns of a batch of conversations, turn by turn.

    At step ``t`` every conversation that has a ``t``-th user turn (and is still going) gets one
    reply in the same ``generate`` call. A conversation ends early when its prompt would exceed
    ``max_prompt_tokens``, its reply is empty, or its reply ran into ``max_new_tokens``; with
    ``max_turns`` only its first ``max_turns`` user turns get replies.
    Conversations with no reply at all are not returned.
    """
    tok = target.tokenizer
    convs = []
    for r in records:
        head = [dict(m) for m in r.messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in r.messages if m["role"] == "user"][:max_turns]
        convs.append({"record": r, "messages": head, "users": users, "open": True})
    for t in range(max((len(c["users"]) for c in convs), default=0)):
        active, prompts = [], []
        for c in convs:
            if not c["open"] or t >= len(c["users"]):
                continue
            ids = _prompt_ids(tok, c["messages"] + [{"role": "user", "content": c["users"][t]}])
            if len(ids) > max_prompt_tokens:
                c["open"] = False
                counts["prompt_too_long"] += 1
                continue
            active.append(c)
            prompts.append(ids)
        if not active:
            break
        for c, (reply, stopped) in zip(
            active,
            generate_replies(
                target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p
            ),
        ):
            counts["new_tokens"] += len(reply)
            text = tok.decode(reply, skip_special_tokens=True)
            if not text.strip():
                c["open"] = False
                counts["empty_reply"] += 1
                continue
            c["messages"] += [
                {"role": "user", "content": c["users"][t]},
                {"role": "assistant", "content": text},
            ]
            if not stopped:
                c["open"] = False
                counts["hit_max_new_tokens"] += 1
    out = []
    for c in convs:
        if any(m["role"] == "assistant" for m in c["messages"]):
            out.append(
                Record(
                    id=c["record"].id,
                    kind="chat",
                    messages=c["messages"],
                    source=c["record"].source,
                )
            )
        else:
            counts["no_reply"] += 1
    return out


def _length_sorted_batches(records, batch_size: int, window: int):
    """Batches of ``batch_size`` from windows of ``window`` batches sorted by prompt length
    (characters of the user turns), so that a batch pads little; output order follows the batches."""
    while True:
        pool = [r for _, r in zip(range(batch_size * max(window, 1)), records)]
        if not pool:
            return
        if window > 1:
            pool.sort(
                key=lambda r: sum(len(m["content"]) for m in r.messages if m["role"] != "assistant")
            )
        for i in range(0, len(pool), batch_size):
            yield pool[i : i + batch_size]


def distill(
    target,
    spec: str,
    output,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    limit: int | None = None,
    split: str = "all",
    heldout_fraction: float = 0.02,
    max_prompt_tokens: int = 2048,
    seed: int = 0,
    sort_window: int = 8,
    progress: bool = True,
    max_turns: int | None = None,
) -> dict:
    """Write the target's own replies for the chats of ``spec`` to ``output`` (ShareGPT JSONL).

    Args:
        target: a :class:`redraft.models.Target`.
        spec: a chat data spec, e.g. ``"default-chat"``.
        output: the JSONL file; created, or appended to (ids already in it are skipped).
        max_new_tokens: longest reply; a reply that hits it ends its conversation.
        batch_size: conversations generated together.
        temperature: 0 = greedy; otherwise sampling with ``top_p``.
        limit: at most this many source conversations (counting those already done).
        split: ``"all"``, ``"train"`` or ``"heldout"`` records of the source.
        max_prompt_tokens: a conversation ends before a turn whose prompt is longer.
        seed: torch seed for sampling.
        sort_window: batches read ahead and sorted by prompt length (less padding); 1 keeps the
            source order.
        progress: show a progress bar (conversations, and new tokens per second).
        max_turns: reply to at most this many user turns per conversation (None: all).

    Returns:
        Counts: written, skipped_done, new_tokens, seconds and why conversations ended early.
    """
    from collections import Counter

    import torch
    from tqdm.auto import tqdm

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    existed = output.exists()
    done = read_done_ids(output)
    torch.manual_seed(seed)
    stats = DataStats()
    counts: Counter = Counter()
    records = iter_records(spec, stats=stats)
    bar = tqdm(
        total=limit, desc="distilling", unit=" conv", disable=not progress, dynamic_ncols=True
    )
    t0 = time.perf_counter()
    seen = 0

    def todo():
        nonlocal seen
        for r in records:
            if r.kind != "chat":
                counts["not_a_conversation"] += 1
                continue
            counts["conversations_read"] += 1
            if split != "all" and is_heldout(r.id, heldout_fraction) != (split == "heldout"):
                continue
            if limit is not None and seen >= limit:
                return
            seen += 1
            if r.id in done:
                counts["skipped_done"] += 1
                bar.update(1)
                continue
            yield r

    made_with = {
        "target": target.model_id,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "max_turns": max_turns,
    }
    with open(output, "a", encoding="utf-8") as f:
        for batch in _length_sorted_batches(todo(), batch_size, sort_window):
            for r in distill_batch(
                target,
                batch,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                max_prompt_tokens=max_prompt_tokens,
                counts=counts,
                max_turns=max_turns,
            ):
                _write_reply(f, r, made_with)
                done.add(r.id)
                counts["written"] += 1
            bar.update(len(batch))
            rate = counts["new_tokens"] / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{rate:,.1f} tok/s", refresh=False)
    bar.close()
    if not counts["conversations_read"]:
        _no_conversation(spec, output, existed, counts, stats)
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    result = dict(counts)
    result["source"] = stats.summary()
    return result


def _write_reply(f, r, made_with: dict) -> None:
    """One distilled conversation as a ShareGPT JSONL line, flushed (a stopped run keeps it)."""
    obj = record_to_sharegpt(r)
    obj["source"] = r.source
    obj["distilled_with"] = made_with
    f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    f.flush()


def _no_conversation(spec: str, output: Path, existed: bool, counts, stats) -> None:
    """The source held no chat: leave no empty file behind and say what to pass."""
    if not existed and output.stat().st_size == 0:
        output.unlink()
    raise DataError(
        f"data spec {spec!r} holds no conversation to distill "
        f"({counts['not_a_conversation']} document records; source: {stats.summary()}): "
        f"distillation regenerates the assistant turns of chats. Pass a chat source "
        f"(default-chat, sharegpt:PATH, ultrachat:PATH_OR_ID)."
    )


MODEL_FLAGS = (
    "target",
    "dtype",
    "device",
)  # the shared model flags it takes (redraft.cli.ModelSettings)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Regenerate every assistant turn of a chat dataset with the target model and write "
        "ShareGPT JSONL (resumable: ids already in --output are skipped).",
        formatter_class=HelpFormatter,
    )
    ModelSettings.add_arguments(p, only=MODEL_FLAGS)
    p.add_argument(
        "--data",
        default="default-chat",
        help="chat data spec, e.g. default-chat, "
        "sharegpt:FILE.jsonl, ultrachat:HuggingFaceH4/ultrachat_200k?split=train_sft",
    )
    p.add_argument("--output", required=True, help="output JSONL file; appended to when it exists")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="longest reply in tokens (at least 1)"
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="reply to at most this many user turns per conversation (at least 1; default: all)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="conversations generated together (at least 1)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy, else the sampling temperature (a finite number >= 0)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling threshold when sampling, in (0, 1]",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="at most this many source conversations, done ones "
        "included (at least 1; default: all)",
    )
    p.add_argument(
        "--split",
        choices=["all", "train", "heldout"],
        default="all",
        help="which split of the source to distill",
    )
    p.add_argument(
        "--heldout-fraction", type=float, default=0.02, help="held-out share for --split, in (0, 1)"
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=2048,
        help="end a conversation before a turn whose prompt is longer",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; on a "
        "CPU shared with other jobs 1 thread can be several times faster)",
    )
    p.add_argument(
        "--sort-window",
        type=int,
        default=8,
        help="read this many batches ahead and sort them by "
        "prompt length to pad less; 1 keeps the source order",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar",
    )
    return p


def check_args(args) -> None:
    """Every check that needs no model, so that a mistake costs no model load.

    Raises:
        ConfigError: naming the flag, its value and the valid range.
        DataError: a data spec that does not parse or names only document sources.
    """
    ModelSettings.from_args(args)  # the shared model flags: typed, checked, defaults set on args

    def bad(name: str, rule: str):
        value = getattr(args, name)
        return ConfigError(
            f"--{name.replace('_', '-')} {value} is out of range: {rule}.", param=name
        )

    if args.threads is not None and args.threads < 1:
        raise bad("threads", "it must be at least 1 (leave it out for torch's choice)")
    for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "sort_window"):
        if getattr(args, name) < 1:
            raise bad(name, "it must be at least 1")
    if args.max_turns is not None and args.max_turns < 1:
        raise bad("max_turns", "it must be at least 1 (leave it out to reply to every turn)")
    if args.limit is not None and args.limit < 1:
        raise bad("limit", "it must be at least 1 (leave it out to distill every conversation)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise bad("temperature", "it must be a finite number >= 0 (0 = greedy)")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise bad("top_p", "it must be in (0, 1]")
    if not (math.isfinite(args.heldout_fraction) and 0 < args.heldout_fraction < 1):
        raise bad("heldout_fraction", "it must be in (0, 1)")
    components = parse_spec(args.data)  # DataError naming the spec
    if all(c.kind in DOCUMENT_KINDS for c in components):
        raise ConfigError(
            f"--data {args.data!r} holds documents (code files), not conversations: "
            f"distillation regenerates the assistant turns of chats. Pass a chat source "
            f"(default-chat, sharegpt:PATH, ultrachat:PATH_OR_ID).",
            param="data",
        )
    out = Path(args.output).expanduser()
    if out.is_dir():
        raise ConfigError(
            f"--output {out} is a directory; pass a .jsonl file path (created, or "
            f"appended to when it exists).",
            param="output",
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--output {out}: its folder cannot be created ({exc.strerror or exc}).", param="output"
        ) from exc
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise ConfigError(
            f"--output {out} is not writable; pass a file you can write.", param="output"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
        from redraft.models import load_target
        from redraft.utils import resolve_device, resolve_dtype

        device = resolve_device(args.device)  # "cuda" without CUDA: one line, before the load
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        dtype = resolve_dtype(args.dtype, device) if args.dtype is not None else None
        target = load_target(args.target, dtype=dtype, device=device)
        result = distill(
            target,
            args.data,
            args.output,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            temperature=args.temperature,
            top_p=args.top_p,
            limit=args.limit,
            split=args.split,
            heldout_fraction=args.heldout_fraction,
            max_prompt_tokens=args.max_prompt_tokens,
            seed=args.seed,
            sort_window=args.sort_window,
            progress=args.progress,
            max_turns=args.max_turns,
        )
    except RedraftError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted; the conversations written so far are kept (run the same "
            f"command again to resume).",
            file=sys.stderr,
        )
        return 130
    print(
        f"wrote {result.get('written', 0)} conversations to {args.output} "
        f"({result.get('skipped_done', 0)} already there; {result.get('new_tokens', 0)} new tokens in "
        f"{result['seconds']} s); source: {result['source']}",
        file=sys.stderr,
    )
    ended = {
        k: v
        for k, v in result.items()
        if k
        in (
            "prompt_too_long",
            "empty_reply",
            "hit_max_new_tokens",
            "no_reply",
            "not_a_conversation",
        )
    }
    if ended:
        print(f"ended early or skipped: {ended}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

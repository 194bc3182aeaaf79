"""Training-throughput benchmark: baseline and candidates measured in the same run.

    python -m redraft.bench.train                       # default target, default ShareGPT, CPU
    python -m redraft.bench.train --records 8 --repeats 2 --draft-vocab 0 16384 --json out.json
    python -m redraft.bench.train --features --precision amp-bf16 --draft-vocab 0 8192 --loss ce ce+kd
    python -m redraft.bench.train --loss-impl dense fused --precision amp-bf16   # the fused loss vs the reference

For each setting it times, over the same records, (a) the frozen target's forward that makes
the hidden states and (b) one full training micro step (target forward + drafter forward over
all positions x n steps + backward + AdamW). With ``--features`` the records are first cached
(``redraft-cache-features``: hidden states + top-8 logits) and (c) the same micro steps are
timed reading the cache instead of running the target; the cache's disk bytes per token are
reported. Tokens/s count every token of the records (the target processes all of them); ratios
are against the first row of each kind (fp32 / full vocabulary / first loss implementation /
online).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from redraft.errors import RedraftError


def _time(fn, repeats: int, warmup=None) -> float:
    (warmup or fn)()  # warm-up (one-time kernel selection, allocator)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cache_features(
    out: dict,
    tmp: str,
    target,
    target_spec: str,
    data: str,
    ds,
    groups,
    precision: str,
    max_length: int,
    records: int,
    device,
    report,
) -> list:
    """Time caching the target's features (a row of ``out``); the cached records' batches."""
    from redraft.train.config import make_config
    from redraft.train.features import FeatureRecords, cache_features, disk_bytes

    n_tokens = out["tokens"]
    cfg = make_config(
        None,
        {
            "target": target_spec,
            "data": data,
            "max_length": max_length,
            "train_limit": records,
            "precision": precision,
        },
    )
    t0 = time.perf_counter()
    meta = cache_features(cfg, tmp, target=target, dataset=ds, progress=False)
    t = time.perf_counter() - t0
    out["features_bytes_per_token"] = disk_bytes(tmp) / n_tokens
    out["features_top_k"] = meta["top_k"]
    out["rows"].append(
        {
            "what": "cache features",
            "precision": precision,
            "draft_vocab": None,
            "loss": None,
            "impl": None,
            "source": "target",
            "seconds": t,
            "tokens_per_s": n_tokens / t,
        }
    )
    if report:
        report(out["rows"][-1])
    cached = FeatureRecords(tmp, load_topk=True)
    return [cached.batch(g, device) for g in groups]


def _add_row(out: dict, report, row: dict) -> None:
    """A measured row into ``out``, passed to ``report`` as it comes."""
    out["rows"].append(row)
    if report:
        report(out["rows"][-1])


def run(
    target_spec: str,
    data: str,
    records: int,
    max_length: int,
    repeats: int,
    vocab_sizes: list[int],
    precisions: list[str],
    micro_batch: int,
    report=None,
    losses=("ce",),
    features: bool = False,
    impls=("fused",),
) -> dict:
    """Every setting timed on the same records: the rows, each with its speedup over the first."""
    import tempfile

    from redraft.data import build_token_dataset
    from redraft.models import load_target
    from redraft.train.batches import TokenRecords
    from redraft.train.config import make_config

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(
        target_spec, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device
    )
    ds = build_token_dataset(
        data, target.tokenizer, split="train", max_length=max_length, limit=records
    )
    groups = [list(range(i, min(i + micro_batch, len(ds)))) for i in range(0, len(ds), micro_batch)]
    online = TokenRecords(ds)
    batches = {"online": [online.batch(g, device) for g in groups]}
    out = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "records": len(ds),
        "tokens": int(online.lengths.sum()),
        "max_length": max_length,
        "micro_batch": micro_batch,
        "target": target.model_id,
        "rows": [],
    }
    tmp = tempfile.TemporaryDirectory(prefix="redraft-bench-features-")
    if features:
        batches["features"] = _cache_features(
            out,
            tmp.name,
            target,
            target_spec,
            data,
            ds,
            groups,
            precisions[-1],
            max_length,
            records,
            device,
            report,
        )
    _time_target_forward(out, target, batches["online"], precisions, repeats, report)
    settings = [
        (v, ln, p, i) for v in vocab_sizes for ln in losses for p in precisions for i in impls
    ]
    for setting in settings:
        cfg = make_config(None, {"max_length": max_length, "loss": setting[1]})
        for source, bs in batches.items():
            _time_train_step(out, target, ds, device, cfg, setting, source, bs, repeats, report)
    tmp.cleanup()
    base = {r["what"]: r["tokens_per_s"] for r in reversed(out["rows"])}  # first row of each kind
    for r in out["rows"]:
        r["speedup"] = r["tokens_per_s"] / base[r["what"]]
    return out


def _time_target_forward(out: dict, target, online: list, precisions, repeats: int, report):
    """The frozen target's forward over the records, a row per precision."""
    from redraft.train.step import target_hidden

    n_tokens = out["tokens"]

    def fwd(precision, bs=online):
        for b in bs:
            target_hidden(target, b.ids, precision)

    for precision in precisions:
        t = _time(lambda: fwd(precision), repeats, warmup=lambda: fwd(precision, online[:1]))
        _add_row(
            out,
            report,
            {
                "what": "target forward",
                "precision": precision,
                "draft_vocab": None,
                "loss": None,
                "impl": None,
                "source": "target",
                "seconds": t,
                "tokens_per_s": n_tokens / t,
            },
        )


def _fresh_drafter(target, ds, device, vocab: int):
    """A freshly seeded drafter on ``target`` (its draft vocabulary from the data when ``vocab``)."""
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig
    from redraft.train.batches import draft_vocab_from_data

    torch.manual_seed(0)
    dcfg = ReDrafterConfig.for_target(target, draft_vocab_size=vocab or None)
    model = ReDrafter(dcfg).to(device)
    if vocab:
        model.set_draft_vocab(draft_vocab_from_data(ds, dcfg.vocab_size, vocab))
    return model


def _time_train_step(out, target, ds, device, cfg, setting, source, bs, repeats, report) -> None:
    """Full training micro steps (forward, backward, AdamW) of one setting on one source, a row."""
    from redraft.train.precision import target_dtype
    from redraft.train.step import batch_loss

    vocab, loss_name, precision, impl = setting
    model = _fresh_drafter(target, ds, device, vocab)
    model.attach_target(target).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hidden_dtype = target_dtype(precision, device)

    def step(bs=bs):
        for b in bs:
            loss, *_ = batch_loss(model, model, target, b, cfg, precision, hidden_dtype, impl)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    t = _time(step, repeats, warmup=lambda: step(bs[:1]))
    _add_row(
        out,
        report,
        {
            "what": "train step",
            "precision": precision,
            "draft_vocab": vocab or "full",
            "loss": loss_name,
            "impl": impl,
            "source": source,
            "seconds": t,
            "tokens_per_s": out["tokens"] / t,
        },
    )


def _parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(
        prog="python -m redraft.bench.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="default", help="Target model spec.")
    p.add_argument(
        "--data", default="default-chat", help="Data spec (records from its train split)."
    )
    p.add_argument("--records", type=int, default=8, help="Records timed per setting.")
    p.add_argument(
        "--max-length", type=int, default=1024, help="Truncate records to this many tokens."
    )
    p.add_argument("--micro-batch", type=int, default=1, help="Sequences per micro batch.")
    p.add_argument(
        "--repeats", type=int, default=2, help="Timed repeats (best is reported) after a warm-up."
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        nargs="+",
        default=[0, 16384],
        help="Draft vocabulary sizes to compare (0 = full).",
    )
    p.add_argument(
        "--precision", nargs="+", default=["fp32", "amp-bf16"], help="Precisions to compare."
    )
    p.add_argument("--loss", nargs="+", default=["ce"], help="Losses to compare (ce, kd, ce+kd).")
    p.add_argument(
        "--loss-impl",
        nargs="+",
        default=["dense", "fused"],
        choices=["dense", "fused", "liger"],
        help="Loss implementations to compare (redraft-train --loss-impl).",
    )
    p.add_argument(
        "--features",
        action="store_true",
        help="Also cache the records' features and time training steps that read them.",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)."
    )
    p.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    return p


def _print_measured(r: dict) -> None:
    """One row as it is measured."""
    print(
        f"  measured: {r['what']} {r['source']} {r['precision']} "
        f"vocab={r['draft_vocab']} loss={r['loss']} {r['impl'] or ''}: "
        f"{r['tokens_per_s']:.1f} tokens/s",
        flush=True,
    )


def _print_table(res: dict) -> None:
    """The run's setup, then its rows as a table."""
    print(
        f"device {res['device']} ({res['threads']} threads), target {res['target']}, {res['records']} records, "
        f"{res['tokens']} tokens (max_length {res['max_length']}, micro batch {res['micro_batch']})"
    )
    if "features_bytes_per_token" in res:
        print(
            f"features cache: {res['features_bytes_per_token']:.0f} bytes/token on disk (top-{res['features_top_k']})"
        )
    print(
        f"{'what':<16}{'source':<10}{'precision':<11}{'draft vocab':<13}{'loss':<7}{'impl':<7}{'seconds':>9}"
        f"{'tokens/s':>11}{'vs first':>10}"
    )
    for r in res["rows"]:
        print(
            f"{r['what']:<16}{r['source']:<10}{r['precision']:<11}{str(r['draft_vocab'] or '-'):<13}"
            f"{str(r['loss'] or '-'):<7}{str(r['impl'] or '-'):<7}{r['seconds']:>9.2f}"
            f"{r['tokens_per_s']:>11.1f}{r['speedup']:>9.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        res = run(
            args.target,
            args.data,
            args.records,
            args.max_length,
            args.repeats,
            args.draft_vocab,
            args.precision,
            args.micro_batch,
            losses=args.loss,
            features=args.features,
            impls=args.loss_impl,
            report=_print_measured,
        )
    except RedraftError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    _print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

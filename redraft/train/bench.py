"""Training-throughput benchmark: baseline and candidates measured in the same run.

    python -m redraft.train.bench                       # default target, default ShareGPT, CPU
    python -m redraft.train.bench --records 8 --repeats 2 --draft-vocab 0 16384 --json out.json

For each setting it times, over the same records, (a) the frozen target's forward that makes
the hidden states and (b) one full training micro step (target forward + drafter forward over
all positions x n steps + backward + AdamW). Tokens/s count every token of the records (the
target processes all of them); ratios are against the fp32 / full-vocabulary baseline.
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


def run(target_spec: str, data: str, records: int, max_length: int, repeats: int, vocab_sizes: list[int],
        precisions: list[str], micro_batch: int, report=None) -> dict:
    from redraft.data import build_token_dataset
    from redraft.models import load_target
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig
    from redraft.train.config import make_config
    from redraft.train.trainer import batch_loss, collate, draft_vocab_from_data, target_hidden

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(target_spec, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    ds = build_token_dataset(data, target.tokenizer, split="train", max_length=max_length, limit=records)
    batches = [collate(ds, list(range(i, min(i + micro_batch, len(ds)))), device)
               for i in range(0, len(ds), micro_batch)]
    n_tokens = sum(int(len(x)) for x in ds["input_ids"])
    cfg = make_config(None, {"max_length": max_length})
    out = {"device": str(device), "threads": torch.get_num_threads(), "records": len(ds), "tokens": n_tokens,
           "max_length": max_length, "micro_batch": micro_batch, "target": target.model_id, "rows": []}

    def fwd(precision, bs=batches):
        for ids, _ in bs:
            target_hidden(target, ids, precision)

    for precision in precisions:
        t = _time(lambda: fwd(precision), repeats, warmup=lambda: fwd(precision, batches[:1]))
        out["rows"].append({"what": "target forward", "precision": precision, "draft_vocab": None,
                            "seconds": t, "tokens_per_s": n_tokens / t})
        if report:
            report(out["rows"][-1])
    for vocab in vocab_sizes:
        torch.manual_seed(0)
        dcfg = ReDrafterConfig.for_target(target, draft_vocab_size=vocab or None)
        model = ReDrafter(dcfg).to(device)
        if vocab:
            model.set_draft_vocab(draft_vocab_from_data(ds, dcfg.vocab_size, vocab))
        model.attach_target(target).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for precision in precisions:
            def step(bs=batches):
                for ids, mask in bs:
                    loss, *_ = batch_loss(model, model, target, ids, mask, cfg, precision)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            t = _time(step, repeats, warmup=lambda: step(batches[:1]))
            out["rows"].append({"what": "train step", "precision": precision, "draft_vocab": vocab or "full",
                                "seconds": t, "tokens_per_s": n_tokens / t})
            if report:
                report(out["rows"][-1])
    base = {r["what"]: r["tokens_per_s"] for r in reversed(out["rows"])}  # first row of each kind
    for r in out["rows"]:
        r["speedup"] = r["tokens_per_s"] / base[r["what"]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redraft.train.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="Target model spec.")
    p.add_argument("--data", default="default-chat", help="Data spec (records from its train split).")
    p.add_argument("--records", type=int, default=8, help="Records timed per setting.")
    p.add_argument("--max-length", type=int, default=1024, help="Truncate records to this many tokens.")
    p.add_argument("--micro-batch", type=int, default=1, help="Sequences per micro batch.")
    p.add_argument("--repeats", type=int, default=2, help="Timed repeats (best is reported) after a warm-up.")
    p.add_argument("--draft-vocab", type=int, nargs="+", default=[0, 16384],
                   help="Draft vocabulary sizes to compare (0 = full).")
    p.add_argument("--precision", nargs="+", default=["fp32", "amp-bf16"], help="Precisions to compare.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice).")
    p.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        res = run(args.target, args.data, args.records, args.max_length, args.repeats, args.draft_vocab,
                  args.precision, args.micro_batch,
                  report=lambda r: print(f"  measured: {r['what']} {r['precision']} vocab={r['draft_vocab']}: "
                                         f"{r['tokens_per_s']:.1f} tokens/s", flush=True))
    except RedraftError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"device {res['device']} ({res['threads']} threads), target {res['target']}, {res['records']} records, "
          f"{res['tokens']} tokens (max_length {res['max_length']}, micro batch {res['micro_batch']})")
    print(f"{'what':<16}{'precision':<11}{'draft vocab':<13}{'seconds':>9}{'tokens/s':>11}{'vs baseline':>13}")
    for r in res["rows"]:
        print(f"{r['what']:<16}{r['precision']:<11}{str(r['draft_vocab'] or '-'):<13}{r['seconds']:>9.2f}"
              f"{r['tokens_per_s']:>11.1f}{r['speedup']:>12.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

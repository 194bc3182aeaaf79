"""``make demo`` / ``redraft-demo``: the whole pipeline on the embedded default, offline.

1. n-gram tables for the target (model unigram/bigram/extended + ShareGPT tri-grams), built
   once into ``checkpoints/ngrams-smollm2`` and reused when present;
2. a ReDrafter head trained for a bounded time on the target's own replies to default-ShareGPT
   prompts (recipe ``demo``: 2,048 first turns self-distilled once and cached, then 8 minutes
   of training on CPU from cached target features), written to
   ``checkpoints/redrafter-smollm2`` and reused when present (``--retrain`` trains again);
3. a few held-out ShareGPT prompts decoded with plain greedy decoding and with the unified
   speculative decoder (every drafter in one tree): it prints tokens per target call (tau),
   tokens/s, the speedup, and whether the outputs are identical (they must be).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from redraft.cli import run_cli
from redraft.errors import RedraftError
from redraft.utils import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-demo",
        description="Build n-gram tables, train a ReDrafter head for a bounded time, then compare "
        "plain greedy decoding with the unified speculative decoder on held-out prompts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", default="default", help="target spec (load_target)")
    p.add_argument("--output-root", default="checkpoints", help="where the artifacts go")
    p.add_argument(
        "--train-minutes",
        type=float,
        default=8.0,
        help="training time budget for the head (the demo's longest stage)",
    )
    p.add_argument("--retrain", action="store_true", help="train the head again even if one exists")
    p.add_argument("--skip-train", action="store_true", help="use only the n-gram drafters")
    p.add_argument("--prompts", type=int, default=4, help="held-out ShareGPT prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma list of target dtypes to decode in (float32: output identical to "
        "plain greedy; bfloat16: AMX/tensor-core speed, may differ at near-ties); "
        "the baseline runs in the same dtype",
    )
    return p


DTYPES = ("float32", "bfloat16", "float16")


def check_args(args, parser) -> None:
    """Refuse bad values at once, before the minutes the stages take, naming the flag."""
    if args.prompts < 1:
        parser.error(f"--prompts {args.prompts} must be >= 1 (held-out prompts to decode)")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if not args.skip_train and not args.train_minutes > 0:  # nan too
        parser.error(f"--train-minutes {args.train_minutes:g} must be > 0 (or pass --skip-train)")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes {args.dtypes!r}: use a comma list of {', '.join(DTYPES)}")


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def build_ngrams(target_spec: str, out: Path) -> Path:
    from redraft.ngrams.cli import main as ngrams_main

    # the builder skips kinds already in `out`, so an interrupted demo resumes where it stopped
    rc = ngrams_main(
        [
            "--target",
            target_spec,
            "--kinds",
            "unigram,bigram,extended,trigram",
            "--data",
            "default-chat",
            "--output-dir",
            str(out),
        ]
    )
    if rc:
        raise RedraftError(f"redraft-build-ngrams failed (exit {rc}); see the messages above.")
    return out


def train_head(target_spec: str, out: Path, minutes: float, retrain: bool) -> Path:
    from redraft.data.replies import use_replies
    from redraft.infer.replies import EngineReplies
    from redraft.train.config import make_config
    from redraft.train.trainer import train

    if (out / "model.safetensors").is_file() and (out / "metrics.json").is_file() and not retrain:
        print(f"trained head found in {out} (pass --retrain to train again)")
        return out
    # train/recipes/demo.yaml: the default recipe bounded for a CPU (reduced draft vocabulary,
    # schedule over the time budget)
    cfg = make_config(
        "demo", {"target": target_spec, "output_dir": str(out), "max_time_minutes": minutes}
    )
    # the target's features of the self-distilled records, cached once (like the records): the
    # budget then trains the head ~2x the tokens of a run that runs the target every step
    # (docs/design/0006-demo-recipe.md). No KD-only ShareGPT records: with
    # ~1,700 distilled conversations they no longer paid.
    with use_replies(EngineReplies):  # the self-distilled data comes from redraft's engine
        feats = cache_demo_features(cfg, out.parent / f"{out.name}-features")
        metrics = train(cfg.replace(features=str(feats)), resume=False, overwrite=True)
    if metrics.get("status") == "interrupted":
        raise RedraftError(
            f"training was interrupted; the checkpoint in {out} can be resumed with "
            f"`redraft-train --output-dir {out} --resume`."
        )
    return out


def cache_demo_features(cfg, path: Path) -> Path:
    """``redraft-cache-features`` for the demo's records into ``path`` (kept and reused; features
    of another target or other records are replaced)."""
    from redraft.errors import ConfigError
    from redraft.train.features import cache_features

    try:
        cache_features(cfg, path)
    except ConfigError as exc:
        if exc.param != "output_dir":
            raise
        print(f"{path} holds features of other records; caching them again")
        cache_features(cfg, path, overwrite=True)
    return path


def print_head_metrics(run: Path) -> None:
    import json

    m = json.loads((run / "metrics.json").read_text())
    top1 = m.get("eval_top1") or []
    print(
        "held-out top-1 accuracy by draft position: "
        + " ".join(f"{i + 1}:{a:.3f}" for i, a in enumerate(top1))
    )
    if "eval_tau_est" in m:
        print(f"estimated acceptance length tau_est = {m['eval_tau_est']:.3f}")


def compare(target, drafter_dirs, ngram_dirs, n_prompts: int, max_new: int, referee=None) -> dict:
    """Plain greedy against the unified decoder on held-out prompts, printed and returned.
    ``referee``: a callable giving a float32 copy of the target, asked only where an output
    differs (bfloat16): where, and whether it is a near-tie (``redraft.infer.ties``)."""
    import torch

    from redraft.data import heldout_prompts
    from redraft.infer import load_decoder, plain_greedy
    from redraft.infer.ties import first_divergence

    prompts = heldout_prompts("default-chat", n=n_prompts)
    dec = load_decoder(target, drafters=drafter_dirs, ngrams=ngram_dirs)
    names = ", ".join(d.name for d in dec.drafters)
    print(f"unified decoder drafters: {names}")
    # warm-up (and the verify-cost measurement) outside the timed region
    dec.generate(prompts[0], max_new_tokens=8)
    plain_greedy(target, prompts[0], max_new_tokens=8)
    rows, same, diverged = [], 0, []
    t_ar = t_sd = 0.0
    n_ar = n_sd = calls = 0
    for i, msgs in enumerate(prompts):
        t0 = time.perf_counter()
        ar = plain_greedy(target, msgs, max_new_tokens=max_new)[0]
        t1 = time.perf_counter()
        sd = dec.generate(msgs, max_new_tokens=max_new)[0]
        t2 = time.perf_counter()
        t_ar += t1 - t0
        t_sd += t2 - t1
        n_ar += len(ar.tokens)
        n_sd += len(sd.tokens)
        calls += sd.stats.target_calls
        same += ar.tokens == sd.tokens
        if ar.tokens != sd.tokens:
            diverged.append((i, msgs, sd.tokens, ar.tokens))
        rows.append(
            (
                i,
                len(sd.tokens),
                sd.stats.tokens_per_call,
                (t1 - t0) / max(t2 - t1, 1e-9),
                ar.tokens == sd.tokens,
            )
        )
        if i == 0:
            print(f"\nprompt: {msgs[-1]['content'][:200]!r}")
            print(f"reply : {sd.text[:400]!r}\n")
    print(f"{'prompt':>6} {'tokens':>6} {'tau':>6} {'speedup':>8} {'identical':>9}")
    for i, n, tau, sp, ok in rows:
        print(f"{i:>6} {n:>6} {tau:>6.2f} {sp:>7.2f}x {str(ok):>9}")
    summary = {
        "plain_tokens_per_s": n_ar / t_ar,
        "speculative_tokens_per_s": n_sd / t_sd,
        "tau": n_sd / max(calls, 1),
        "speedup": (n_sd / t_sd) / (n_ar / t_ar),
        "identical": f"{same}/{len(prompts)}",
    }
    print(f"\nplain greedy      : {summary['plain_tokens_per_s']:.1f} tokens/s")
    print(
        f"unified decoder   : {summary['speculative_tokens_per_s']:.1f} tokens/s, "
        f"tau {summary['tau']:.2f} tokens per target call"
    )
    print(
        f"speedup           : {summary['speedup']:.2f}x; outputs identical to plain greedy on "
        f"{summary['identical']} prompts"
    )
    if diverged:
        ref = referee() if referee is not None else target
        if target.dtype == torch.float32:
            print("\nfloat32 output must equal plain greedy's; each difference:")
        else:
            print(
                f"\n{str(target.dtype).removeprefix('torch.')} verifies a tree in one batched "
                "forward, which rounds "
                "differently from a one-token step: where the target's two best tokens are "
                "within rounding, the argmax can flip. Each difference, judged by the float32 "
                "target:"
            )
        ties = []
        for i, msgs, got, want in diverged:
            d = first_divergence(ref, target.chat_ids(msgs), got, want)
            ties.append(d is None or d.near_tie)
            what = "one output stops earlier" if d is None else d.describe(target.tokenizer)
            print(f"  prompt {i}: {what}")
        summary["near_ties"] = f"{sum(ties)}/{len(ties)}"
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    root = Path(args.output_root)

    def work() -> None:
        from redraft.models import load_target

        t0 = time.perf_counter()
        _banner("1/3 n-gram tables (model unigram/bigram/extended + ShareGPT tri-grams)")
        ngrams = build_ngrams(args.target, root / "ngrams-smollm2")
        drafters = []
        if not args.skip_train:
            _banner(f"2/3 ReDrafter head on ShareGPT ({args.train_minutes:g} min of training)")
            run = train_head(
                args.target, root / "redrafter-smollm2", args.train_minutes, args.retrain
            )
            print_head_metrics(run)
            drafters = [str(run)]
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        fp32 = {}

        def referee():  # a float32 copy of the target, loaded once when first needed
            if "t" not in fp32:
                fp32["t"] = load_target(args.target, dtype="float32", device="cpu")
            return fp32["t"]

        for i, dtype in enumerate(dtypes):
            _banner(
                f"3/3 decoding {args.prompts} held-out ShareGPT prompts in {dtype} "
                f"({i + 1}/{len(dtypes)})"
            )
            target = load_target(args.target, dtype=dtype, device="cpu")
            if dtype == "float32":
                fp32["t"] = target
            compare(target, drafters, [str(ngrams)], args.prompts, args.max_new_tokens, referee)
        print(f"\nartifacts: {ngrams}" + (f", {drafters[0]}" if drafters else ""))
        print(
            "use them from your own code:\n"
            "    from redraft.infer import load_decoder\n"
            f"    dec = load_decoder('default', drafters={drafters!r}, ngrams=[{str(ngrams)!r}])\n"
            "    print(dec.generate([{'role': 'user', 'content': 'Hi!'}])[0].text)"
        )
        print(f"demo finished in {(time.perf_counter() - t0) / 60:.1f} min")

    return run_cli("redraft-demo", work)


if __name__ == "__main__":
    sys.exit(main())

"""``make demo`` / ``redraft-demo``: the whole pipeline on the embedded default, offline.

1. n-gram tables for the target (model unigram/bigram/extended + ShareGPT tri-grams), built
   once into ``checkpoints/ngrams-smollm2`` and reused when present;
2. a ReDrafter head trained on the target's own replies to default-ShareGPT prompts: the replies
   are made by the target once (self-distilled) and cached, the target's features of them cached,
   then the head trains for a bounded time from those features (recipe ``demo``, or the larger
   ``demo-full`` with ``--full``), written to ``checkpoints/redrafter-smollm2`` (``-full``) and
   reused when present (``--retrain`` trains again). The target is loaded once for all three;
3. a few held-out ShareGPT prompts decoded with plain greedy decoding and with the unified
   speculative decoder (every drafter in one tree): it prints tokens per target call (tau),
   tokens/s, the speedup, and whether the outputs are identical (they must be);

then a table of what each stage made and how long it took.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from redraft.cli import run_cli
from redraft.errors import RedraftError
from redraft.utils import ArgumentParser, HelpFormatter, require_extra

# the two training recipes (train/recipes/<name>.yaml) and what their cost is made of, in words;
# their sizes come from the recipe files themselves (recipe_help)
RECIPES = {
    "demo": "sized for a small CPU: the whole demo from a fresh machine in minutes, most of "
    "them the target answering the prompts once",
    "demo-full": "several times the quick demo's wall time on a CPU, most of it making the "
    "replies and their features once (later runs reuse them), for a head that accepts more",
}


def recipe_help(name: str) -> str:
    """``name``'s size (from its YAML) and cost (:data:`RECIPES`), for ``--help``."""
    from redraft.train.config import load_recipe

    r = load_recipe(name)
    return (
        f"train/recipes/{name}.yaml: {r['distill_limit']:,} ShareGPT first turns answered by the "
        f"target, replies of at most {r['distill_max_new_tokens']} tokens, "
        f"{r['max_time_minutes']:g} minutes of training; {RECIPES[name]}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-demo",
        formatter_class=HelpFormatter,
        description="Build n-gram tables, train a ReDrafter head on the target's own replies for a "
        "bounded time, then compare plain greedy decoding with the unified speculative decoder on "
        "held-out prompts, and sum up each stage. Artifacts and the replies are cached: a second "
        "run reuses them.",
    )
    p.add_argument("--target", default="default", help="target spec (load_target)")
    p.add_argument("--output-root", default="checkpoints", help="where the artifacts go")
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the quality recipe, {recipe_help('demo-full')}. Without it: the quick one, "
        f"{recipe_help('demo')}",
    )
    p.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="training time budget for the head (default: the recipe's max_time_minutes)",
    )
    p.add_argument("--retrain", action="store_true", help="train the head again even if one exists")
    p.add_argument("--skip-train", action="store_true", help="use only the n-gram drafters")
    p.add_argument("--prompts", type=int, default=4, help="held-out ShareGPT prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument(
        "--dtypes",
        default="float32",
        help="comma list of target dtypes to decode in, each a decoding stage of its own "
        "(float32: output identical to plain greedy; bfloat16: AMX/tensor-core speed, may differ "
        "at near-ties, each difference explained); the baseline runs in the same dtype",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for every stage (default: torch's choice, one per core). When "
        "other jobs keep the cores busy, 1 thread can be several times faster: threads that "
        "wait for each other at every operation lose most when another job holds a core",
    )
    return p


DTYPES = ("float32", "bfloat16", "float16")


def check_args(args, parser) -> None:
    """Refuse bad values at once, before the minutes the stages take, naming the flag."""
    if args.prompts < 1:
        parser.error(f"--prompts {args.prompts} must be >= 1 (held-out prompts to decode)")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be >= 1 (leave it out for torch's choice)")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if not args.skip_train and args.train_minutes is not None and not args.train_minutes > 0:
        parser.error(f"--train-minutes {args.train_minutes:g} must be > 0 (or pass --skip-train)")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes {args.dtypes!r}: use a comma list of {', '.join(DTYPES)}")


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def build_ngrams(target_spec: str, out: Path, threads: int | None = None) -> Path:
    from redraft.ngrams.cli import main as ngrams_main

    # the builder skips kinds already in `out`, so an interrupted demo resumes where it stopped
    rc = ngrams_main(
        [
            *(["--threads", str(threads)] if threads else []),
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


class Stages:
    """What each stage made and how long it took, for the closing table."""

    def __init__(self):
        self.rows: list[tuple[str, float | None, str]] = []  # (stage, seconds or None, result)
        self.t0 = time.perf_counter()

    def add(self, stage: str, seconds: float | None, result: str) -> None:
        self.rows.append((stage, seconds, result))

    def table(self) -> str:
        """The rows as a fixed-width table, ``-`` for a stage that reused its artifact, and the
        total wall time (model loads and everything between the stages included)."""
        total = time.perf_counter() - self.t0
        w = max(len(r[0]) for r in [*self.rows, ("total", 0, "")])
        lines = [f"{'stage':<{w}}  {'minutes':>7}  result"]
        for stage, sec, result in self.rows:
            t = "-" if sec is None else f"{sec / 60:.1f}"
            lines.append(f"{stage:<{w}}  {t:>7}  {result}")
        lines.append(f"{'total':<{w}}  {total / 60:>7.1f}  wall time of the whole demo")
        return "\n".join(lines)


def head_found(out: Path) -> bool:
    return (out / "model.safetensors").is_file() and (out / "metrics.json").is_file()


def train_head(
    target_spec: str,
    out: Path,
    recipe: str,
    minutes: float | None,
    retrain: bool,
    stages: Stages | None = None,
    overrides: dict | None = None,
) -> Path:
    """Self-distil the recipe's replies (cached), cache the target's features of them (kept in
    ``<out>-features``), train the head into ``out``; the target is loaded once for the three.
    Each part is timed into ``stages``. A finished head in ``out`` is reused unless ``retrain``.
    ``minutes``: the training budget (None: the recipe's); ``overrides``: settings over the
    recipe (``--threads``, tests)."""
    import types

    from redraft.data.replies import use_replies
    from redraft.infer.replies import EngineReplies
    from redraft.models import load_target
    from redraft.train.config import make_config
    from redraft.train.distilled import distilled_data
    from redraft.train.distributed import resolve_train_device
    from redraft.train.fingerprint import target_record
    from redraft.train.precision import resolve_precision, target_dtype
    from redraft.train.trainer import train

    stages = stages or Stages()
    if head_found(out) and not retrain:
        print(f"trained head found in {out} (pass --retrain to train again)")
        stages.add("head", None, f"reused {out}")
        return out
    settings = {**(overrides or {}), "target": target_spec, "output_dir": str(out)}
    if minutes is not None:
        settings["max_time_minutes"] = minutes
    cfg = make_config(recipe, settings)
    # one target for the replies, the features and the training (the trainer's own dtype choice)
    device = resolve_train_device(cfg.device)
    target = load_target(
        cfg.target, dtype=target_dtype(resolve_precision(cfg, device), device), device=device
    )
    record = target_record(target)
    solo = types.SimpleNamespace(
        is_main=True, say=lambda m: print(m, flush=True), barrier=lambda: None
    )
    with use_replies(EngineReplies):  # the self-distilled data comes from redraft's engine
        t = time.perf_counter()
        data = distilled_data(cfg, target, record, solo)
        stages.add("self-distilled replies", time.perf_counter() - t, distilled_summary(data))
        # the target's features of the records, cached once (like the replies): the time budget
        # then trains the head on ~3x the tokens of a run that runs the target every step
        t = time.perf_counter()
        feats = out.parent / f"{out.name}-features"
        meta = cache_demo_features(cfg, feats, target)
        stages.add(
            "target features",
            time.perf_counter() - t,
            f"{meta['tokens']:,} tokens of {meta['records']:,} records",
        )
        t = time.perf_counter()
        metrics = train(
            cfg.replace(features=str(feats)), resume=False, overwrite=True, target=target
        )
    if metrics.get("status") == "interrupted":
        raise RedraftError(
            f"training was interrupted; the checkpoint in {out} can be resumed with "
            f"`redraft-train --output-dir {out} --resume`."
        )
    stages.add(
        "head training + held-out eval",
        time.perf_counter() - t,
        f"{metrics['global_step']:,} steps in {metrics['train_time_s'] / 60:.1f} min "
        f"({metrics['epochs_done']:.1f} epochs); held-out tau_est "
        f"{metrics.get('eval_tau_est', float('nan')):.3f}",
    )
    return out


def distilled_summary(data_cfg) -> str:
    """One line on the self-distilled train split: conversations kept, and the new tokens and
    their rate when the file was made (its ``.done.json``; the same when found in the cache)."""
    import json

    from redraft.train.distilled import DONE_SUFFIX

    path = Path(data_cfg.data.split(":", 1)[1])
    done = path.parent / ("train.jsonl" + DONE_SUFFIX)
    try:
        res = json.loads(done.read_text())["result"]
    except (OSError, ValueError, KeyError):
        return str(path)
    with open(path, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    made = res.get("new_tokens", 0)
    return (
        f"{n:,} conversations, {made:,} new tokens "
        f"({made / max(res.get('seconds', 0), 1e-9):.0f} tokens/s, {res.get('generator', '?')})"
    )


def cache_demo_features(cfg, path: Path, target=None) -> dict:
    """``redraft-cache-features`` for the demo's records into ``path`` (kept and reused; features
    of another target or other records are replaced); returns its ``features.json``."""
    from redraft.errors import ConfigError
    from redraft.train.features import cache_features

    try:
        return cache_features(cfg, path, target=target)
    except ConfigError as exc:
        if exc.param != "output_dir":
            raise
        print(f"{path} holds features of other records; caching them again")
        return cache_features(cfg, path, overwrite=True, target=target)


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
    differs (bfloat16): where, and whether it is a near-tie (``redraft.bench.ties``)."""
    from redraft.data import heldout_prompts
    from redraft.infer import load_decoder, plain_greedy

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
        speedup = (t1 - t0) / max(t2 - t1, 1e-9)
        rows.append((i, len(sd.tokens), sd.stats.tokens_per_call, speedup, ar.tokens == sd.tokens))
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
        summary["near_ties"] = _judge_differences(target, referee, diverged)
    return summary


def _judge_differences(target, referee, diverged: list) -> str:
    """Where each output that differs from plain greedy's does, printed (judged by ``referee``'s
    float32 target when given); the near ties among them, as ``"k/n"``."""
    import torch

    from redraft.bench.ties import first_divergence

    ref = referee() if referee is not None else target
    if target.dtype == torch.float32:
        print("\nfloat32 output must equal plain greedy's; each difference:")
    else:
        print(
            f"\n{str(target.dtype).removeprefix('torch.')} verifies a tree in one batched "
            "forward, which rounds differently from a one-token step: where the target's two best "
            "tokens are within rounding, the argmax can flip. Each difference, judged by the "
            "float32 target:"
        )
    ties = []
    for i, msgs, got, want in diverged:
        d = first_divergence(ref, target.chat_ids(msgs), got, want)
        ties.append(d is None or d.near_tie)
        what = "one output stops earlier" if d is None else d.describe(target.tokenizer)
        print(f"  prompt {i}: {what}")
    return f"{sum(ties)}/{len(ties)}"


def busy_cpu_hint() -> None:
    """Say so when other jobs already keep the cores busy (the 1-minute load average, before
    the demo's own work): torch's threads, one per core, then wait on each other."""
    import os

    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on this platform
        return
    if cores > 1 and load >= cores / 2:
        print(
            f"note: the CPU is busy (load average {load:.1f} on {cores} cores); if the stages "
            f"crawl, --threads 1 can be several times faster on a shared CPU",
            flush=True,
        )


def ngram_summary(path: Path) -> str:
    """The kinds in an n-gram tables directory, and whether this run built them."""
    import json

    try:
        meta = json.loads((path / "ngrams.json").read_text())
    except (OSError, ValueError):
        return str(path)
    kinds = [k for k in ("unigram", "bigram", "extended", "trigram") if k in meta.get("files", {})]
    return f"{', '.join(kinds)} in {path}"


def decode_summary(s: dict) -> str:
    """One line of :func:`compare`'s summary."""
    line = (
        f"{s['speedup']:.2f}x plain greedy, tau {s['tau']:.2f} tokens per target call, outputs "
        f"identical {s['identical']}"
    )
    if "near_ties" in s:
        line += f" (differences at near-ties: {s['near_ties']})"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    root = Path(args.output_root)

    def work() -> None:
        if not args.skip_train:
            require_extra("train", "deepspeed", "datasets", what="redraft-demo (it trains a head)")
        import torch

        from redraft.models import load_target

        if args.threads:
            torch.set_num_threads(args.threads)
        else:
            busy_cpu_hint()
        stages = Stages()
        _banner("1/3 n-gram tables (model unigram/bigram/extended + ShareGPT tri-grams)")
        t = time.perf_counter()
        ngrams = build_ngrams(args.target, root / "ngrams-smollm2", args.threads)
        stages.add("n-gram tables", time.perf_counter() - t, ngram_summary(ngrams))
        drafters = []
        if not args.skip_train:
            recipe = "demo-full" if args.full else "demo"
            out = root / ("redrafter-smollm2-full" if args.full else "redrafter-smollm2")
            minutes = args.train_minutes
            if minutes is None:
                from redraft.train.config import load_recipe

                minutes = load_recipe(recipe)["max_time_minutes"]
            _banner(
                f"2/3 ReDrafter head on the target's own replies (recipe {recipe}: self-distilled "
                f"ShareGPT first turns, their features cached, {minutes:g} min of training)"
            )
            over = {"threads": args.threads} if args.threads else None
            run = train_head(args.target, out, recipe, minutes, args.retrain, stages, over)
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
            t = time.perf_counter()
            target = load_target(args.target, dtype=dtype, device="cpu")
            if dtype == "float32":
                fp32["t"] = target
            summary = compare(
                target, drafters, [str(ngrams)], args.prompts, args.max_new_tokens, referee
            )
            stages.add(f"decoding, {dtype}", time.perf_counter() - t, decode_summary(summary))
        print(f"\nartifacts: {ngrams}" + (f", {drafters[0]}" if drafters else ""))
        print(
            "use them from your own code:\n"
            "    from redraft.infer import load_decoder\n"
            f"    dec = load_decoder('default', drafters={drafters!r}, ngrams=[{str(ngrams)!r}])\n"
            "    print(dec.generate([{'role': 'user', 'content': 'Hi!'}])[0].text)"
        )
        _banner("summary")
        print(stages.table())

    return run_cli("redraft-demo", work)


if __name__ == "__main__":
    sys.exit(main())

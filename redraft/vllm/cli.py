"""``redraft-vllm``: what running redraft's proposer inside vLLM takes.

redraft-vllm export-target --target default --out checkpoints/smollm2-hf
redraft-vllm config --ngrams checkpoints/ngrams-smollm2 -k 5 --out proposer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from redraft.cli import run_cli
from redraft.utils import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-vllm",
        description="Use redraft's drafters inside vLLM: export a target as the Hugging Face "
        "folder vLLM loads, and write the proposer's settings with the matching "
        "--speculative-config.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    e = sub.add_parser(
        "export-target",
        help="write a target (GGUF file, 'default', PEFT adapter, HF dir) as a plain HF folder",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("--target", default="default", help="target spec, as for redraft-train")
    e.add_argument("--out", required=True, help="the folder to write (vLLM's --model)")
    e.add_argument(
        "--dtype",
        default="float32",
        help="dtype of the saved weights (float32, bfloat16 or float16); vLLM's --dtype "
        "chooses what it computes in",
    )
    e.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    c = sub.add_parser(
        "config",
        help="print vLLM's --speculative-config for redraft's proposer; write its settings",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument(
        "--ngrams",
        default=None,
        help="n-gram tables built for the served model's tokenizer (redraft-build-ngrams); "
        "none: the request's own tokens only",
    )
    c.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=5,
        help="the longest chain vLLM verifies per step",
    )
    c.add_argument(
        "--drafters",
        default=None,
        help="comma list of context, ngrammys, trigram (default: every one the tables allow)",
    )
    c.add_argument(
        "--min-value",
        type=float,
        default=0.03,
        help="cut a chain where its estimated chance of acceptance falls below this",
    )
    c.add_argument(
        "--out",
        default=None,
        help="write the settings to this JSON file and print the REDRAFT_VLLM_CONFIG line "
        "that names it (default: print them inline)",
    )
    r = sub.add_parser(
        "replay",
        help="tau and draft tokens per step of the proposer on replayed greedy outputs "
        "(no vLLM timing; vLLM's ngram beside it when vLLM is installed)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument("--target", default="default", help="target spec, as for redraft-bench")
    r.add_argument("--ngrams", default=None, help="n-gram tables for the target")
    r.add_argument("--datasets", default="chat,code", help="comma list, as redraft-bench's")
    r.add_argument("--prompts", type=int, default=20, help="prompts per dataset")
    r.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens per prompt")
    r.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    r.add_argument(
        "--min-values", default="0,0.03,0.1", help="comma list of min_value settings to replay"
    )
    r.add_argument(
        "--drafters",
        default=None,
        help="comma list of the proposer's drafters (default: every one the tables allow)",
    )
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads for the target")
    r.add_argument(
        "--results-dir",
        default=None,
        help="also write the table as data (JSON + Markdown with command, commit, machine, "
        "versions) into this directory, e.g. benchmarks/results/cpu",
    )
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run_cli("redraft-vllm", lambda: _main(args))


def _main(args) -> int:
    if args.command == "export-target":
        from redraft.vllm.export import export_target

        out = export_target(args.target, args.out, dtype=args.dtype, overwrite=args.overwrite)
        print(f"wrote {out}: vllm serve {out} ... (or LLM(model={str(out)!r}, ...))")
        return 0
    if args.command == "replay":
        return _replay(args)
    from redraft.vllm.settings import ENV_VAR, ProposerSettings, speculative_config

    ngrams = args.ngrams
    if ngrams and Path(ngrams).expanduser().exists():  # vLLM's workers may start elsewhere
        ngrams = str(Path(ngrams).expanduser().resolve())
    settings = {"ngrams": ngrams, "min_value": args.min_value}
    if args.drafters:
        settings["drafters"] = [d.strip() for d in args.drafters.split(",") if d.strip()]
    spec = speculative_config(args.num_speculative_tokens, **settings)  # checks the settings
    doc = ProposerSettings.from_dict(settings).to_dict()
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        env = f"{ENV_VAR}={Path(args.out).resolve()}"
    else:
        env = f"{ENV_VAR}='{json.dumps(doc)}'"
    sys.stdout.write(f"{env} vllm serve MODEL --speculative-config '{json.dumps(spec)}'\n")
    return 0


def _replay(args) -> int:
    import tempfile

    from redraft.errors import ConfigError
    from redraft.models import load_target
    from redraft.vllm import replay as rp
    from redraft.vllm.settings import ProposerSettings

    try:
        floors = [float(x) for x in args.min_values.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--min-values {args.min_values!r}: a comma list of numbers") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device="cpu")
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    pairs = rp.greedy_outputs(target, datasets, args.prompts, args.max_new_tokens)
    rows = []
    ngram = rp.vllm_ngram_propose(args.k)
    if ngram is not None:
        rows.append(("vLLM ngram (1-4)", ngram))
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer the proposer checks tables with
        target.tokenizer.save_pretrained(tmp)
        for f in floors:
            drafters = [d.strip() for d in args.drafters.split(",")] if args.drafters else None
            # no forward runs between a replay's steps: chains are cut by the floor alone
            s = ProposerSettings(ngrams=args.ngrams, min_value=f, drafters=drafters, cost="off")
            name = f"redraft {'+'.join(drafters) + ' ' if drafters else ''}min_value={f:g}"
            rows.append((name, rp.redraft_propose(tmp, target.vocab_size, args.k, s)))
        lines = [
            f"redraft-vllm replay: target {args.target}, {args.prompts} prompts per dataset, "
            f"{args.max_new_tokens} greedy tokens; tau = tokens per target call (prefill "
            f"included), drafted/step = chain tokens sent per verify",
            "",
            f"| proposer (k={args.k}) | "
            + " | ".join(f"{d} tau | {d} drafted/step" for d in datasets)
            + " |",
            "|---|" + "---:|---:|" * len(datasets),
        ]
        results = {}
        for name, propose in rows:
            results[name] = {d: rp.replay(propose, pairs[d]) for d in datasets}
            lines.append(
                f"| {name} | "
                + " | ".join(
                    f"{c['tau']:.3f} | {c['drafted_per_step']:.2f}" for c in results[name].values()
                )
                + " |"
            )
    md = "\n".join(lines) + "\n"
    print(md, end="")
    if args.results_dir:
        from redraft.bench.results import run_metadata, write_result

        meta = run_metadata(args.argv, prog="redraft-vllm")
        paths = write_result(args.results_dir, "vllm-replay", {"results": results}, md, meta)
        print(f"results: {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

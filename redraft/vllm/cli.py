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
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli("redraft-vllm", lambda: _main(args))


def _main(args) -> int:
    if args.command == "export-target":
        from redraft.vllm.export import export_target

        out = export_target(args.target, args.out, dtype=args.dtype, overwrite=args.overwrite)
        print(f"wrote {out}: vllm serve {out} ... (or LLM(model={str(out)!r}, ...))")
        return 0
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


if __name__ == "__main__":
    raise SystemExit(main())

"""``redraft-train``: train a ReDrafter head on a frozen target with DeepSpeed.

    redraft-train                                      # the default recipe (SmolLM2-135M, ShareGPT)
    redraft-train --recipe tiny --target DIR --data sharegpt:FILE.jsonl --max-steps 20
    redraft-train --recipe default --lr 3e-4 --set num_layers=3 --output-dir checkpoints/mine
    redraft-train --output-dir checkpoints/mine --resume
    deepspeed --num_gpus 8 --module redraft.train.cli --recipe vicuna-7b-8xh100
    torchrun --nproc_per_node 8 -m redraft.train.cli --recipe vicuna-7b-8xh100

Every recipe key is also a flag (``--max-time-minutes 10``); ``--set KEY=VALUE`` works for any key.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from redraft.errors import RedraftError
from redraft.train.config import TrainConfig, make_config, parse_set


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redraft-train",
        description="Train a ReDrafter draft head on a frozen target model (DeepSpeed; one process, "
                    "or launch with `deepspeed`/`torchrun`). Settings: dataclass defaults <- --recipe "
                    "<- flags / --set.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--recipe", default="default",
                   help="Recipe name in train/recipes/ (default, tiny, vicuna-7b-8xh100, llama3-8b-8xh100) "
                        "or a YAML file; 'none' for the built-in defaults only.")
    p.add_argument("--resume", action="store_true",
                   help="Continue the run in --output-dir from its newest checkpoint (weights, optimizer, "
                        "schedule, data position, RNG).")
    p.add_argument("--overwrite", action="store_true", help="Replace a run already in --output-dir.")
    p.add_argument("--set", dest="set_", action="append", default=[], metavar="KEY=VALUE",
                   help="Override any recipe key (repeatable).")
    p.add_argument("--print-config", action="store_true", help="Print the resolved config and exit.")
    p.add_argument("--eval-only", action="store_true",
                   help="Only evaluate the artifact given by --init-from on the held-out data (prints "
                        "per-position accuracy and tau_est as JSON); trains and writes nothing.")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    grp = p.add_argument_group("recipe keys (each overrides the recipe)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kw = {"default": None, "dest": f.name, "help": f.metadata.get("help", "") + f" [default {f.default!r}]"}
        if f.name == "adam_betas":
            grp.add_argument(flag, nargs=2, metavar=("B1", "B2"), **kw)
        elif f.name == "max_steps":
            grp.add_argument(flag, "--steps", metavar="N", **kw)
        else:
            grp.add_argument(flag, metavar=f.name.upper() if f.type != "bool" else "{true,false}", **kw)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = parse_set(args.set_)
    for f in fields(TrainConfig):
        v = getattr(args, f.name)
        if v is not None:
            overrides[f.name] = v if not isinstance(v, list) else [float(x) for x in v]
    recipe = None if args.recipe in (None, "", "none") else args.recipe
    return make_config(recipe, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if args.eval_only:
            import json

            from redraft.train.trainer import evaluate_artifact

            print(json.dumps(evaluate_artifact(cfg), indent=2))
            return 0
        from redraft.train.trainer import train

        metrics = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except RedraftError as exc:
        print(f"redraft-train: error: {exc}", file=sys.stderr)
        return 2
    if metrics.get("status") == "interrupted":
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

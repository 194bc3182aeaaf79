"""``redraft``: one command for every stage, ``redraft <command> [ARGS...]`` (as ``vllm serve``).

    redraft build-ngrams --target default --output-dir checkpoints/ngrams-smollm2
    redraft train --recipe train/recipes/tiny.yaml
    redraft bench --recipe infer/bench-default.yaml
    redraft serve --preset infer/decode-default.yaml

Each command runs the ``main`` of the console script ``redraft-<command>`` (which stays, an
alias) with the arguments after it, so ``redraft bench --help`` is ``redraft-bench --help``; its
usage and errors name it ``redraft bench`` (:func:`redraft.utils.subcommand`). A command's
module is imported only when it runs: ``redraft --help`` imports none of them.
"""

from __future__ import annotations

import importlib
import sys

from redraft import __version__
from redraft.utils import subcommand

# command: (its console script's "module:function", what it does in one line). pyproject.toml's
# redraft-<command> scripts point at the same functions (tests/test_commands.py checks it).
COMMANDS = {
    "train": ("redraft.entry:train_main", "train a ReDrafter draft head on a frozen target"),
    "cache-features": (
        "redraft.entry:cache_features_main",
        "cache the target's hidden states and top-k logits for training",
    ),
    "build-ngrams": ("redraft.ngrams.cli:main", "build n-gram draft tables (model and corpus)"),
    "distill-data": (
        "redraft.entry:distill_data_main",
        "regenerate a chat dataset's replies with the target (self-distillation)",
    ),
    "bench": ("redraft.bench.cli:main", "decoding methods side by side on the same prompts"),
    "push": ("redraft.hub.push:push_main", "publish a finished artifact to the Hugging Face Hub"),
    "demo": ("redraft.demo:main", "build tables, train a head, compare decoders: end to end"),
    "serve": ("redraft.serve.cli:main", "the speculative decoder behind an OpenAI-compatible API"),
    "export": ("redraft.train.export:main", "write a trained head in another project's layout"),
    "vllm": ("redraft.vllm.cli:main", "redraft's drafters inside vLLM: export, config, replay"),
}
PROG = "redraft"


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    rows = [f"  {name:<{width}}{line}" for name, (_, line) in COMMANDS.items()]
    return "\n".join(
        [
            f"usage: {PROG} <command> [ARGS...]",
            "",
            "redraft: speculative decoding toolkit. `redraft <command>` is the console script "
            "`redraft-<command>`;",
            "`redraft <command> --help` shows its flags.",
            "",
            "commands:",
            *rows,
            "",
            "options:",
            "  -h, --help  show this message and exit",
            "  --version   show redraft's version and exit",
        ]
    )


def _error(message: str) -> int:
    print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
    return 2


def command_main(name: str):
    """The ``main(argv) -> int`` of command ``name`` (its module imported now)."""
    module, _, function = COMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    """``redraft <command> [ARGS...]``: runs the command's main with ``ARGS``; returns its exit
    status (2 for a missing or unknown command)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    first, rest = argv[0], argv[1:]
    if first in ("-h", "--help"):
        print(usage())
        return 0
    if first == "--version":
        print(f"{PROG} {__version__}")
        return 0
    if first not in COMMANDS:
        what = "option" if first.startswith("-") else "command"
        return _error(f"unknown {what} {first!r}; the commands are {', '.join(COMMANDS)}")
    with subcommand(first):
        return command_main(first)(rest)

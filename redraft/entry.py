"""Console-script entry points that wire a lower stage's command to a later stage's engine.

``data`` and ``train`` may not import ``infer`` (the layering rule), yet their self-distillation
should generate with redraft's own batched engine, the fastest path the project has. So the
commands keep their code where it is (``redraft.data.distill.main``, ``redraft.train.cli``)
and these wrappers, one layer above ``infer``, run them inside
``redraft.data.replies.use_replies(engine_replies)``; ``python -m redraft.data.distill`` or
``redraft.train.cli`` run directly fall back to Hugging Face ``generate``.

Nothing heavy is imported here: ``--help`` stays instant (``redraft.infer.replies`` is imported
only when a target is loaded and a generator made).
"""

from __future__ import annotations

import sys

from redraft.data.replies import use_replies


def engine_replies(target, settings):
    """``redraft.infer.replies.EngineReplies(target, settings)``, imported when first called
    (``--help`` imports no torch)."""
    from redraft.infer.replies import EngineReplies

    return EngineReplies(target, settings)


def distill_data_main(argv: list[str] | None = None) -> int:
    """``redraft-distill-data``."""
    from redraft.data.distill import main

    with use_replies(engine_replies):
        return main(argv)


def train_main(argv: list[str] | None = None) -> int:
    """``redraft-train`` (its ``self_distill`` data made by the engine)."""
    from redraft.train.cli import main

    with use_replies(engine_replies):
        return main(argv)


def cache_features_main(argv: list[str] | None = None) -> int:
    """``redraft-cache-features`` (its ``self_distill`` data made by the engine)."""
    from redraft.train.cli import cache_features_main as main

    with use_replies(engine_replies):
        return main(argv)


# `python -m redraft.entry redraft-train ARGS...`: for launchers that take a module, not a
# console script (the deepspeed launcher's --module in dev/gpu/gpu_run_stages.py)
COMMANDS = {
    "redraft-train": train_main,
    "redraft-cache-features": cache_features_main,
    "redraft-distill-data": distill_data_main,
}


def module_main(argv: list[str]) -> int:
    """``argv`` holds a command name (not always first: the deepspeed launcher puts
    ``--local_rank=N`` before the script's arguments); the other arguments go to it in order."""
    at = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if at is None:
        print(f"usage: python -m redraft.entry {{{','.join(COMMANDS)}}} [ARGS...]", file=sys.stderr)
        return 2
    return COMMANDS[argv[at]](argv[:at] + argv[at + 1 :])


if __name__ == "__main__":
    sys.exit(module_main(sys.argv[1:]))

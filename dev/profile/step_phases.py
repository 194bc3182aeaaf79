"""Where a speculating engine step's host time goes, phase by phase, on the tiny target.

    python dev/profile/step_phases.py [--batch 64] [--tokens 100] [--threads 2] [--budget 4|auto]
        [--drafter context|ngrammys] [--prompt-tokens 64]

Builds the tiny random target of ``redraft-bench --overhead`` (and its n-gram tables), a
decoder as distillation makes one (``--drafter context``: the context n-gram drafter,
``text=False``, guard off) or the N-Grammys mix, adds ``--batch`` copies of a prompt and times
every phase of ``Engine.step`` (``propose``, ``build_tree``, ``verify``, ``logits``,
``choices``, ``accept``, ``feedback``, ...) over the steps where all rows decode; best of three
decodes. Prints ms per step per phase and ``host`` = step - verify - logits - choices (on a GPU
the last three are device work). To compare two versions, run it from each checkout
(``PYTHONPATH=<checkout>``), alternating. With ``--budget auto`` two processes may verify
different tree sizes (each measures its own cost curve), so compare fixed budgets.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", default="4", help="nodes a row, or auto")
    p.add_argument("--drafter", choices=("context", "ngrammys"), default="context")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=64,
        help="tokens per prompt (the benchmark's text tiled; distillation's rows are 300-800)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from redraft.bench.overhead import Timers, _prompts, tiny_setup
    from redraft.infer.config import DecoderConfig, SamplingParams
    from redraft.infer.decoder import SpeculativeDecoder
    from redraft.infer.drafters.ngram import ContextNGramDrafter
    from redraft.infer.engine import engine
    from redraft.infer.loader import make_drafters
    from redraft.infer.runner import verify
    from redraft.infer.spec import speculator

    timers = Timers()

    for a in ("propose", "build_tree", "choices", "accept", "feedback", "after_step"):
        timers.wrap(speculator.Speculator, a)
    for a in ("_host_state", "_upload", "_commit", "_emit", "_processors", "step"):
        timers.wrap(engine.Engine, a)
    for a in ("logits", "verify"):
        timers.wrap(verify.Verifier, a)

    budget = args.budget if args.budget == "auto" else int(args.budget)
    with tempfile.TemporaryDirectory(prefix="redraft-phases-") as tmp:
        target, tables = tiny_setup(Path(tmp))
        if args.drafter == "context":
            drafters = [ContextNGramDrafter(target.vocab_size)]
        else:
            drafters = make_drafters(target, (), [tables], DecoderConfig())
        dec = SpeculativeDecoder(target, drafters, budget=budget, prefill_chunk=0, guard=False)
        dec.eos = set()
        prompts = _prompts(target, args.batch)
        if args.prompt_tokens != 64:  # the text tiled, each row from its own offset
            ids = np.concatenate([prompts[0]] * (args.prompt_tokens // 64 + 2))
            prompts = [
                ids[i % 53 : i % 53 + args.prompt_tokens].tolist() for i in range(args.batch)
            ]

        def run(n):
            eng = dec.engine(text=False)
            for q in prompts:
                eng.add(q, SamplingParams.checked(max_new_tokens=n))
            eng.step()  # the prefill and the first step
            timers.take()
            steps, t = 0, time.perf_counter()
            while eng.has_work and len(eng.rows) == args.batch:
                eng.step()
                steps += 1
            return time.perf_counter() - t, max(steps, 1), timers.take()

        run(16)  # warm-up: the cost curve, packing
        wall, steps, phases = min((run(args.tokens) for _ in range(3)), key=lambda r: r[0] / r[1])
    ms = {k: 1e3 * v / steps for k, v in phases.items()}
    host = ms["step"] - ms.get("verify", 0) - ms.get("logits", 0) - ms.get("choices", 0)
    print(f"batch {args.batch}, budget {args.budget}, {steps} steps: host {host:.3f} ms/step")
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {k:12s} {v:8.3f}")


if __name__ == "__main__":
    main()

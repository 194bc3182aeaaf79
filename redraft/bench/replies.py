"""Distillation throughput: redraft's engine vs Hugging Face ``generate``, same run, same prompts.

    python -m redraft.bench.replies --prompts 16 --max-new-tokens 64 --dtype float32 \\
        --dtype bfloat16 --threads 1

For each dtype, the first user turn of ``--prompts`` held-out conversations of ``--data``
(chat template applied; those of at most ``--max-prompt-tokens``) gets a greedy reply from each
generator, ``--batch-size`` in flight as ``redraft-distill-data`` keeps them; prints new tokens/s
of each, the ratio, and whether the replies are identical token for token. One untimed warm-up
per generator and dtype first; with ``--rounds`` the fastest run of each, in alternating order.
"""

from __future__ import annotations

import time

from redraft.utils import ArgumentParser


def run_generator(gen, prompts: list[list[int]], batch_size: int) -> list[tuple[list[int], bool]]:
    """Every prompt's reply, at most ``batch_size`` in flight, refilled as replies finish."""
    todo, flying, out = list(enumerate(prompts)), 0, {}
    while todo or flying:
        while todo and flying < batch_size:
            key, p = todo.pop(0)
            gen.submit(key, p)
            flying += 1
        for key, toks, stopped in gen.poll():
            out[key] = (toks, stopped)
            flying -= 1
    return [out[k] for k in range(len(prompts))]


def measure(
    target, prompts, factories: dict, max_new_tokens: int, batch_size: int, rounds: int = 1
) -> dict:
    """``{name: (new tokens, seconds, replies, CPU seconds)}`` for each ``(target, settings) ->
    generator``: the fastest of ``rounds`` timed runs, the order of the generators reversed every
    round (a shared machine's load drifts). CPU seconds are this process's (all its threads):
    with one thread they depend much less on other jobs than the wall time does."""
    from redraft.data.replies import ReplySettings

    settings = ReplySettings(max_new_tokens, tuple(target.eos_token_ids), batch_size=batch_size)
    gens = {name: factory(target, settings) for name, factory in factories.items()}
    for gen in gens.values():
        run_generator(gen, prompts[:2], batch_size)  # warm-up (first-call costs), not timed
    out = {}
    for r in range(rounds):
        for name in list(gens)[:: 1 if r % 2 == 0 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            replies = run_generator(gens[name], prompts, batch_size)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            if name not in out or dt < out[name][1]:
                out[name] = (sum(len(t) for t, _ in replies), dt, replies, cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m redraft.bench.replies", description=__doc__)
    p.add_argument("--target", default="default")
    p.add_argument("--data", default="default-chat")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--max-prompt-tokens", type=int, default=256, help="skip longer prompts (the demo's 256)"
    )
    p.add_argument("--dtype", action="append", help="repeat for several (default: float32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1, help="timed runs each (the fastest counts)")
    args = p.parse_args(argv)

    import torch

    from redraft.data import heldout_prompts
    from redraft.data.replies import HFReplies
    from redraft.infer.replies import EngineReplies
    from redraft.models import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    chats = heldout_prompts(args.data, 8 * args.prompts)  # the first that fit are kept
    print(
        f"{args.prompts} prompts of <= {args.max_prompt_tokens} tokens x {args.max_new_tokens} new "
        f"tokens at most, batch {args.batch_size}, device {args.device}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(
        "| dtype | hf-generate tok/s | engine tok/s | engine / hf (wall) | engine / hf "
        "(tokens per CPU-second) | identical replies |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for dtype in args.dtype or ["float32"]:
        target = load_target(args.target, dtype=dtype, device=args.device)
        prompts = [ids for c in chats if len(ids := target.chat_ids(c)) <= args.max_prompt_tokens]
        prompts = prompts[: args.prompts]
        res = measure(
            target,
            prompts,
            {"hf-generate": HFReplies, "engine": EngineReplies},
            args.max_new_tokens,
            args.batch_size,
            args.rounds,
        )
        (nh, th, rh, ch), (ne, te, re, ce) = res["hf-generate"], res["engine"]
        same = sum(a == b for a, b in zip(rh, re))
        print(
            f"| {dtype} | {nh / th:.1f} ({nh} in {th:.1f} s) | {ne / te:.1f} ({ne} in {te:.1f} s) "
            f"| {(ne / te) / (nh / th):.2f}x | {(ne / ce) / (nh / ch):.2f}x "
            f"| {same}/{len(prompts)} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

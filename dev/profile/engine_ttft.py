"""8 streams x 3 rounds x 64 tokens through the engine, no HTTP: tokens/s and time to first token of
the speculative decoder (the context drafter, batched costs measured) against a plain one, twice.

    python dev/profile/engine_ttft.py

The load test's arrival pattern without the server
(benchmarks/results/cpu/serve-02-one-round-of-64-tokens-per-stream.md): each stream sends its
next held-out chat prompt when its previous request finishes.
"""

import time

import numpy as np
import torch

from redraft.data.prompts import load_prompts
from redraft.infer.decoder import SpeculativeDecoder
from redraft.infer.loader import load_decoder

torch.set_num_threads(2)
on = load_decoder("default", dtype="float32")
off = SpeculativeDecoder(on.target, [], on.config)
on.measure_batch_cost(16)
off.measure_cost()
ps = load_prompts("chat", 16)
enc = [on.encode(p)[0] for p in ps]
print("prompt tokens", [len(e) for e in enc])


def run(dec, label):
    eng = dec.engine()
    # warm
    eng.add(enc[0][:8], {"max_new_tokens": 4})
    while eng.has_work:
        eng.step()
    C, R = 8, 3
    queue = {k: [enc[(k + C * r) % len(enc)] for r in range(R)] for k in range(C)}
    rid2 = {}
    t_sub = {}
    ttft = []
    stepinfo = []

    def submit(k):
        if queue[k]:
            rid = eng.add(queue[k].pop(0), {"max_new_tokens": 64})
            rid2[rid] = k
            t_sub[rid] = time.perf_counter()

    for k in range(C):
        submit(k)
    seen = set()
    t0 = time.perf_counter()
    toks = 0
    while eng.has_work:
        ts = time.perf_counter()
        evs = eng.step()
        stepinfo.append(
            (
                round(1e3 * (time.perf_counter() - ts)),
                len(eng.rows),
                len(eng.prefilling),
                len(eng.waiting),
            )
        )
        for ev in evs:
            toks += len(ev.tokens)
            if ev.index not in seen:
                seen.add(ev.index)
                ttft.append(time.perf_counter() - t_sub[ev.index])
            if ev.done:
                submit(rid2[ev.index])
    wall = time.perf_counter() - t0
    step_p50 = np.median([s[0] for s in stepinfo])
    print(
        f"{label}: {toks / wall:.1f} tok/s, TTFT p50 {1e3 * np.median(ttft):.0f} ms, "
        f"steps {len(stepinfo)}, step p50 {step_p50:.0f} ms",
        flush=True,
    )
    return stepinfo


for _ in range(2):
    a = run(off, "off")
    b = run(on, "on")
print("off steps with prefilling:", sum(1 for s in a if s[2]), "on:", sum(1 for s in b if s[2]))
print("on sample", b[:60])

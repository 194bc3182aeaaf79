"""Host ms per decode step, the same procedure for two versions of redraft: run it with
PYTHONPATH pointing at either checkout (e.g. a worktree of an older tag), then compare the JSON
lines. `redraft-bench --overhead` measures the current code; this script exists because older
versions have no --overhead (it speaks both the old make_drafters API and DecoderConfig).

    PYTHONPATH=/path/to/old python dev/profile/overhead_ab.py greedy,context-16,context-64,ngrammys,mix-aded
    python dev/profile/overhead_ab.py greedy,context-16,context-64,ngrammys,mix-aded
"""

import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
from redraft.infer import loader
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.models import load_target
from redraft.models.tiny import make_tiny_target_dir
from redraft.ngrams import (
    NGramTables,
    build_bigram,
    build_extended,
    build_trigram_table,
    count_trigrams,
    save_tables,
)

TEXT = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    "Speculative decoding drafts tokens and the target verifies them in one pass. "
)
tmp = Path(tempfile.mkdtemp())
target = load_target(
    str(make_tiny_target_dir(tmp / "t", hidden_size=32, num_layers=1)),
    dtype="float32",
    device="cpu",
)
V = target.vocab_size
bigram = build_bigram(target, k=8)
extended = build_extended(bigram[0], w=4, k=8)
docs = [
    np.asarray(g.tokens)
    for g in plain_greedy(
        target, [TEXT[i : i + 60] for i in range(0, len(TEXT) - 60, 15)], max_new_tokens=64
    )
]
tri = build_trigram_table(count_trigrams(docs, V), t=12)
save_tables(
    tmp / "ng",
    dict(target.artifact_metadata(), vocab_size=V),
    bigram=bigram,
    extended=extended,
    trigram=tri,
)
tables = NGramTables.load(tmp / "ng", target=target)
new_api = "cfg" in inspect.signature(loader.make_drafters).parameters


def make(name):
    from redraft.infer.drafters.ngram import ContextNGramDrafter

    if name == "greedy":
        return SpeculativeDecoder(target, [], budget=0)
    if name.startswith("context-"):
        return SpeculativeDecoder(
            target,
            [ContextNGramDrafter(V, q=1, q_max=3, k=8, w=12)],
            budget=int(name.split("-")[1]),
        )
    aded = name == "mix-aded"
    if new_api:
        from redraft.infer.config import DecoderConfig

        cfg = DecoderConfig(
            aded=aded, **({"guard": False} if "guard" in DecoderConfig.__dataclass_fields__ else {})
        )
        return SpeculativeDecoder(target, loader.make_drafters(target, (), [tables], cfg), cfg)
    return SpeculativeDecoder(target, loader.make_drafters(target, (), [tables], aded=aded))


def timed(dec):
    box = {"s": 0.0}
    obj = dec.verifier if hasattr(dec, "verifier") else dec
    attr = (
        "_model" if hasattr(obj, "_model") else "_forward"
    )  # the model call alone, in every version
    orig = getattr(obj, attr)

    def f(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        box["s"] += time.perf_counter() - t
        return r

    setattr(obj, attr, f)
    return box


ids = target.tokenizer(TEXT * 2, add_special_tokens=False)["input_ids"]


def prompts(B):
    return [ids[i * 7 % 40 : i * 7 % 40 + 64] for i in range(B)]


N = int(sys.argv[2]) if len(sys.argv) > 2 else 200
for name in sys.argv[1].split(","):
    for B in (1, 8):
        dec = make(name)
        dec.eos = set()
        box = timed(dec)
        dec.generate(prompts(B), max_new_tokens=16)
        best = None
        for _ in range(5):
            box["s"] = 0.0
            t0 = time.perf_counter()
            out = dec.generate(prompts(B), max_new_tokens=N)
            wall = time.perf_counter() - t0
            steps = max(g.stats.target_calls for g in out) - 1
            host = (wall - box["s"]) / steps * 1e3
            fwd = box["s"] / (steps + 1) * 1e3
            if best is None or host < best[0]:
                best = (host, fwd, steps)
        print(
            json.dumps(
                {
                    "code": "new" if new_api else "old",
                    "method": name,
                    "batch": B,
                    "host_ms_per_step": round(best[0], 3),
                    "forward_ms": round(best[1], 3),
                    "steps": best[2],
                }
            ),
            flush=True,
        )

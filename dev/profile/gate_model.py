"""A closed-loop model of the drafter gate (`redraft.infer.spec.gate.DrafterGate`) with two drafters.

    python dev/profile/gate_model.py [--gate module:Class] [--seeds 8] [--steps 3000]

Each step the gate picks the drafters to call; each drafter "gets" a number of accepted tokens
drawn from a correlated Poisson model (a shared per-step easiness seen with probability ``rho``,
so two drafters of one kind propose the same easy tokens), drafter 0 (N-Grammys-like: cheap,
context n-grams) is silent for the first ``silent`` steps of every reply; the step accepts the
best called drafter's tokens and costs ``verify + drafting``. Prints tokens per millisecond of
the gate against fixed choices (drafter 0 alone, 1 alone, both) and how often each is called.

Why it exists: a GPU run showed the mix locked into a head that alone was
slower than N-Grammys (docs/infer.md). Two gate changes were tried on the CPU and reverted; a
third (re-tries as 3-step trials side by side, gains measured only there) fixed the lock-in in a
*deterministic* version of this model (0.370 -> 0.454 tokens/ms, N-Grammys alone 0.46) but was
worse than the shipped gate in every case of this noisy one (e.g. 0.417 against 0.448; fixed
N-Grammys 0.457): with per-step noise the shipped gate leaves a wrong choice by itself. Try a
new gate here first (``--gate mymodule:MyGate``), then on the GPU's e2 stage.
"""

from __future__ import annotations

import argparse
import importlib

import numpy as np

CASES = {  # name: (mean tokens alone (0, 1), rho, drafting ms (0, 1), verify ms)
    "H200-like: 0 better and cheaper": ((1.0, 0.85), 0.8, (0.66, 1.5), 3.5),
    "H200-like: 1 better alone": ((0.8, 1.6), 0.8, (0.66, 1.5), 3.5),
    "similar, low correlation": ((1.0, 1.0), 0.3, (0.66, 1.5), 3.5),
    "CPU-like: verify dear": ((0.9, 0.7), 0.8, (0.7, 6.0), 50.0),
    "CPU-like: 1 good": ((0.9, 1.3), 0.8, (0.7, 6.0), 50.0),
}


class Fixed:
    """A "gate" that always calls the same drafters."""

    def __init__(self, active):
        self.a = list(active)

    def active(self):
        return self.a

    def record_time(self, *a):
        pass

    def update(self, *a):
        pass


def simulate(gate, means, rho, cost, verify, silent=6, reply=60, steps=3000, seed=0):
    """``(tokens per ms, fraction of steps each drafter was called)``."""
    rng = np.random.default_rng(seed)
    toks = t = 0.0
    calls = np.zeros(2)
    for s in range(steps):
        act = gate.active()
        for i in act:
            gate.record_time(i, cost[i])
            calls[i] += 1
        e = rng.poisson(1.0)  # the step's shared easiness
        a = []
        for i in range(2):
            m = 0.0 if i == 0 and s % reply < silent else means[i]
            a.append(rng.poisson(m * e) if rng.random() < rho else rng.poisson(m))
        n = max([a[i] for i in act], default=0)
        dt = verify + sum(cost[i] for i in act)
        toks, t = toks + n + 1, t + dt
        excl = {i: max(0, n - max([a[j] for j in act if j != i], default=0)) for i in act}
        gate.update(dt, n + 1.0, excl)
    return toks / t, calls / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gate", default="redraft.infer.spec.gate:DrafterGate", help="module:Class")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args()
    mod, cls = args.gate.split(":")
    Gate = getattr(importlib.import_module(mod), cls)
    for name, (means, rho, cost, verify) in CASES.items():
        kw = dict(means=means, rho=rho, cost=cost, verify=verify, steps=args.steps)
        runs = [simulate(Gate(2, explore=8), seed=s, **kw) for s in range(args.seeds)]
        ref = {
            lab: np.mean([simulate(Fixed(a), seed=s, **kw)[0] for s in range(args.seeds)])
            for lab, a in (("0 alone", [0]), ("1 alone", [1]), ("both", [0, 1]))
        }
        share = np.mean([r[1] for r in runs], axis=0)
        print(
            f"{name:34s} gate {np.mean([r[0] for r in runs]):.3f} tokens/ms "
            f"(calls 0: {share[0]:.2f}, 1: {share[1]:.2f}); "
            + ", ".join(f"{k} {v:.3f}" for k, v in ref.items())
        )


if __name__ == "__main__":
    main()

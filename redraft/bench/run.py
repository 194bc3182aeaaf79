"""``redraft-bench``'s runner: every method decodes every prompt (prompts are the outer loop, so
machine noise hits all methods alike; vLLM's engines by default each in a pass of their own,
one engine alive at a time), every figure against plain greedy measured in the same run, and
the aggregates handed back after every prompt so a run stopped early keeps them."""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redraft.bench.concurrent import concurrency_table, forget, peer_passes, split_peers
from redraft.bench.methods import Method
from redraft.infer.config import DecoderConfig


@dataclass
class Context:
    """What methods are built from: the target, loaded artifacts, the decoder settings."""

    target: object
    tables: list
    heads: list
    cfg: DecoderConfig
    bench: dict
    retrieval_index: str | None = None
    vllm_model_dir: object = None  # the HF folder vLLM loads, made at the first vllm-* method


class Runner:
    """One method, ready to decode: ``run(ids) -> (new token ids, RequestStats or None)``."""

    def __init__(self, name: str, ctx: Context, method: Method, cfg: DecoderConfig | None = None):
        from redraft.infer.decoder import SpeculativeDecoder

        self.name, self.ctx = name, ctx
        # a twin's drafters are built with its setting too (ngram_w, suffix_w, ...), not only
        # its decoder
        built = method.build(ctx if cfg is None else dataclasses.replace(ctx, cfg=cfg))
        self.decoder = self.peer = None
        if built == "vllm":
            from redraft.vllm.peer import VLLMRunner, model_dir_for

            if ctx.vllm_model_dir is None:
                ctx.vllm_model_dir = model_dir_for(ctx.bench["target"])
            ngrams = next((str(t.path) for t in ctx.tables if t.path is not None), None)
            self.peer = VLLMRunner(name, ctx.vllm_model_dir, ctx.bench, ngrams)
        elif built == "hf":
            self.hf_kwargs = method.hf_kwargs(ctx) if method.hf_kwargs else {}
        else:
            cfg = cfg or ctx.cfg
            cfg = cfg if built else cfg.replace(budget=0)
            self.decoder = SpeculativeDecoder(ctx.target, built, cfg)

    def run(self, ids: list[int]):
        n = self.ctx.bench["max_new_tokens"]
        if self.peer is not None:
            return self.peer.run(ids)
        if self.decoder is not None:
            g = self.decoder.generate([ids], max_new_tokens=n)[0]
            return g.tokens, g.stats
        import torch

        from redraft.infer.runner.sdpa import sdpa_backends

        target = self.ctx.target
        x = torch.tensor([ids], device=target.device)
        eos = target.eos_token_ids
        # on CUDA no cuDNN attention, like redraft's own forwards (it plans anew for every shape:
        # ~30 ms of CPU a call on a GPU), so the hf-* baselines are not slowed by it
        with torch.no_grad(), sdpa_backends(target.device, flash=True):
            out = target.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                **self.hf_kwargs,
            )
        return out[0, len(ids) :].tolist(), None


@dataclass
class _Agg:
    """One method's figures over the prompts it finished (per prompt: seconds, new tokens)."""

    stats: object
    times: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    identical: int = 0
    outputs: list = field(default_factory=list)  # per prompt: the new token ids
    hf: bool = False
    peer: bool = False  # another engine (vLLM): tau from its counters, no per-step stats
    error: str | None = None
    graphs: dict | None = None  # the decoder's Verifier.graph_stats since the timed prompts began

    def add(self, dt: float, toks: list, ref, st) -> None:
        self.times.append(dt)
        self.tokens.append(len(toks))
        self.identical += int(toks == ref)
        self.outputs.append(toks)
        if st is None:
            self.hf = True
            return
        s = self.stats
        s.new_tokens += st.new_tokens
        s.target_calls += st.target_calls
        s.accepted_hist.update(st.accepted_hist)
        s.drafter_accepted.update(st.drafter_accepted)
        s.drafter_calls.update(st.drafter_calls)
        s.drafter_exclusive.update(st.drafter_exclusive)
        s.joint_steps += st.joint_steps
        s.draft_time += st.draft_time
        s.verify_time += st.verify_time
        s.prefill_time += st.prefill_time
        s.tree_nodes += st.tree_nodes


def _failed(name: str, exc: BaseException, where: str) -> str:
    """Report a method that raised (with its traceback: it is a bug) and return the one line kept."""
    line = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    print(
        f"redraft-bench: method {name!r} failed {where} and is left out of the rest of the run: {line}",
        file=sys.stderr,
    )
    traceback.print_exc(file=sys.stderr)
    return f"{line} ({where})"


def run_dataset(
    runners: dict,
    prompts: list[list[int]],
    bench: dict,
    label: str,
    on_prompt: Callable[[dict], None] | None = None,
) -> dict:
    """Decode every prompt with every method (prompt-major); returns per-method aggregates.

    With ``vllm_engines: one`` (the default) vLLM's methods come after redraft's, each in a pass
    of its own over the prompts with its engine alive only for that pass (:func:`peer_passes`).
    ``on_prompt(results)`` gets the aggregates so far after every prompt (the caller writes
    them). A method that raises is reported with its error and left out of the later prompts;
    the baseline (greedy) raising ends the run, since nothing can be compared without it.
    """
    from tqdm.auto import tqdm

    from redraft.infer.stats import RequestStats

    agg = {
        m: _Agg(RequestStats(target_calls=0), peer=r.peer is not None) for m, r in runners.items()
    }
    own, later = split_peers(runners, bench)
    refs: list = []  # greedy's output per prompt: what every method is compared with

    def decode(group: dict, i: int, ids: list[int]) -> None:
        for name, r in group.items():
            a = agg[name]
            if a.error:
                continue
            t0 = time.perf_counter()
            got = _guarded(name, a, f"on {label} prompt {i}", lambda r=r: r.run(ids))
            if got is None:
                continue
            toks, st = got
            if name == "greedy":
                refs.append(toks)
            a.add(time.perf_counter() - t0, toks, refs[i] if i < len(refs) else None, st)
        if on_prompt is not None:
            on_prompt(summarise(agg))

    def warm(group: dict) -> None:
        forget(group)  # each pass starts empty, as vLLM's engine does
        if bench["warmup"]:
            for name, r in group.items():
                _guarded(name, agg[name], "in its warm-up", lambda r=r: r.run(prompts[0][:32]))
        for name, r in group.items():  # count the graphs of the timed prompts only
            if r.decoder is not None:
                r.decoder.verifier.graph_stats = agg[name].graphs = dict.fromkeys(
                    r.decoder.verifier.graph_stats, 0
                )

    warm(own)
    for i, ids in enumerate(tqdm(prompts, desc=f"bench {label}", unit="prompt")):
        decode(own, i, ids)
    for name, group in peer_passes(later, agg):
        warm(group)
        for i, ids in enumerate(tqdm(prompts, desc=f"bench {label} {name}", unit="prompt")):
            decode(group, i, ids)
    return summarise(agg)


def _guarded(name: str, a: _Agg, where: str, fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (one method's failure must not cost the others' table)
        if name == "greedy":
            raise
        a.error = _failed(name, exc, where)
        return None


def summarise(agg: dict) -> dict:
    """The result rows from the aggregates; speedups against greedy over the same prompts."""
    base = agg["greedy"]
    res = {}
    for name, a in agg.items():
        n = len(a.times)
        base_tps = sum(base.tokens[:n]) / max(sum(base.times[:n]), 1e-9)
        tps = sum(a.tokens) / max(sum(a.times), 1e-9)
        s, none = a.stats, a.hf or not n
        steps = s.verify_steps
        steps_known = not none
        res[name] = {
            "tokens_per_call": None if none else round(s.tokens_per_call, 3),
            "mean_accepted_length": round(s.mean_accepted_length, 3) if steps_known else None,
            "acceptance_per_position": [round(x, 3) for x in s.acceptance_per_position()]
            if steps_known
            else [],
            "tokens_per_s": round(tps, 2),
            "speedup_vs_ar": round(tps / base_tps, 3) if n else 0.0,
            "identical_to_ar": bool(n) and a.identical == len(base.times),
            "identical_prompts": f"{a.identical}/{len(base.times)}",
            "new_tokens": sum(a.tokens),
            "time_s": round(sum(a.times), 2),
            "draft_time_s": round(s.draft_time, 2),
            "verify_time_s": round(s.verify_time, 2),
            "prefill_time_s": round(s.prefill_time, 4),
            # the rest of the wall time: acceptance, the cache commit, bookkeeping, captures
            "other_time_s": None
            if a.hf or a.peer
            else round(sum(a.times) - s.draft_time - s.verify_time - s.prefill_time, 4),
            "tree_nodes_per_step": round(s.tree_nodes / steps, 2) if steps else 0.0,
            "accepted_hist": {int(k): v for k, v in sorted(Counter(s.accepted_hist).items())},
            "drafter_share": {k: round(v, 3) for k, v in s.drafter_share().items()},
            # the gate's view: the share of verify steps each drafter was called in, and its
            # accepted tokens that no other called drafter proposed per step called side by side
            "drafter_called": {k: round(v / max(steps, 1), 3) for k, v in s.drafter_calls.items()},
            "drafter_exclusive_per_joint_step": {
                k: round(s.drafter_exclusive[k] / s.joint_steps, 3) for k in s.drafter_calls
            }
            if s.joint_steps
            else {},
            "joint_steps": s.joint_steps,
            "prompts": n,
        }
        v = agg.get("vllm")
        if v is not None and n and v.times:  # vLLM plain in the run: every method against it
            m = min(n, len(v.times))
            v_tps = sum(v.tokens[:m]) / max(sum(v.times[:m]), 1e-9)
            same = sum(x == y for x, y in zip(a.outputs, v.outputs))
            res[name]["speedup_vs_vllm"] = round(tps / v_tps, 3)
            res[name]["identical_to_vllm"] = f"{same}/{m}"
        if a.graphs is not None:
            res[name]["graphs"] = {k: round(v, 3) for k, v in a.graphs.items()}
            if base.graphs is not None and n and n == len(base.times):
                # what a long-running server sees: each graph shape is captured once in its life,
                # so a short run's first-use captures (up to a third of a method's time in a run
                # of a few prompts on a GPU) are left out of both sides
                t = sum(a.times) - a.graphs.get("capture_s", 0.0)
                tb = sum(base.times) - base.graphs.get("capture_s", 0.0)
                if t > 0 and tb > 0:
                    res[name]["speedup_without_captures"] = round(
                        (sum(a.tokens) / t) / (sum(base.tokens) / tb), 3
                    )
        if a.error:
            res[name]["error"] = a.error
    return res


def markdown(
    results: dict,
    bench: dict,
    device: str,
    skipped: dict | None = None,
    concurrent: dict | None = None,
) -> str:
    lines = [
        f"redraft-bench: target {bench['target']} ({bench['dtype']}), {device}, greedy, "
        f"{bench['max_new_tokens']} new tokens; speedup vs plain greedy (ours) in the same run. tau = new "
        f"tokens per target call (prefill included); MAL = mean accepted length (accepted draft tokens + 1 "
        f"per verify step, vLLM / Spec-Bench).",
        "",
    ]
    for ds, res in results.items():
        lines += [f"### {ds}", ""]
        if (skipped or {}).get(ds):
            lines += [
                f"{len(skipped[ds])} prompt(s) skipped: longer than the target's context less the new tokens "
                f"(prompts {', '.join(str(x['prompt']) for x in skipped[ds])}).",
                "",
            ]
        if res:  # (empty: --concurrency without 1)
            # graphs captured during the run (CUDA): the speedup without their seconds as well
            steady = any(r.get("graphs", {}).get("captures") for r in res.values())
            peer = any("speedup_vs_vllm" in r for r in res.values())  # vLLM plain in the run
            lines += [
                "| method | tau | MAL | tokens/s | speedup vs AR |"
                + (" without captures |" if steady else "")
                + (" vs vLLM plain | identical to vLLM |" if peer else "")
                + " identical to AR |",
                "|---|---:|---:|---:|---:|"
                + ("---:|" if steady else "")
                + ("---:|:---:|" if peer else "")
                + ":---:|",
            ]
            for name, r in res.items():
                tau = "-" if r["tokens_per_call"] is None else f"{r['tokens_per_call']:.2f}"
                mal = (
                    "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
                )
                same = f"{'yes' if r['identical_to_ar'] else 'no'} ({r['identical_prompts']})"
                if r.get("error"):
                    same += f"; failed after {r.get('prompts', 0)} prompt(s): {r['error'][:120]}"
                nocap = r.get("speedup_without_captures")
                extra = (" - |" if nocap is None else f" {nocap:.2f}x |") if steady else ""
                if peer:
                    v = r.get("speedup_vs_vllm")
                    extra += f" {'-' if v is None else f'{v:.2f}x'} | {r.get('identical_to_vllm', '-')} |"
                lines.append(
                    f"| {name} | {tau} | {mal} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x |"
                    f"{extra} {same} |"
                )
            lines += ["", *time_split(res), ""]
        if (concurrent or {}).get(ds):
            lines += [*concurrency_table(concurrent[ds]), ""]
        mixes = drafter_split(res)
        if mixes:
            lines += [*mixes, ""]
    return "\n".join(lines)


def drafter_split(res: dict) -> list[str]:
    """For each method with several drafters: each drafter's share of the accepted draft tokens
    (shared tokens count for each), the share of verify steps the gate called it in, and the
    accepted tokens only it proposed per step called beside the others (what the gate weighs
    against its drafting time). Empty when no method mixes drafters."""
    rows = []
    for name, r in res.items():
        called = r.get("drafter_called") or {}
        if len(called) < 2:
            continue
        share, excl = r.get("drafter_share") or {}, r.get("drafter_exclusive_per_joint_step") or {}
        for d in called:
            rows.append(
                f"| {name} | {d} | {share.get(d, 0.0):.3f} | {called[d]:.3f} | "
                + (f"{excl[d]:.3f} |" if d in excl else "- |")
            )
    if not rows:
        return []
    return [
        "| method | drafter | share of accepted tokens | steps called | exclusive tokens per "
        "joint step |",
        "|---|---|---:|---:|---:|",
        *rows,
    ]


def time_split(res: dict) -> list[str]:
    """Where each method's wall time went (seconds over the dataset's prompts): prefill
    forwards, drafting (with the tree and its upload), the verify forward and the rule's pick
    (on a GPU: device time between events), the rest (acceptance, the cache commit, bookkeeping,
    graph captures), and how the static verifies ran (replayed graphs, eager forwards,
    captures and their seconds; empty where shapes are dynamic, as on a CPU)."""
    rows = [
        "| method | time s | prefill | draft | verify | other | steps | replays / eager / captures (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in res.items():
        if r.get("other_time_s") is None:
            continue
        g = r.get("graphs") or {}
        graphs = (
            f"{g['replays']} / {g['eager']} / {g['captures']} ({g['capture_s']:.2f})"
            + (f", {g['failed']} failed" if g.get("failed") else "")
            if g.get("replays") or g.get("eager")
            else "-"
        )
        steps = sum(r["accepted_hist"].values())
        rows.append(
            f"| {name} | {r['time_s']:.2f} | {r['prefill_time_s']:.2f} | {r['draft_time_s']:.2f} "
            f"| {r['verify_time_s']:.2f} | {r['other_time_s']:.2f} | {steps} | {graphs} |"
        )
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def device_name(device) -> str:
    import torch

    return (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU {cpu_name()}, {torch.get_num_threads()} threads"
    )


def cost_curve(runners: dict, bench: dict) -> dict:
    """One verify-cost curve for every method of the run (measured once, or given); with
    ``--concurrency`` above 1, also their batched verify costs up to the largest, measured once
    as redraft-serve measures them at warm-up (the budget costs a batch's tree from them and the
    speculation guard starts each batch size from their verdict; without them the first passes
    explored speculation blind, trees of 30 nodes a row at 16 rows, a second a step)."""
    from redraft.infer.runner.cost import CostCurve

    curve = CostCurve.from_ms(bench["cost_curve_ms"]) if bench["cost_curve_ms"] else None
    top, batched = max(bench.get("concurrency") or [1]), None
    for r in runners.values():
        dec = r.decoder
        if dec is not None and dec.drafters and dec.config.budget == "auto":
            curve = curve or dec.measure_cost()
            dec.cost_curve = curve
            if top > 1 and dec.guard.enabled:
                batched = batched or dec.measure_batch_cost(top)
                dec.batch_cost = batched
    return {} if curve is None else {**curve.to_dict(), "given": bool(bench["cost_curve_ms"])}

"""``redraft-bench``'s passes beyond one prompt at a time: vLLM's engines one at a time (each in
a pass of its own over the prompts), and the concurrent-requests runs (``--concurrency``)."""

from __future__ import annotations

import time


def split_peers(runners: dict, bench: dict) -> tuple[dict, dict]:
    """(methods decoded together, vLLM methods that get a pass of their own each)."""
    if bench.get("vllm_engines", "one") != "one":
        return runners, {}
    own = {k: r for k, r in runners.items() if r.peer is None}
    return own, {k: r for k, r in runners.items() if r.peer is not None}


def forget(runners: dict) -> None:
    """redraft's decoders forget earlier requests (their prefix caches, the suffix drafter's
    global tree: :meth:`~redraft.infer.decoder.SpeculativeDecoder.forget`) before a pass over
    the prompts, as each vLLM method's engine starts its pass empty (:func:`peer_passes`):
    otherwise a pass at a concurrency found every prompt of the pass before in the cache."""
    for r in runners.values():
        if r.decoder is not None:
            r.decoder.forget()


def peer_passes(later: dict, agg: dict | None = None):
    """Yield ``(name, {name: runner})`` for each vLLM method in turn, its engine started before
    and shut down after its pass: only one engine is alive at a time (an idle engine's
    processes poll on the cores the decoding method uses) and each pass starts with empty
    caches (vLLM's prefix cache, its suffix trees)."""
    for name, r in later.items():
        if agg is not None and agg[name].error:
            continue
        try:
            yield name, {name: r}
        finally:
            r.peer.close()


def run_concurrent(runners: dict, prompts: list[list[int]], bench: dict, c: int) -> dict:
    """Every method decodes all ``prompts``, ``c`` submitted at a time (redraft's engine batches
    them as rows; vLLM schedules them); tokens/s over the whole set. transformers' ``generate``
    (hf-*) has no such batching and is left out. Outputs are compared with the same engine's
    plain decoding at the same concurrency (batched float32 kernels may round differently from
    batch 1). Group-major: each group of ``c`` prompts is decoded by every method in turn, so
    the methods share the machine's drift; with ``vllm_engines: one`` each vLLM method then
    decodes every group in a pass of its own, a fresh engine (:func:`peer_passes`)."""
    n = bench["max_new_tokens"]
    live = {k: r for k, r in runners.items() if r.decoder is not None or r.peer is not None}
    outs: dict = {name: [] for name in live}
    took = dict.fromkeys(live, 0.0)

    def decode(group: dict) -> None:
        for i in range(0, len(prompts), c):
            batch = prompts[i : i + c]
            for name, r in group.items():
                t0 = time.perf_counter()
                if r.peer is not None:
                    outs[name] += r.peer.run_batch(batch)
                else:
                    outs[name] += [g.tokens for g in r.decoder.generate(batch, max_new_tokens=n)]
                took[name] += time.perf_counter() - t0

    own, later = split_peers(live, bench)
    forget(own)
    decode(own)
    for _, group in peer_passes(later):
        if bench["warmup"]:
            next(iter(group.values())).peer.run_batch([prompts[0][:32]])
        decode(group)
    res = {
        name: {
            "tokens_per_s": round(sum(map(len, outs[name])) / max(took[name], 1e-9), 2),
            "time_s": round(took[name], 2),
        }
        for name in live
    }
    for name, row in res.items():
        plain = "vllm" if runners[name].peer is not None else "greedy"
        if plain in outs:
            same = sum(x == y for x, y in zip(outs[name], outs[plain]))
            row["identical_to_plain"] = f"{same}/{len(prompts)}"
        for base in ("greedy", "vllm"):
            if base in res:
                row[f"speedup_vs_{'ar' if base == 'greedy' else 'vllm'}"] = round(
                    row["tokens_per_s"] / max(res[base]["tokens_per_s"], 1e-9), 3
                )
    return res


def concurrency_table(by_c: dict) -> list[str]:
    """The ``--concurrency`` runs of one dataset: tokens/s per method and concurrency."""
    cs = sorted(by_c, key=int)
    names = list(dict.fromkeys(m for c in cs for m in by_c[c]))
    peer = any("speedup_vs_vllm" in r for c in cs for r in by_c[c].values())
    head = "| method |" + "".join(
        f" {c} req tok/s | vs AR |" + (" vs vLLM |" if peer else "") for c in cs
    )
    lines = [
        f"Concurrent requests ({', '.join(cs)} at a time; identical = the same engine's plain "
        f"decoding at that concurrency):",
        "",
        head + " identical |",
        "|---|" + ("---:|---:|" + ("---:|" if peer else "")) * len(cs) + ":---:|",
    ]
    for m in names:
        cells, same = [], []
        for c in cs:
            r = by_c[c].get(m)
            if r is None:
                cells.append(" - | - |" + (" - |" if peer else ""))
                continue
            cells.append(
                f" {r['tokens_per_s']:.1f} | {r.get('speedup_vs_ar', 0):.2f}x |"
                + (
                    f" {r['speedup_vs_vllm']:.2f}x |"
                    if "speedup_vs_vllm" in r
                    else (" - |" if peer else "")
                )
            )
            same.append(r.get("identical_to_plain", "-"))
        lines.append(f"| {m} |" + "".join(cells) + f" {', '.join(same)} |")
    return lines

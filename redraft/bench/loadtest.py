"""Load benchmark for redraft-serve: N concurrent streams, speculation on and off, in one run.

    # start both servers itself (speculation on, and the same flags with --no-speculation):
    python -m redraft.bench.loadtest --spawn "--preset infer/decode-default.yaml" --markdown docs-table.md
    # or measure running servers (label each):
    python -m redraft.bench.loadtest http://127.0.0.1:8000 http://127.0.0.1:8001 --labels on,off

For each concurrency level (1, 2, 4, 8, 16 by default) and each server, ``C`` workers send
streamed chat/completion requests back to back (``--rounds`` each), greedy, ``--max-tokens``
new tokens, over the same prompt sequence for every server (held-out ShareGPT chats by default,
the prompts ``redraft-bench`` uses). Levels are the outer loop and servers the inner one, so
machine noise hits both alike. Per level and server:

* output tokens/s: completion tokens of all requests / wall time of the level;
* TTFT: request sent -> first content chunk (p50, p99);
* ITL: gap between consecutive content chunks (p50, p99) -- with speculation a chunk may hold
  several tokens, so TPOT (time per output token after the first, mean) is given too;
* tokens per target call, mean accepted length and draft nodes verified per row per step
  (from each response's ``redraft`` field: the last shows the per-row budget shrinking with
  the batch);
* ``identical``: every output equals the first server's output for the same prompt.

Progress lines (one per level and server) go to stderr as the levels finish; stdout holds the
Markdown table alone, once, at the end (``... > table.md`` keeps just the table).

The first server is the reference for the ratios (``x ref``); with ``--spawn`` it is "off".
``--control`` (with ``--spawn``) starts a second reference server, "off2", measured like the
others: its ratio is what two processes of the same code differ by in this run. On a small
CPU, one round of 64 tokens, it ranged 0.74-1.34 per run of a level
(docs/design/0005-serving-speculation-guard.md): a ratio inside the control's range is not a difference.

``--scenario long-join`` (chunked prefill): ``C`` streams (``--concurrency``, one level) decode
back to back; after ``--join-after`` seconds one request with a ``--long-tokens`` prompt joins
them. Per server: the streams' ITL median before the join, their ITL p50 / p99 while the long
request runs (from its sending to its end: its prefill, then 8 tokens) and the ratio p99-during / median-before
(it should stay <= 3), the long request's TTFT. With ``--spawn`` the servers are "chunk-off"
(``ARGS --prefill-chunk 0``: every prompt in one forward) and "chunk-auto" (``ARGS``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from redraft.bench.loadtest_report import (  # noqa: F401 (the load test's public names)
    long_join_markdown,
    long_prompt_text,
    markdown,
    summarize,
    summary_markdown,
)
from redraft.bench.servers import spawn, spawn_lines, wait_ready  # noqa: F401
from redraft.serve.cli import HelpFormatter

LEVELS = (1, 2, 4, 8, 16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m redraft.bench.loadtest",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("urls", nargs="*", help="base URLs of running servers (http://HOST:PORT)")
    p.add_argument(
        "--labels", default=None, help="comma-separated names of the URLs (default: the URLs)"
    )
    p.add_argument(
        "--spawn",
        default=None,
        metavar="ARGS",
        help="start 'redraft-serve ARGS --no-speculation' (off) and 'redraft-serve ARGS' (on) on free "
        "ports instead of URLs, and stop them at the end",
    )
    p.add_argument(
        "--concurrency", default=",".join(map(str, LEVELS)), help="comma-separated stream counts"
    )
    p.add_argument("--rounds", type=int, default=2, help="requests each stream sends per level")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every level; run r measures the servers in an order rotated by r (so "
        "none always goes first), and with 2 or more a summary table gives each level's ratio "
        "to the reference as the mean and range over the runs (one round of a level is mostly "
        "arrival timing: its ratio moves by tens of percent between runs of one code)",
    )
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="with --spawn: one more server, 'redraft-serve ARGS', labelled LABEL (repeatable), "
        "e.g. --also 'on-share2=--target default --prefill-share 2' to compare two settings of 'on' "
        "in the same run",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="with --spawn: one more server with the reference's own flags (labelled 'off2', or "
        "'chunk-off2' in long-join), measured like the others: its ratio to the reference is the "
        "run's noise (two processes of one code differ by tens of percent in one round on a small "
        "CPU), so a ratio inside the control's range is not a difference",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument(
        "--dataset",
        default="chat",
        help="'chat' (held-out ShareGPT), 'code' (HumanEval) or a JSONL file",
    )
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (cycled)")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $REDRAFT_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", default=None, help="write all figures as JSON here")
    p.add_argument("--markdown", default=None, help="write the table as Markdown here")
    p.add_argument(
        "--scenario",
        default="levels",
        choices=["levels", "long-join"],
        help="'levels': every concurrency level; 'long-join': a long prompt joins running streams",
    )
    p.add_argument(
        "--long-tokens", type=int, default=4000, help="long-join: about this many prompt tokens"
    )
    p.add_argument(
        "--join-after",
        type=float,
        default=5.0,
        help="long-join: seconds of decoding before it joins",
    )
    return p


# ---------------------------------------------------------------------------------- one request


async def one_request(client, url: str, prompt, max_tokens: int, timeout: float) -> dict:
    """Send one streamed request; returns its timings, text and the ``redraft`` stats."""
    chat = isinstance(prompt, list)
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"messages": prompt} if chat else {"prompt": prompt}),
    }
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    chunks, text, usage, stats = [], [], None, {}
    async with client.stream("POST", url + path, json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"{url}{path}: HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
            )
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"{url}{path}: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                piece = ch["delta"].get("content") if chat else ch.get("text")
                if piece:
                    chunks.append(time.perf_counter())
                    text.append(piece)
            stats = obj.get("redraft") or stats
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {
        "t0": t0,
        "chunks": chunks,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "ttft": chunks[0] - t0 if chunks else None,
        "gaps": [b - a for a, b in zip(chunks, chunks[1:])],
        "tpot": (chunks[-1] - chunks[0]) / (n - 1) if chunks and n > 1 else None,
        "tokens": n,
        "text": "".join(text),
        "end": t_end,
        "stats": stats,
    }


async def run_level(
    url: str,
    prompts: list,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    timeout: float,
    headers: dict,
) -> tuple[float, list]:
    """``concurrency`` workers, ``rounds`` requests each; returns (wall seconds, results in prompt order)."""
    import httpx

    n = concurrency * rounds
    results: list = [None] * n
    next_i = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, headers=headers) as client:

        async def worker():
            for i in next_i:
                results[i] = await one_request(
                    client, url, prompts[i % len(prompts)], max_tokens, timeout
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, results


async def step_buckets(client, url: str) -> dict[float, float]:
    """The server's cumulative ``redraft_step_seconds`` histogram, ``{upper bound: count}``
    (empty if it has none: another server, or /metrics unreachable)."""
    import httpx

    try:
        r = await client.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    out = {}
    for line in r.text.splitlines():
        if line.startswith('redraft_step_seconds_bucket{le="'):
            le = line.split('"')[1]
            out[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(before: dict, after: dict, q: float) -> float:
    """The ``q`` quantile (ms) of the observations between two scrapes of one histogram: the
    upper bound of the bucket where the count passes ``q`` (steps of 25%: see
    ``redraft.serve.metrics.STEP_BUCKETS``); NaN without observations."""
    les = sorted(after)
    total = after[les[-1]] - before.get(les[-1], 0) if les else 0
    if total <= 0:
        return float("nan")
    for le in les:
        if after[le] - before.get(le, 0) >= q * total:
            return 1e3 * le
    return float("nan")


async def run_long_join(
    url: str,
    prompts: list,
    long_prompt: str,
    concurrency: int,
    max_tokens: int,
    join_after: float,
    timeout: float,
    headers: dict,
) -> dict:
    """``concurrency`` streams decode back to back until the long request (sent after
    ``join_after`` s) has finished; returns the figures (see the module doc)."""
    import httpx
    import numpy as np

    done, results = asyncio.Event(), []
    limits = httpx.Limits(
        max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1
    )
    async with httpx.AsyncClient(limits=limits, headers=headers) as client:

        async def worker(k):
            i = k
            while not done.is_set():
                results.append(
                    await one_request(client, url, prompts[i % len(prompts)], max_tokens, timeout)
                )
                i += concurrency

        scrapes = [await step_buckets(client, url)]  # the server's step times: start, join, end

        async def joiner():
            await asyncio.sleep(join_after)
            scrapes.append(await step_buckets(client, url))
            try:
                return await one_request(client, url, long_prompt, 8, timeout)
            finally:
                done.set()

        *_, long = await asyncio.gather(*(worker(k) for k in range(concurrency)), joiner())
        scrapes.append(await step_buckets(client, url))
    t_join, t_done = long["t0"], long["end"]
    before = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:]) if b < t_join]
    during = [
        b - a
        for r in results
        for a, b in zip(r["chunks"], r["chunks"][1:])
        if t_join <= b <= t_done
    ]

    def p(xs, q):
        return 1e3 * float(np.percentile(xs, q)) if xs else float("nan")

    row = {
        "prompt_tokens": long["prompt_tokens"],
        "long_ttft_ms": 1e3 * (long["ttft"] or float("nan")),
        "itl_p50_before_ms": p(before, 50),
        "itl_p50_during_ms": p(during, 50),
        "itl_p99_during_ms": p(during, 99),
        "gaps_during": len(during),
        # the server's own step times (its /metrics histogram), to set the client's gaps against
        "step_p50_before_ms": bucket_quantile(scrapes[0], scrapes[1], 0.5),
        "step_p50_during_ms": bucket_quantile(scrapes[1], scrapes[2], 0.5),
        "step_p99_during_ms": bucket_quantile(scrapes[1], scrapes[2], 0.99),
    }
    row["p99_over_median"] = row["itl_p99_during_ms"] / row["itl_p50_before_ms"]
    return row


def measure_levels(args, servers: list, prompts: list, levels: list, headers: dict) -> list:
    """Every level ``--repeat`` times over every server (run r in an order rotated by r); rows
    carry the ratio of tokens/s to the first server's in the same run."""
    table = []
    for c in levels:
        for run in range(args.repeat):
            k = run % len(servers)
            got = {}
            for label, url in servers[k:] + servers[:k]:
                wall, results = asyncio.run(
                    run_level(url, prompts, c, args.rounds, args.max_tokens, args.timeout, headers)
                )
                got[label] = (summarize(wall, results), [r["text"] for r in results])
            ref, ref_texts = got[servers[0][0]]
            for label, _ in servers:
                figures, texts = got[label]
                row = {"concurrency": c, "run": run + 1, "label": label, **figures}
                row["ratio"] = row["tokens_per_s"] / ref["tokens_per_s"]
                row["identical"] = texts == ref_texts
                table.append(row)
                print(
                    f"streams {c:>2} run {run + 1} {label:>4}: {row['tokens_per_s']:7.1f} tok/s "
                    f"({row['ratio']:.2f}x), TTFT p50 {row['ttft_p50_ms']:.0f} ms, ITL p50 "
                    f"{row['itl_p50_ms']:.0f} ms, identical {row['identical']}",
                    file=sys.stderr,
                    flush=True,
                )  # progress: stdout holds the table alone
    return table


# ---------------------------------------------------------------------------------- servers


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    if bool(args.urls) == bool(args.spawn):
        print("loadtest: give server URLs or --spawn ARGS (one of them).", file=sys.stderr)
        return 2
    if min(levels) < 1 or args.rounds < 1 or args.max_tokens < 1 or args.repeat < 1:
        print(
            "loadtest: --concurrency levels, --rounds, --repeat and --max-tokens must be >= 1.",
            file=sys.stderr,
        )
        return 2
    also = [a.partition("=") for a in args.also]
    if also and not args.spawn or any(not label or not eq for label, eq, _ in also):
        print("loadtest: --also takes LABEL=ARGS, with --spawn.", file=sys.stderr)
        return 2
    if args.control and not args.spawn:
        print(
            "loadtest: --control starts a second reference server: it needs --spawn.",
            file=sys.stderr,
        )
        return 2
    key = args.api_key or os.environ.get("REDRAFT_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    procs = []
    try:
        if args.spawn:
            servers = []
            for label, line in spawn_lines(args, [(label, line) for label, _, line in also]):
                proc, url = spawn(line, key)
                procs.append(proc)
                servers.append((label, url))
        else:
            labels = args.labels.split(",") if args.labels else args.urls
            if len(labels) != len(args.urls):
                print("loadtest: --labels must name every URL.", file=sys.stderr)
                return 2
            servers = list(zip(labels, [u.rstrip("/") for u in args.urls]))
        for _, url in servers:
            wait_ready(url)
        from redraft.data.prompts import load_prompts

        prompts = load_prompts(args.dataset, args.prompts)
        if args.scenario == "long-join":
            return long_join(args, servers, prompts, levels[0], headers)
        table = measure_levels(args, servers, prompts, levels, headers)
        md = markdown(table)
        if args.repeat > 1:
            md += "\n" + summary_markdown(table)
        print(md, end="")
        if args.markdown:
            Path(args.markdown).write_text(md)
        if args.out:
            Path(args.out).write_text(
                json.dumps({"args": vars(args), "servers": servers, "rows": table}, indent=1)
            )
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, OSError) as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def long_join(args, servers: list, prompts: list, concurrency: int, headers: dict) -> int:
    """The long-join scenario on every server (see the module doc); prints the Markdown table."""
    text = long_prompt_text(prompts, args.long_tokens)
    table = []
    for label, url in servers:
        row = {
            "label": label,
            **asyncio.run(
                run_long_join(
                    url,
                    prompts,
                    text,
                    concurrency,
                    args.max_tokens,
                    args.join_after,
                    args.timeout,
                    headers,
                )
            ),
        }
        table.append(row)
        print(
            f"{label}: long TTFT {row['long_ttft_ms'] / 1e3:.1f} s, ITL p50 before "
            f"{row['itl_p50_before_ms']:.0f} ms, p99 during {row['itl_p99_during_ms']:.0f} ms "
            f"({row['p99_over_median']:.2f}x)",
            file=sys.stderr,
            flush=True,
        )
    md = long_join_markdown(table)
    print(md, end="")
    if args.markdown:
        Path(args.markdown).write_text(md)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "servers": servers, "rows": table}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prometheus metrics of one server (``GET /metrics``), on ``prometheus_client``.

Each server has its own registry (not the process-global one), so several servers in one process
(the tests) do not share counters. Everything is thread-safe: the scheduler thread records steps
and finished requests, the HTTP handlers record rejections.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

RATE_WINDOW_S = 10.0  # tokens/s is measured over the steps of the last 10 s


# a step's wall time: 1 ms to ~9 s in 25% steps (fine enough to read a p99 from two scrapes)
STEP_BUCKETS = tuple(round(0.001 * 1.25**k, 6) for k in range(42))


class Metrics:
    """The server's metrics (names as exported, ``redraft_`` prefix):

    * ``requests_total{outcome}``: finished requests by outcome: the finish reason (``eos``,
      ``length``, ``stop``), ``cancelled`` (client went away), ``invalid`` (400), ``rejected``
      (429 queue full, 503 draining), ``unauthorized`` (401), ``error`` (failed in the decoder);
    * ``generated_tokens_total``, ``target_calls_total`` (target forwards, prefills included);
    * ``tokens_per_second``: output tokens over the last 10 s of steps;
    * ``mean_accepted_length``: accepted draft tokens + 1 per verify step over all finished
      requests (vLLM / Spec-Bench definition, prefill excluded);
    * ``prompt_tokens_total``: prompt tokens of admitted requests;
    * ``queue_depth`` (requests waiting for a batch row), ``batch_size`` (rows decoding): read
      from the scheduler's counts when scraped (the numbers ``/health`` reports), so a
      cancelled row leaves them at once;
    * ``kv_cache_tokens`` (tokens whose keys and values the running rows hold),
      ``kv_cache_capacity_tokens`` (token slots allocated, all rows), ``kv_cache_usage``
      (their ratio), as of the last step;
    * ``time_to_first_token_seconds``, ``request_duration_seconds`` histograms.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "redraft_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.tokens = Counter("redraft_generated_tokens", "Output tokens generated", registry=r)
        self.target_calls = Counter(
            "redraft_target_calls",
            "Target forwards of finished requests (prefill included)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "redraft_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.queue_depth = Gauge(
            "redraft_queue_depth", "Requests waiting for a batch row", registry=r
        )
        self.batch_size = Gauge("redraft_batch_size", "Rows in the running batch", registry=r)
        self._kv = (0, 0)  # (tokens held, slots allocated) after the last step
        Gauge(
            "redraft_kv_cache_tokens", "Tokens held in the KV cache by running rows", registry=r
        ).set_function(lambda: self._kv[0])
        Gauge(
            "redraft_kv_cache_capacity_tokens", "Token slots allocated in the KV cache", registry=r
        ).set_function(lambda: self._kv[1])
        Gauge(
            "redraft_kv_cache_usage", "KV cache tokens held / slots allocated", registry=r
        ).set_function(lambda: self._kv[0] / max(self._kv[1], 1))
        self.ttft = Histogram(
            "redraft_time_to_first_token_seconds",
            "Arrival to first output token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.step_seconds = Histogram(
            "redraft_step_seconds",
            "Wall time of one decoder step (a prefill piece, drafting, the verify forward, "
            "acceptance): what every running stream waits between two outputs",
            registry=r,
            buckets=STEP_BUCKETS,
        )
        self.duration = Histogram(
            "redraft_request_duration_seconds",
            "Arrival to last output token",
            registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        Gauge(
            "redraft_tokens_per_second",
            f"Output tokens per second over the last {RATE_WINDOW_S:g} s",
            registry=r,
        ).set_function(self.tokens_per_second)
        Gauge(
            "redraft_mean_accepted_length",
            "Accepted draft tokens + 1 per verify step, finished requests",
            registry=r,
        ).set_function(self.mean_accepted_length)
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self._accepted = 0.0  # sum over finished requests of mean accepted length x verify steps
        self._verify_steps = 0
        self._started = time.monotonic()

    def bind(self, counts) -> None:
        """Read ``batch_size`` and ``queue_depth`` from ``counts()`` -> (running, waiting) when scraped."""
        self.batch_size.set_function(lambda: counts()[0])
        self.queue_depth.set_function(lambda: counts()[1])

    def step(
        self, tokens: int, kv: tuple[int, int] | None = None, seconds: float | None = None
    ) -> None:
        """Record one decoder step that emitted ``tokens`` tokens; ``kv``: the engine's
        (tokens held, slots allocated) after it, when it reports them; ``seconds``: its wall
        time."""
        now = time.monotonic()
        self.tokens.inc(tokens)
        if seconds is not None:
            self.step_seconds.observe(seconds)
        if kv is not None:
            self._kv = (int(kv[0]), int(kv[1]))
        with self._lock:
            self._steps.append((now, tokens))
            while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
                self._steps.popleft()

    def finished(self, generation, ttft: float | None, duration: float) -> None:
        s = generation.stats
        self.requests.labels(generation.finish_reason).inc()
        self.target_calls.inc(s.target_calls)
        verify_steps = s.verify_steps  # the prefill is not a verify step
        with self._lock:
            self._accepted += float(s.mean_accepted_length) * verify_steps
            self._verify_steps += verify_steps
        if ttft is not None:
            self.ttft.observe(ttft)
        self.duration.observe(duration)

    def outcome(self, name: str) -> None:
        self.requests.labels(name).inc()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._steps if t >= now - RATE_WINDOW_S]
        # over the window, or over the uptime while that is shorter (at least 1 s)
        return sum(n for _, n in recent) / min(RATE_WINDOW_S, max(now - self._started, 1.0))

    def mean_accepted_length(self) -> float:
        with self._lock:
            return self._accepted / self._verify_steps if self._verify_steps else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

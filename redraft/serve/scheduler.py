"""Continuous batching: one thread owns the decoder's engine; requests join and leave between steps.

    compute = ComputeThread()
    decoder = compute.call(load_decoder, "default")   # torch work of the server: one thread
    sched = Scheduler(decoder, max_batch=16, max_queue=64, compute=compute)
    sched.start()                  # builds the engine (and warms it up) on that thread
    job = Job(prompt_ids, params, asyncio.get_running_loop())
    sched.submit(job)              # 429 when the queue is full, 503 while draining
    kind, payload = await job.queue.get()   # ("admitted", None), then ("event", StreamEvent)... or ("error", APIError)
    sched.cancel(job)              # the client went away: its row leaves at the next step

The engine is not thread-safe, so only the loop thread touches it. That thread is the
:class:`ComputeThread` the decoder was loaded on: a process's torch work belongs on one thread
(its class doc says why and what it costs otherwise). HTTP handlers talk to the
loop through this object: ``submit`` and ``cancel`` put work in an inbox under a lock, and the
loop takes it between steps (admitting waiting jobs while fewer than ``max_batch`` rows run).
Results go back to each request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``, once per
step for all the step's events.

Faults stay with their request: ``engine.add`` raising (a prompt longer than the context, a
temperature the acceptance rule cannot sample...) answers that request alone; a step that
raises fails the requests of that step, the engine is rebuilt, and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections import deque

from redraft.errors import ConfigError, RedraftError
from redraft.serve.protocol import APIError, config_error

logger = logging.getLogger(__name__)

RETRY_AFTER_MAX_S = 60
WARMUP_TOKENS = (
    8  # a short generation at start-up: the first real request then pays no one-off costs
)


class ComputeThread:
    """The one thread that runs a server's torch work: loading the decoder, then the decode loop
    (:meth:`Scheduler.start` submits it here).

    Why one: PyTorch's CPU wheels parallelise their kernels with GNU OpenMP, whose thread team
    belongs to the thread that opened it. A model loaded on the main thread and decoded on
    another leaves two teams, more OpenMP threads than cores on a small machine, and libgomp
    then stops its idle workers from spinning between parallel regions: every kernel pays a
    wake-up. Measured on a small CPU (default target, float32, one row decoding, 2
    threads): 48-52 ms a step on the thread that loaded the model (62 in one run of
    six) against 69-87 ms on another thread of the same process (the verify forward's ``_linear_pointwise`` 144 ->
    208 us a call, its CPU flash attention 50 -> 115 us); the server decoded on such a thread.

    ``concurrent.futures.ThreadPoolExecutor(max_workers=1)`` would run the calls on one thread
    too, but its worker is not a daemon: the interpreter's exit would wait for a decode loop
    that did not stop.
    """

    def __init__(self, name: str = "redraft-decode"):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run ``fn(*args, **kwargs)`` on the thread after what was submitted before; its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, args, kwargs, fut))
        return fut

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` run on the thread; its result (or its exception, raised here)."""
        return self.submit(fn, *args, **kwargs).result()

    def _serve(self) -> None:
        while True:
            fn, args, kwargs, fut = self._inbox.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller's to handle: the thread serves on
                fut.set_exception(exc)


class Job:
    """One request in the scheduler: its prompt, its ``SamplingParams``, and the queue its
    messages arrive on (``("admitted", None)``, ``("event", StreamEvent)``, ``("error", APIError)``)."""

    def __init__(self, prompt_ids: list[int], params, loop: asyncio.AbstractEventLoop):
        self.prompt_ids, self.params, self.loop = prompt_ids, params, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid: int | None = None
        self.state = "new"  # new -> waiting -> admitting -> running -> done
        self.arrived = time.monotonic()
        self.first_token: float | None = None
        self.max_tokens_name = "max_tokens"  # the request's name for max_new_tokens, for its errors


class Scheduler:
    """The decode loop of a server (see the module doc).

    Args:
        decoder: has ``engine()`` (a fresh step-level engine) and ``encode(text)`` (a batch of one).
        max_batch: rows decoding at once; more requests wait.
        max_queue: requests that may wait for a row; past it ``submit`` answers 429.
        metrics: a :class:`redraft.serve.metrics.Metrics` (optional).
        make_params: ``SamplingParams.checked`` (or another factory) for the warm-up request.
        warmup: run a short generation before serving (measures the verify-cost curve and
            builds what the first step builds, so the first client does not wait for it).
        compute: the :class:`ComputeThread` the decoder was loaded on (the loop runs there);
            default: a new one.
    """

    def __init__(
        self,
        decoder,
        max_batch: int = 16,
        max_queue: int = 64,
        metrics=None,
        make_params=None,
        warmup: bool = True,
        compute: ComputeThread | None = None,
    ):
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"max_batch={max_batch} must be >= 1 and max_queue={max_queue} >= 0.")
        self.decoder, self.max_batch, self.max_queue = decoder, max_batch, max_queue
        self.metrics, self.make_params, self.warmup = metrics, make_params, warmup
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._cancel: list[Job] = []
        self._draining = self._stopping = False
        self._compute = compute
        self._loop: concurrent.futures.Future | None = None  # the decode loop's run
        self._avg_secs = 1.0  # EMA of request durations, for Retry-After
        self.ready = threading.Event()
        self.failure: BaseException | None = None  # why the loop could not start or died

    # ------------------------------------------------------------------ called from HTTP handlers

    def start(self) -> None:
        """Run the decode loop on the compute thread (a new one if none was given)."""
        if self._compute is None:
            self._compute = ComputeThread()
        self._loop = self._compute.submit(self._run)

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._loop.done() and self.failure is None

    @property
    def draining(self) -> bool:
        return self._draining

    def counts(self) -> tuple[int, int]:
        """(rows running, requests waiting)."""
        with self._cv:
            return len(self._running), len(self._waiting)

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (the choices of one request: all or none); raises :class:`APIError` 503
        (draining or loop down) or 429 (the queue cannot take them all)."""
        with self._cv:
            if self._draining or self._stopping:
                raise APIError(
                    503,
                    "the server is shutting down; send the request to another instance.",
                    code="shutting_down",
                )
            if not self.alive:
                raise APIError(
                    503,
                    f"the decode loop is not running ({self.failure!r}); restart the server.",
                    code="loop_down",
                )
            if (
                len(self._running) + len(self._waiting) + len(jobs)
                > self.max_batch + self.max_queue
            ):
                wait = self.retry_after()
                raise APIError(
                    429,
                    f"the server is busy: {len(self._running)} requests decoding and "
                    f"{len(self._waiting)} waiting (--max-queue {self.max_queue}); retry in {wait} s.",
                    code="queue_full",
                    type="rate_limit_error",
                    headers={"Retry-After": str(wait)},
                )
            for job in jobs:
                job.state = "waiting"
                self._waiting.append(job)
            self._cv.notify()

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: waiting requests / rows x mean request time."""
        return int(
            min(
                RETRY_AFTER_MAX_S,
                max(1, math.ceil(self._avg_secs * (1 + len(self._waiting)) / self.max_batch)),
            )
        )

    def cancel(self, job: Job) -> None:
        """Drop ``job`` (its client went away): waiting jobs leave at once, running rows at the
        next step. A finished job is left alone."""
        with self._cv:
            if job.state == "waiting":
                self._waiting.remove(job)
                job.state = "done"
                self._outcome("cancelled")
            elif job.state in ("admitting", "running"):
                self._cancel.append(job)
                self._cv.notify()

    def drain(self) -> None:
        """Stop accepting requests; those already accepted run to the end."""
        with self._cv:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop after the current step; requests still in it get a 503 error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._loop is not None:
            concurrent.futures.wait([self._loop], timeout)

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            engine = self.decoder.engine()
            if self.warmup:
                self._warm(engine)
        except BaseException as exc:  # the server must not start on a broken decoder
            logger.exception("the decode loop could not start")
            self.failure = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            while True:
                admit, cancels = self._take_inbox(engine)
                if admit is None:
                    break
                for job in cancels:
                    self._drop(engine, job)
                for job in admit:
                    self._add(engine, job)
                if engine.has_work:
                    engine = self._step(engine)
        except BaseException as exc:  # a bug in this loop: make it visible, fail what is left
            logger.exception("the decode loop died")
            self.failure = exc
        finally:
            with self._cv:
                left = list(self._waiting) + list(self._running.values())
                self._waiting.clear()
                self._running.clear()
            self._fail(
                left,
                APIError(
                    503, "the server stopped before this request finished.", code="shutting_down"
                ),
            )

    def _take_inbox(self, engine):
        """Wait for work; returns (jobs to admit, jobs to cancel), or (None, None) to stop."""
        with self._cv:
            while not (
                self._stopping
                or self._cancel
                or engine.has_work
                or (self._waiting and len(self._running) < self.max_batch)
            ):
                self._cv.wait()
            if self._stopping:
                return None, None
            cancels, self._cancel = self._cancel, []
            admit = []
            while self._waiting and len(self._running) + len(admit) < self.max_batch:
                job = self._waiting.popleft()
                job.state = "admitting"
                admit.append(job)
            return admit, cancels

    def _add(self, engine, job: Job) -> None:
        try:
            rid = engine.add(job.prompt_ids, job.params)
        except RedraftError as exc:  # a ConfigError's param names the field
            job.state = "done"
            self._post([(job, ("error", config_error(exc, job.max_tokens_name)))])
            return
        except Exception as exc:  # noqa: BLE001 - this request's fault stays with it
            logger.exception("engine.add failed")
            job.state = "done"
            self._outcome("error")
            self._post(
                [
                    (
                        job,
                        (
                            "error",
                            APIError(500, f"the decoder could not take this request: {exc!r}"),
                        ),
                    )
                ]
            )
            return
        with self._cv:
            job.rid = rid
            self._running[rid] = job
            job.state = "running"
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self._post([(job, ("admitted", None))])

    def _drop(self, engine, job: Job) -> None:
        with self._cv:
            if job.state != "running" or self._running.pop(job.rid, None) is None:
                return
            job.state = "done"
        engine.cancel(job.rid)
        self._outcome("cancelled")

    def _step(self, engine):
        """One engine step; returns the engine to go on with (a new one after a failed step)."""
        t0 = time.perf_counter()
        try:
            events = engine.step()
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving others
            logger.exception(
                "a decoding step failed; its %d request(s) get an error", len(self._running)
            )
            with self._cv:
                failed = list(self._running.values())
                self._running.clear()
            for job in failed:
                job.state = "done"
                self._outcome("error")
            self._fail(failed, APIError(500, f"decoding failed: {exc!r}", code="decode_error"))
            return self.decoder.engine()
        now = time.monotonic()
        out, tokens = [], 0
        with self._cv:
            for ev in events:
                tokens += len(ev.tokens)
                job = self._running.get(ev.index)
                if job is None:  # cancelled meanwhile
                    continue
                if job.first_token is None and ev.tokens:
                    job.first_token = now
                out.append((job, ("event", ev)))
                if ev.done:
                    del self._running[ev.index]
                    job.state = "done"
                    secs = now - job.arrived
                    self._avg_secs = 0.8 * self._avg_secs + 0.2 * secs
                    if self.metrics is not None:
                        ttft = None if job.first_token is None else job.first_token - job.arrived
                        self.metrics.finished(ev.generation, ttft, secs)
        if self.metrics is not None:
            self.metrics.step(tokens, getattr(engine, "kv_usage", None), time.perf_counter() - t0)
        self._post(out)
        return engine

    def _warm(self, engine) -> None:
        if self.make_params is None:
            return
        dec = self.decoder
        if dec.guard.enabled and self.max_batch > 1:
            # batched verify costs: the budget and the guard's first verdicts per batch size
            # (a few seconds before the first request, instead of exploring during it); first,
            # so that the warm-up's steps leave node values for those verdicts
            dec.measure_batch_cost(self.max_batch)
        elif dec.cost_curve is None and dec.config.prefill_chunk == "auto":
            dec.measure_cost()  # the auto prefill chunk reads it: not during the first requests
        engine.add(self.decoder.encode("Hello")[0], self.make_params(max_new_tokens=WARMUP_TOKENS))
        while engine.has_work:
            engine.step()

    # ------------------------------------------------------------------ delivery

    def _outcome(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.outcome(name)

    def _fail(self, jobs, err: APIError) -> None:
        self._post([(job, ("error", err)) for job in jobs])

    @staticmethod
    def _post(items) -> None:
        """Deliver ``(job, message)`` pairs to their event loops, one call per loop."""
        by_loop: dict = {}
        for job, msg in items:
            by_loop.setdefault(job.loop, []).append((job.queue, msg))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass


def _deliver(batch) -> None:
    for q, msg in batch:
        q.put_nowait(msg)

"""Which drafters are worth calling (:class:`DrafterGate`: pruning drops a weak drafter's
nodes, but its drafting time is paid before pruning) and whether speculating pays at this batch
size at all (:class:`SpeculationGuard`: plain steps against speculative ones, measured).
"""

from __future__ import annotations

import collections
import dataclasses


class DrafterGate:
    """Which drafters to call: skip one while the tokens only it gets accepted are worth less
    time than its drafting costs.

    The gate keeps each drafter's drafting seconds (the lower median of its last ``TIMES``
    calls) and exponential moving averages of the accepted tokens per step that no other drafter
    proposed ("exclusive gain") and of the seconds one output token costs. A drafter is worth calling when
    ``gain * seconds_per_token >= drafting seconds``; one that is not waits ``explore`` steps
    before it is tried again, and every try that finds it still not worth it doubles the wait
    (up to ``MAX_WAIT_FACTOR * explore``), so a useless drafter ends up costing almost nothing.
    Unknown gains count as worth it, and so does a drafter whose drafting costs at most
    ``FREE_SHARE`` of an output token's time: skipping it could save no more than that, while
    skipping it wrongly loses its tokens (two drafters that propose many of the same tokens each
    show little exclusive gain, and the one left alone then looks like the only one that
    works). A drafter's first call is not timed: it pays one-time setup (N-Grammys converts its
    tables to host arrays, hundreds of times a later call's work), and that time, taken for what
    a call costs, switches a cheap drafter off for a long while (its time moves only when it is
    called, and each re-try doubles the wait); the median keeps later slow calls (a busy machine,
    a drafter catching up on the steps it was skipped) from doing the same. Gating never changes the output, only
    the speed.
    """

    TIME_EMA = 0.8  # weight of the past in the seconds-per-token average
    GAIN_EMA = 0.7  # weight of the past in the exclusive-gain average
    MAX_WAIT_FACTOR = 16
    TIMES = 5  # drafting time: the lower median of the last TIMES calls
    FREE_SHARE = 0.01  # drafting under 1% of a token's time is always worth calling

    def __init__(self, num_drafters: int, explore: int = 8, enabled: bool = True):
        self.n, self.explore, self.enabled = num_drafters, max(int(explore), 1), enabled
        self.secs = [0.0] * num_drafters  # drafting seconds per call (0: not timed yet, free)
        self.calls = [0] * num_drafters  # calls seen by record_time
        # the last TIMES calls' drafting seconds: one slow call (the machine busy elsewhere, a
        # drafter catching up on the tokens of the steps it was skipped) does not switch it off
        self.times = [collections.deque(maxlen=self.TIMES) for _ in range(num_drafters)]
        self.gain: list[float | None] = [None] * num_drafters  # exclusive accepted tokens per step
        self.idle = [0] * num_drafters  # steps since the last call
        self.wait = [self.explore] * num_drafters  # steps a skipped drafter waits before a re-run
        self.sec_per_token: float | None = None

    def net(self, i: int) -> float:
        """Seconds drafter i saves per step (inf while its gain is unknown)."""
        g = self.gain[i]
        return float("inf") if g is None else g * (self.sec_per_token or 0.0) - self.secs[i]

    def active(self) -> list[int]:
        """Indices of the drafters to call this step (every drafter while gating is off or
        nothing is known yet); advances the idle counters."""
        if not self.enabled or self.sec_per_token is None:
            return list(range(self.n))
        net = [self.net(i) for i in range(self.n)]
        free = self.FREE_SHARE * self.sec_per_token
        active = []
        for i in range(self.n):
            if net[i] >= 0 or self.secs[i] <= free:
                self.wait[i] = self.explore
                active.append(i)
            elif self.idle[i] + 1 >= self.wait[i]:  # re-run; back off if still not worth it
                self.wait[i] = min(2 * self.wait[i], self.MAX_WAIT_FACTOR * self.explore)
                active.append(i)
        if not active:
            active = [max(range(self.n), key=lambda i: net[i])]
        for i in range(self.n):
            self.idle[i] = 0 if i in active else self.idle[i] + 1
        return active

    def record_time(self, i: int, secs: float) -> None:
        """Drafter i took ``secs`` to draft this step (its first call, one-time setup, is not
        counted)."""
        self.calls[i] += 1
        if self.calls[i] == 1:
            return
        times = self.times[i]
        times.append(secs)
        self.secs[i] = sorted(times)[(len(times) - 1) // 2]  # the lower median

    def update(self, step_secs: float, tokens_per_row: float, exclusive: dict[int, float]) -> None:
        """After a step: its wall time, the tokens a row gained on average (accepted + 1), and
        for each drafter called, its exclusive accepted tokens per row."""
        spt = step_secs / max(tokens_per_row, 1e-9)
        a = self.TIME_EMA
        self.sec_per_token = (
            spt if self.sec_per_token is None else a * self.sec_per_token + (1 - a) * spt
        )
        if not self.enabled:
            return
        for i, g in exclusive.items():
            old = self.gain[i]
            self.gain[i] = g if old is None else self.GAIN_EMA * old + (1 - self.GAIN_EMA) * g


class SpeculationGuard:
    """Speculate only at batch sizes where it is measured to pay.

    The budget's cost model uses the verify cost of one row (``c(B * (K + 1))``), but a batch
    of B rows does not cost what one row of as many tokens costs (each row attends over its own
    cache; on CPUs the matrix kernels change with the row count), and the node values overrate
    trees whose drafters propose alternatives. So the guard measures instead: per batch-size
    bucket (1, 2-3, 4-7, 8-15, ...) it alternates runs of speculative and plain steps (plain:
    no drafter called, one token per row) and keeps, for each, the output tokens per second of
    its latest run (the first step of a run is not counted: it pays for warm-ups such as the
    cost-curve measurement or a CUDA graph capture). After the first comparison the faster mode
    runs; speculation that lost is re-tried after ``explore`` steps, the wait doubling (up to
    ``MAX_WAIT_FACTOR * explore``) while it keeps losing; speculation that won is re-checked
    against a short plain run every ``REPROBE`` steps. Batches below ``min_batch`` always
    speculate (one row's cost is what the cost curve measures). Plain steps are exact: the guard
    changes the speed, never the output.

    A bucket that no neighbour informs starts from the cost model's verdict (``prior``: the
    decoder's measured batched verify costs and its recent node values): predicted to lose, it
    starts with a plain stretch of ``PRIOR_WAIT * explore`` steps (a short request does not pay
    for the check), then one speculative run checks the prediction.

    A bucket seen for the first time starts from its neighbours' verdicts instead of exploring
    blind (a server's batch size moves between buckets all the time in its first seconds): the
    verify forward only gets less flat as the batch grows, so speculation that lost at a smaller
    batch starts a larger one with a plain stretch (then one speculative run re-checks it), and
    speculation that won at a larger batch starts a smaller one with a long speculative stretch.
    """

    RUN = 4  # steps of one mode per measurement (the first one not counted)
    MAX_WAIT_FACTOR = 16
    REPROBE = 128  # steps of winning speculation between plain re-measurements
    PRIOR_WAIT = 4  # a bucket predicted to lose: plain steps (x explore) before the first check

    def __init__(self, explore: int = 8, min_batch: int = 2, enabled: bool = True):
        self.explore, self.min_batch, self.enabled = max(int(explore), 1), min_batch, enabled
        self._buckets: dict[int, _GuardBucket] = {}
        # batch size -> the cost model's verdict (True/False) or None: a bucket that no
        # neighbour informs starts from it (the decoder's measured batched costs)
        self.prior = None

    @staticmethod
    def bucket(batch: int) -> int:
        return int(batch).bit_length()

    def _state(self, batch: int) -> _GuardBucket:
        b = self.bucket(batch)
        if b not in self._buckets:
            st = self._buckets[b] = _GuardBucket(left=self.RUN, wait=self.explore)
            if any(k < b and o.verdict is False for k, o in self._buckets.items()):
                st.speculative, st.held, st.left = False, True, self.explore
            elif any(k > b and o.verdict is True for k, o in self._buckets.items()):
                st.left = self.REPROBE
            elif self.prior is not None and self.prior(batch) is False:
                # trusted for a while: a short request should not pay the check's losing steps
                st.speculative, st.held, st.left = False, True, self.PRIOR_WAIT * self.explore
        return self._buckets[b]

    def speculate(self, batch: int) -> bool:
        """Whether the next step at this batch size drafts."""
        if not self.enabled or batch < self.min_batch:
            return True
        st = self._state(batch)
        if st.left <= 0:
            self._next_run(st)
        st.left -= 1
        return st.speculative

    def _next_run(self, st: _GuardBucket) -> None:
        """A run ended: keep its figure, then choose the next run's mode and length."""
        if st.steps > 1 and st.secs > 0:
            st.tps[st.speculative] = st.tokens / st.secs
        st.steps, st.secs, st.tokens = 0, 0.0, 0
        last, held, st.held = st.speculative, st.held, False
        spec, plain = st.tps.get(True), st.tps.get(False)
        if spec is None or plain is None:  # measure the mode that has no figure yet
            st.speculative, st.left = spec is None, self.RUN
        elif spec >= plain:
            st.wait = self.explore
            # after a plain run: speculate for a long stretch; after that stretch: a short plain probe
            st.speculative, st.left = (True, self.REPROBE) if not last else (False, self.RUN)
        elif (
            last or not held
        ):  # speculation lost (tried just now, or against a plain run): plain for a while
            st.speculative, st.left, st.held = False, st.wait, True
            st.wait = min(2 * st.wait, self.MAX_WAIT_FACTOR * self.explore)
        else:  # the plain stretch is over: try speculation again
            st.speculative, st.left = True, self.RUN

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A step at this batch size emitted ``tokens`` (all rows) in ``seconds``."""
        if not self.enabled or batch < self.min_batch or seconds <= 0:
            return
        st = self._state(batch)
        if speculative != st.speculative:
            return
        st.steps += 1
        if st.steps > 1:  # the first step of a run pays the warm-ups
            st.secs += seconds
            st.tokens += tokens


@dataclasses.dataclass
class _GuardBucket:
    """One batch-size bucket of :class:`SpeculationGuard`: the current run and the figures."""

    left: int  # steps left in the current run
    wait: int  # plain steps before losing speculation is tried again
    speculative: bool = True  # the current run's mode
    held: bool = False  # the current run is a plain stretch after speculation lost
    steps: int = (
        0  # the current run's steps so far, and the seconds and tokens of all but its first
    )
    secs: float = 0.0
    tokens: int = 0
    tps: dict = dataclasses.field(default_factory=dict)  # mode -> output tokens/s of its latest run

    @property
    def verdict(self) -> bool | None:
        """Whether speculation won the latest comparison (None: not compared yet)."""
        spec, plain = self.tps.get(True), self.tps.get(False)
        return None if spec is None or plain is None else spec >= plain

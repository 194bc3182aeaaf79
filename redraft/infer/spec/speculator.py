"""The speculator: what one step proposes and what it learns, over a list of drafters.

A step of :class:`~redraft.infer.engine.engine.Engine` calls, in order:

1. :meth:`Speculator.propose`: every drafter the gate lets through proposes paths continuing
   the last token ``y`` of each row; each entry gets a value, its estimated chance of being
   accepted (observed acceptance rate of its drafter, path group and depth);
2. :meth:`Speculator.build_tree`: the node budget that maximises expected tokens per unit of
   verify time, and one tree of the best nodes with shared prefixes stored once (numpy,
   ``redraft.infer.spec.hostdraft``);
3. (the verifier's forward over ``[y, tree nodes]``: ``redraft.infer.runner.verify``)
4. :meth:`Speculator.choices` (on the device) and :meth:`Speculator.accept` (on the host):
   greedy / rejection / typical acceptance picks the accepted path and the bonus token;
5. :meth:`Speculator.feedback`: drafters observe what was accepted and each drafter is
   credited with its accepted tokens; :meth:`Speculator.after_step`: the drafting-time
   averages, the gate and the guard.

With no drafters every step is a plain one (the tree is the root alone).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.infer.config import DecoderConfig
from redraft.infer.runner.clock import Clock
from redraft.infer.runner.cost import BatchCost, CostCurve, measure_batch_cost
from redraft.infer.runner.verify import Verifier
from redraft.infer.spec.accept import (
    HostAcceptance,
    RowSampling,
    logprob_table,
    processed_logits,
    step_choices,
    walk,
)
from redraft.infer.spec.drafter import (
    DecodeState,
    Draft,
    Drafter,
    Feedback,
    HostDrafter,
    HostFeedback,
)
from redraft.infer.spec.gate import DrafterGate, SpeculationGuard
from redraft.infer.spec.hoststats import HostStats, best_budget_np
from redraft.infer.spec.hosttree import build_tree_np, clean_paths_np, step_feedback_np
from redraft.infer.spec.paths import PAD, pad_paths_np


@dataclass
class Proposal:
    """The paths of every drafter called in one step, merged, on the host (numpy).

    Attributes:
        paths: ``[B, P, L]`` int64 all drafters' paths side by side (``PAD``-padded, cleaned).
        values: ``[B, P, L]`` float32 estimated acceptance probability of every entry.
        owner: ``[P]`` int64: the drafter (index into ``decoder.drafters``) of every path.
        group: ``[B, P]`` int64: every path's statistics group (its rank when the drafter gave none).
        drafts: ``(drafter index, its Draft, first path, end path)`` per drafter called.
        raw_entries: ``[B]`` draft tokens proposed per row (before pruning and sharing).
        marks: ``(drafter index, clock mark before, after)`` for drafting times.
    """

    paths: np.ndarray
    values: np.ndarray
    owner: np.ndarray
    group: np.ndarray
    drafts: list
    raw_entries: np.ndarray
    marks: list


DRAFT_TIMES = 9  # speculative steps whose median drafting time the budget adds to a step


class Speculator:
    """Propose, tree, accept and feedback for a list of drafters (see the module doc).

    Args:
        drafters: their paths are merged into one tree each step (empty: plain steps).
        config: the :class:`~redraft.infer.config.DecoderConfig` (budget, acceptance, gate,
            guard, adapt).
        verifier: the :class:`~redraft.infer.runner.verify.Verifier` whose forwards the cost
            curve measures.
        cost_curve: a :class:`~redraft.infer.runner.cost.CostCurve` to use instead of measuring
            one at the first step (only with the "auto" budget).

    Drafters that plan from the speculator's measurements (``Drafter.bind``) get it here.
    """

    def __init__(
        self,
        drafters: Sequence[Drafter],
        config: DecoderConfig,
        verifier: Verifier,
        cost_curve: CostCurve | None = None,
    ):
        self.drafters = list(drafters)
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ConfigError(f"drafter names must be unique (they label stats): {names}")
        for d in self.drafters:
            if d.host and not isinstance(d, HostDrafter):
                raise ConfigError(
                    f"drafter {d.name!r} sets host = True but is not a HostDrafter; subclass "
                    f"redraft.infer.drafters.HostDrafter (its propose_host, observe_host and "
                    f"add_rows_host are what a host drafter is called with)."
                )
        self.config = cfg = config
        self.verifier = verifier
        self.cost_curve = cost_curve
        self.stats = HostStats(len(self.drafters))
        for i, d in enumerate(self.drafters):  # drafters that plan from the measurements
            d.bind(self, i)
        self.gate = DrafterGate(
            len(self.drafters),
            cfg.gate_explore,
            enabled=cfg.gate and len(self.drafters) > 1 and cfg.budget == "auto",
        )
        self.guard = SpeculationGuard(
            cfg.gate_explore, enabled=cfg.guard and bool(self.drafters) and cfg.budget == "auto"
        )
        self.guard.prior = self._speculation_pays
        # measured batched verify costs (measure_batch_cost; the server does at warm-up) and the
        # last speculative step's node values ([B, M], read only when the guard meets a new
        # batch size): the cost model's verdict on a batch size the guard has not measured yet
        self.batch_cost: BatchCost | None = None
        self._last_values: np.ndarray | None = None
        self._clock = Clock(verifier.target.device)
        # drafting seconds of the recent speculative steps; their median is part of the budget's
        # cost. A median, not a mean: a first step that compiles the host kernels or catches up
        # on a long prompt takes seconds, and a mean kept it in every tree's price for dozens of
        # steps (at 16 rows, where speculative steps are rare, for the whole run: trees of ten
        # tokens a row, each several plain steps long)
        self._draft_times: deque[float] = deque(maxlen=DRAFT_TIMES)
        self._costs = None  # (cost curve, its table c(0..n) as numpy, its largest size)

    @property
    def draft_overhead(self) -> float:
        """Drafting seconds per speculative step: the median of the last :data:`DRAFT_TIMES`."""
        t = sorted(self._draft_times)
        return t[len(t) // 2] if t else 0.0

    @torch.no_grad()
    def measure_cost(self, context: int = 256, sizes=None) -> CostCurve:
        """Measure the verify-cost curve on this device (one row, a ``context``-token cache)."""
        self.cost_curve = self.verifier.measure_cost(self.config.max_nodes, context, sizes)
        return self.cost_curve

    def measure_batch_cost(self, max_batch: int, context: int = 256) -> BatchCost:
        """Measure batched verify forwards (2, 4, 8, ... rows up to ``max_batch``, 1 to 16
        tokens per row; a few seconds on a CPU): the budget then costs a batch's tree from them,
        and the speculation guard starts each batch size from their verdict (a server calls
        this at warm-up, so its first requests are not spent exploring)."""
        if self.cost_curve is None:
            self.measure_cost(context)
        batches = [b for b in (2, 4, 8, 16, 32, 64) if b <= max(max_batch, 2)]
        sizes = [n for n in (1, 2, 4, 8, 16) if n <= self.config.max_nodes + 1]
        self.batch_cost = measure_batch_cost(
            self.verifier, self.cost_curve, batches, sizes, context
        )
        return self.batch_cost

    def _speculation_pays(self, batch: int) -> bool | None:
        """Whether the cost model expects speculation to beat plain steps at this batch size:
        the best K for the last speculative step's node values (per row) against K = 0 and no
        drafting, with the measured batched costs; ``None`` before both are known."""
        if self.batch_cost is None or self._last_values is None:
            return None
        # mean over rows of each row's values, best first
        v = (-np.sort(-self._last_values, axis=1)[:, : self.config.max_nodes]).mean(axis=0)
        ks = np.arange(len(v) + 1)
        gain = batch * (1.0 + np.concatenate([[0.0], np.cumsum(v)]))
        secs = self.batch_cost(batch, ks + 1) + self.draft_overhead
        return bool((gain / secs).max() > batch / float(self.batch_cost(batch, 1)))

    # ------------------------------------------------------------------ the step's pieces

    @property
    def device_drafters(self) -> bool:
        """Whether a drafter drafts on the device (the engine then keeps a device state)."""
        return any(not d.host for d in self.drafters)

    @property
    def host_drafters(self) -> bool:
        """Whether a drafter drafts on the host (the engine then builds a :class:`HostState`)."""
        return any(d.host for d in self.drafters)

    def add_rows(self, host, state: DecodeState | None, start: int) -> None:
        """Rows ``start ..`` are new requests: every drafter sets up their state (a host drafter
        from ``host``, a device drafter from ``state``)."""
        for d in self.drafters:
            if d.host:
                d.add_rows_host(host, start)
            else:
                d.add_rows(state, start)

    def retire_rows(self, host, gone: list[int]) -> None:
        """Rows ``gone`` (indices into ``host``, which holds their final tokens) are about to
        leave the batch: the host drafters see them a last time."""
        for d in self.drafters:
            if d.host:
                d.retire_rows_host(host, gone)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows ``keep`` stay in the batch; every drafter drops the others' state."""
        for d in self.drafters:
            d.select_rows(keep)

    def propose(self, host, state: DecodeState | None, speculate: bool = True) -> Proposal:
        """Call the drafters the gate lets through (none for a plain step, ``speculate=False``);
        merge their paths and value every entry (host arrays)."""
        B = host.batch_size
        drafts, marks = [], []
        for i in self.gate.active() if speculate else ():
            d = self.drafters[i]
            m0 = self._clock.mark()
            if d.host:
                dr = d.propose_host(host)
            else:
                orig = d.propose(state)
                dr = _to_host(orig)
                dr.device_draft = orig  # what the drafter observes
            marks.append((i, m0, self._clock.mark()))
            if dr.num_paths:
                drafts.append((i, dr))
        if not drafts:
            return Proposal(
                _EMPTY_PATHS[:B],
                np.zeros((B, 0, 1), np.float32),
                _EMPTY_OWNER,
                np.zeros((B, 0), np.int64),
                [],
                np.zeros(B, np.int64),
                marks,
            )
        L = max(dr.path_length for _, dr in drafts)
        toks, owner, group, slices, start = [], [], [], [], 0
        for i, dr in drafts:
            t = clean_paths_np(pad_paths_np(np.asarray(dr.tokens, np.int64), L))
            p = t.shape[1]
            toks.append(t)
            owner.append(np.full(p, i, np.int64))
            group.append(
                np.broadcast_to(np.arange(p), (B, p))
                if dr.group is None
                else np.asarray(dr.group, np.int64)
            )
            slices.append((i, dr, start, start + p))
            start += p
        paths = toks[0] if len(toks) == 1 else np.concatenate(toks, axis=1)
        owner = owner[0] if len(owner) == 1 else np.concatenate(owner)
        group = group[0] if len(group) == 1 else np.concatenate(group, axis=1)
        values = self.stats.values(owner, paths.shape, group)
        if self.config.budget != "auto":  # fixed budget: rank by the drafter's own path probability
            values = np.array(values, np.float32)
            for _, dr, a, b in slices:
                if dr.logp is not None:
                    lp = pad_paths_np(np.asarray(dr.logp, np.float32), L, fill=0.0)
                    values[:, a:b] = np.maximum(np.exp(np.cumsum(lp, axis=-1)), 0)
        return Proposal(paths, values, owner, group, slices, (paths >= 0).sum(axis=(1, 2)), marks)

    def build_tree(self, prop: Proposal, host, verifier: Verifier):
        """The packed tree of this step (numpy, see ``redraft.infer.spec.hostdraft``): the node
        budget the cost model chooses (or the fixed one), static sizes when the verifier needs
        them (a static tree is filled with the best nodes up to its size: they cost nothing)."""
        B, P, L = prop.paths.shape
        cfg = self.config
        if P == 0:
            return build_tree_np(prop.paths, root=host.last, size=verifier.tree_size(1))
        if cfg.budget != "auto":
            budget, size = cfg.budget, None
            if verifier.static:
                size = verifier.tree_size(1 + min(cfg.budget, P * L), limit=1 + cfg.budget)
                budget = size - 1
        else:
            if self.cost_curve is None:
                self.measure_cost()
            values = np.where(prop.paths >= 0, prop.values, 0).reshape(B, -1)
            table = self._cost_table()
            top = self._node_limit(B)
            k = best_budget_np(values, table, top, self.draft_overhead, self.batch_cost)
            self._last_values = values  # kept, not sorted: the guard rarely reads it
            budget, size = k, None
            if k > 0:  # (a larger tree that measured cheaper is filled up to its size)
                size = verifier.tree_size(
                    1 + min(k, P * L),
                    limit=1 + top,
                    curve=self.cost_curve if B == 1 else None,
                )
                budget = size - 1
                size = size if verifier.static else None
            elif verifier.static:
                size = verifier.tree_size(1)
        return build_tree_np(prop.paths, prop.values, budget, root=host.last, size=size)

    def _node_limit(self, batch: int) -> int:
        """The most nodes a row's tree may have at this batch size: ``max_nodes``, except that
        without measured batched costs a batch's forward stays within the sizes the one-row
        curve measured (at least one node a row). Past them the curve is extrapolated and the
        node values overrate a batch's trees: where a batch's forward is not flat, trees of
        tens of nodes a row cost many plain steps each, and the guard paid for every such run
        before it turned speculation off (docs/design/0016). Reads the curve's largest size
        kept with its table (:meth:`_cost_table`, called first)."""
        top = self.config.max_nodes
        if batch > 1 and self.batch_cost is None:
            top = min(top, max(1, self._costs[2] // batch - 1))
        return top

    def _cost_table(self) -> np.ndarray:
        B_max = 256 * (self.config.max_nodes + 1)
        if self._costs is None or self._costs[0] is not self.cost_curve:
            curve = self.cost_curve
            self._costs = (curve, curve.table(B_max, "cpu").numpy(), int(curve.sizes[-1]))
        return self._costs[1]

    def choices(
        self, step, logits: torch.Tensor, sampling: RowSampling
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[R, B, N]``: what the acceptance rule needs of every node (``accept.step_choices``)
        of the processed logits (penalties, bias, min_tokens: ``accept.processed_logits``), and
        the log-probabilities of the rows that asked for them (``accept.logprob_table``, else
        ``None``)."""
        cfg = self.config
        logits = processed_logits(logits, sampling, step.anc, step.depth)
        choices = step_choices(
            cfg.acceptance,
            step.tokens,
            step.parent,
            step.depth,
            logits,
            sampling,
            cfg.typical_eps,
            cfg.typical_delta,
        )
        if not sampling.logprob_rows:
            return choices, None
        pick = (
            choices[2] if cfg.acceptance == "typical" else choices[0]
        )  # the bonus after each node
        return choices, logprob_table(logits, pick, step.parent, step.tokens, sampling)

    def accept(self, tree, readout) -> HostAcceptance:
        """The accepted path of every row, walked on the host from the step's readout."""
        return walk(self.config.acceptance, tree, readout.values)

    def feedback(
        self, host, state: DecodeState | None, prop: Proposal, tree, acc: HostAcceptance
    ) -> np.ndarray:
        """Tell every drafter called what happened to its paths, update the acceptance rates;
        returns the credit ``[B, drafters]``: accepted draft tokens each drafter had proposed (a
        token several drafters proposed counts for each)."""
        B, P, L = prop.paths.shape
        nd = len(self.drafters)
        if P == 0:
            return np.zeros((B, nd), np.int64)
        # path entries on the accepted path, accepted tokens per drafter, accepted leading
        # tokens per path ([B, P])
        _, credit, prefix = step_feedback_np(tree, acc.path, prop.owner, nd)
        kept = tree.path_node >= 0
        verified = kept.sum(axis=-1)
        fb = None
        for i, dr, a, b in prop.drafts:
            d = self.drafters[i]
            if d.host:
                d.observe_host(host, dr, HostFeedback(prefix[:, a:b], acc, verified[:, a:b]))
            else:
                fb = fb or _device_feedback(acc, state.device)
                d.observe(
                    state,
                    dr.device_draft,
                    dataclasses.replace(
                        fb,
                        accepted_prefix=torch.from_numpy(prefix[:, a:b]).to(state.device),
                        verified=torch.from_numpy(verified[:, a:b]).to(state.device),
                    ),
                )
        if self.config.adapt:
            self.stats.update(prop.owner, prop.paths, prefix, prop.group, kept=kept)
        return credit

    def after_step(
        self, prop: Proposal, acc: HostAcceptance, credit: np.ndarray, secs: tuple[float, float]
    ) -> np.ndarray | None:
        """Host-side bookkeeping: drafting-time averages, the gate's exclusive gains, the guard.
        Returns the exclusive gains per row, ``[B, drafters called]`` in call order, where two or
        more drafters were called (the requests' stats count them), else ``None``."""
        n_acc = acc.num_accepted
        if prop.marks:  # drafters ran (not a plain step)
            self._draft_times.append(secs[0])
        for i, m0, m1 in prop.marks:
            self.gate.record_time(i, self._clock.seconds(m0, m1))
        called = [i for i, _, _ in prop.marks]
        B, accepted = len(n_acc), int(n_acc.sum())
        gains = None
        if len(called) > 1:
            gains = exclusive_gains(credit, called, n_acc)
            exclusive = {i: float(g) / B for i, g in zip(called, gains.sum(axis=0).tolist())}
        elif called:  # alone, every accepted token is the drafter's own
            exclusive = {called[0]: accepted / B}
        if called:  # a plain step (the guard's) says nothing about the drafters
            self.gate.update(secs[0] + secs[1], accepted / B + 1.0, exclusive)
        self.guard.record(B, bool(called), accepted + B, secs[0] + secs[1])
        return gains


def exclusive_gains(credit: np.ndarray, called: list[int], n_acc: np.ndarray) -> np.ndarray:
    """``[B, len(called)]``: per row, the accepted draft tokens of the step that no other called
    drafter had proposed (``credit [B, drafters]``: each drafter's accepted tokens), for two or
    more drafters called (one called alone has every accepted token to itself)."""
    c = credit[:, called]
    best_other = np.stack([np.delete(c, k, axis=1).max(axis=1) for k in range(len(called))], 1)
    return np.maximum(0, n_acc[:, None] - best_other)


_EMPTY_PATHS = np.full((1 << 16, 0, 1), PAD, np.int64)  # [B, 0, 1] views for plain steps
_EMPTY_OWNER = np.zeros(0, np.int64)


_EMPTY_PATHS = np.full((1 << 16, 0, 1), PAD, np.int64)  # [B, 0, 1] views for plain steps
_EMPTY_OWNER = np.zeros(0, np.int64)


def _to_host(dr: Draft) -> Draft:
    """A device drafter's draft as host arrays (its paths are read back: a device read)."""
    return Draft(
        tokens=dr.tokens.cpu().numpy().astype(np.int64),
        logp=None if dr.logp is None else dr.logp.float().cpu().numpy(),
        group=None if dr.group is None else dr.group.cpu().numpy().astype(np.int64),
    )


def _device_feedback(acc: HostAcceptance, device) -> Feedback:
    """The step's result as device tensors, for drafters that learn on the device."""
    B = len(acc.num_accepted)
    A = max(1, int(acc.num_accepted.max()))
    accepted = np.full((B, A), PAD, np.int64)
    for b, e in enumerate(acc.emitted):
        accepted[b, : len(e) - 1] = e[:-1]
    up = torch.from_numpy(
        np.concatenate([accepted, acc.num_accepted[:, None], acc.bonus[:, None]], axis=1)
    ).to(device)
    return Feedback(
        accepted_prefix=None,
        accepted=up[:, :A],
        num_accepted=up[:, A],
        bonus=up[:, A + 1],
        verified=None,
    )

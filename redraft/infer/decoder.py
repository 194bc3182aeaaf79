"""The speculative decoder: draft -> tree -> verify -> accept -> commit, for a batch of requests.

    decoder = SpeculativeDecoder(target, [NGrammysDrafter(tables, V), ReDrafterDrafter(head)])
    out = decoder.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=128)
    out[0].text, out[0].stats.tokens_per_call

What a step does (``redraft.infer.engine.Engine.step`` runs them in order):

1. :meth:`SpeculativeDecoder.propose`: every drafter the gate lets through proposes paths
   continuing the last token ``y`` of each row; each entry gets a value, its estimated chance of
   being accepted (observed acceptance rate of its drafter, path group and depth);
2. :meth:`SpeculativeDecoder.build_tree`: the node budget that maximises expected tokens per
   unit of verify time, and one tree of the best nodes with shared prefixes stored once (numpy,
   ``redraft.infer.hostdraft``);
3. ``Verifier.verify``: one target forward over ``[y, tree nodes]`` with a 4D mask over cache +
   tree and depth-based position ids;
4. :meth:`SpeculativeDecoder.choices` (on the device) and :meth:`SpeculativeDecoder.accept` (on
   the host): greedy / rejection / typical acceptance picks the accepted path and the bonus
   token;
5. the cache keeps only the accepted path's keys and values (``Engine._commit``), drafters
   observe what was accepted and each drafter is credited with its accepted tokens
   (:meth:`SpeculativeDecoder.feedback`), the rates, the gate and the per-request stats are
   updated (:meth:`SpeculativeDecoder.after_step`), finished rows leave the batch and new ones
   join.

With no drafters the same loop is plain autoregressive decoding (the tree is the root alone),
which is the baseline every speculative result is compared with.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.infer import hostjit
from redraft.infer.accept import (
    HostAcceptance,
    RowSampling,
    logprob_table,
    processed_logits,
    step_choices,
    walk,
)
from redraft.infer.budget import BatchCost, CostCurve, DrafterGate, SpeculationGuard
from redraft.infer.config import DecoderConfig, SamplingParams
from redraft.infer.drafters.base import (
    PAD,
    DecodeState,
    Draft,
    Drafter,
    Feedback,
    HostFeedback,
    pad_paths_np,
)
from redraft.infer.engine import Engine
from redraft.infer.hostdraft import (
    HostStats,
    HostTables,
    best_budget_np,
    context_matches_np,
    ngrammys_np,
)
from redraft.infer.hosttree import build_tree_np, clean_paths_np, step_feedback_np
from redraft.infer.rows import Clock
from redraft.infer.stats import Generation, StreamEvent
from redraft.infer.verify import Verifier, measure_batch_cost


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


class SpeculativeDecoder:
    """Lossless tree speculative decoding with any mix of drafters.

    Args:
        target: a :class:`redraft.models.Target`.
        drafters: drafters whose paths are merged into one tree each step (empty: plain
            autoregressive decoding).
        config: a :class:`~redraft.infer.config.DecoderConfig` (default: its defaults).
        cost_curve: a :class:`~redraft.infer.budget.CostCurve` to use instead of measuring one
            at the first step (only with the "auto" budget).
        **settings: :class:`DecoderConfig` fields overriding ``config`` (``budget=12``,
            ``acceptance="rejection"``, ...); unknown names are errors.
    """

    def __init__(
        self,
        target,
        drafters: Sequence[Drafter] = (),
        config: DecoderConfig | None = None,
        *,
        cost_curve: CostCurve | None = None,
        **settings,
    ):
        config = config or DecoderConfig()
        self.config = config.replace(**settings) if settings else config
        self.target = target
        self.model = target.model
        # the thread that built the decoder (its weights packed here): an engine made on another
        # thread of a CPU process warns (engine.check_thread)
        self.home_thread = threading.get_ident()
        self.drafters = list(drafters)
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ConfigError(f"drafter names must be unique (they label stats): {names}")
        cfg = self.config
        dev = target.device
        static = cfg.static_verify if cfg.static_verify != "auto" else dev.type == "cuda"
        self.verifier = Verifier(
            target,
            fp32_logits=cfg.fp32_logits,
            cpu_pack=cfg.cpu_pack,
            static=static,
            span_buckets=static if cfg.span_buckets == "auto" else cfg.span_buckets,
        )
        self.verifier.hidden_layers = lower_hidden_layers(self.drafters)
        self.cost_curve = cost_curve
        self.eos = set(target.eos_token_ids)
        self.stats = HostStats(len(self.drafters))
        if self.drafters:
            warm_host_kernels()  # compiled now, not inside a timed or served step
        for i, d in enumerate(self.drafters):  # drafters that plan from the decoder's measurements
            if hasattr(d, "bind"):
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
        self.generator: torch.Generator | None = (
            None  # the shared sampling generator (None: torch's)
        )
        self._clock = Clock(dev)
        self._draft_overhead = 0.0  # EMA of drafting seconds per step (part of the budget's cost)
        self._costs = None  # (cost curve, its table c(0..n) as numpy)
        self._engine: Engine | None = (
            None  # the engine generate() reuses while idle (its cache and graphs)
        )

    # ------------------------------------------------------------------ inputs

    def encode(self, inputs) -> list[list[int]]:
        """Normalise inputs to a batch of token-id lists.

        Accepts a string (plain text), a chat (list of ``{"role", "content"}`` dicts; the
        tokenizer's template with the generation prompt), a list of token ids, a 1-D tensor or
        NumPy array, or a non-empty list of any of these (a batch; a 2-D tensor or array too).
        Text must be valid Unicode (a lone surrogate such as ``"\\ud83d"`` is an error naming it).
        """
        inputs = _from_numpy(inputs)

        def is_chat(x):
            return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(m, dict) for m in x)

        def is_ids(x):
            return (
                isinstance(x, (list, tuple))
                and bool(x)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
            )

        def one(x, i):
            x = _from_numpy(x)
            if isinstance(x, str):
                _check_unicode(x, f"prompt {i}", "prompt")
                return list(self.target.tokenizer(x, add_special_tokens=False)["input_ids"])
            if is_chat(x):
                for j, m in enumerate(x):
                    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                        raise ConfigError(
                            f"prompt {i}, message {j}: a chat message needs a string 'role' and a "
                            f"string 'content' (got keys {sorted(m)}).",
                            param="messages",
                        )
                    _check_unicode(m["content"], f"prompt {i}, message {j}", "messages")
                return self.target.chat_ids(list(x))
            if isinstance(x, torch.Tensor) and x.dim() == 1:
                return [int(t) for t in x.tolist()]
            if is_ids(x):
                return list(x)
            if isinstance(x, (list, tuple)) and not x:
                raise ConfigError(f"prompt {i} is empty; give at least one token.", param="prompt")
            raise ConfigError(
                f"prompt {i}: cannot read a prompt of type {type(x).__name__}; pass text, a chat "
                f"(list of role/content dicts) or token ids.",
                param="prompt",
            )

        if (
            isinstance(inputs, str)
            or is_chat(inputs)
            or is_ids(inputs)
            or (isinstance(inputs, torch.Tensor) and inputs.dim() == 1)
        ):
            return [one(inputs, 0)]
        if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
            return [one(row, i) for i, row in enumerate(inputs)]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise ConfigError(
                f"no prompts: pass text, a chat, token ids or a non-empty list of them "
                f"(got {type(inputs).__name__} {inputs!r:.40}).",
                param="prompt",
            )
        return [one(x, i) for i, x in enumerate(inputs)]

    # ------------------------------------------------------------------ decoding

    def engine(self, text: bool = True) -> Engine:
        """A step-level :class:`~redraft.infer.engine.Engine` (continuous batching) over this
        decoder: ``add`` requests, ``step`` until ``has_work`` is false, ``cancel`` any time.
        ``text=False``: events and generations carry token ids only (their text is empty; no
        stop strings), which saves the per-step detokenisation of every row."""
        return Engine(self, text=text)

    @torch.no_grad()
    def stream(
        self,
        inputs,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> Iterator[StreamEvent]:
        """Decode and yield :class:`StreamEvent` s as tokens are accepted (text deltas per request).

        Args:
            inputs: see :meth:`encode` (one prompt or a batch).
            max_new_tokens: new tokens per request at most.
            temperature: 0 for greedy; > 0 samples (needs acceptance "rejection", lossless, or
                "typical").
            top_p: nucleus sampling threshold (with temperature > 0).
            stop: a string or strings that end a request (the text is cut before the first).
            seed: makes sampling reproducible: prompt ``i`` samples with its own seed
                (:func:`row_seed`; drafters that sample use it too), so the same seed gives the
                same text on any decoder.
        """
        params = SamplingParams.checked(max_new_tokens, temperature, top_p, stop, seed)
        prompts = self.encode(inputs)
        engine = (
            self._engine
            if self._engine is not None and not self._engine.has_work
            else self.engine()
        )
        self._engine = engine
        # a seed is per request (prompt i: row_seed(seed, i)): its tokens are drawn with its own
        # uniforms, so the same seed gives the same text on any decoder, whatever the drafts,
        # the batch or what the decoder learnt from earlier requests
        index = {
            engine.add(
                p, params if seed is None else dataclasses.replace(params, seed=row_seed(seed, i))
            ): i
            for i, p in enumerate(prompts)
        }  # request id -> prompt
        while engine.has_work:
            for ev in engine.step():
                yield dataclasses.replace(ev, index=index[ev.index])

    def generate(
        self,
        inputs,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        seed: int | None = None,
    ):
        """Decode a prompt or a batch; returns a list of :class:`Generation` (one per prompt),
        or, with ``stream=True``, the iterator of :meth:`stream`."""
        it = self.stream(inputs, max_new_tokens, temperature, top_p, stop, seed)
        if stream:
            return it
        results = {ev.index: ev.generation for ev in it if ev.done}
        return [results[i] for i in sorted(results)]

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
        secs = self.batch_cost(batch, ks + 1) + self._draft_overhead
        return bool((gain / secs).max() > batch / float(self.batch_cost(batch, 1)))

    # ------------------------------------------------------------------ the step's pieces

    @property
    def device_drafters(self) -> bool:
        """Whether a drafter drafts on the device (the engine then keeps a device state)."""
        return any(not d.host for d in self.drafters)

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
        """The packed tree of this step (numpy, see ``redraft.infer.hostdraft``): the node
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
            k = best_budget_np(
                values, self._cost_table(), cfg.max_nodes, self._draft_overhead, self.batch_cost
            )
            self._last_values = values  # kept, not sorted: the guard rarely reads it
            budget, size = k, None
            if k > 0:  # (a larger tree that measured cheaper is filled up to its size)
                size = verifier.tree_size(
                    1 + min(k, P * L),
                    limit=1 + cfg.max_nodes,
                    curve=self.cost_curve if B == 1 else None,
                )
                budget = size - 1
                size = size if verifier.static else None
            elif verifier.static:
                size = verifier.tree_size(1)
        return build_tree_np(prop.paths, prop.values, budget, root=host.last, size=size)

    def _cost_table(self) -> np.ndarray:
        B_max = 256 * (self.config.max_nodes + 1)
        if self._costs is None or self._costs[0] is not self.cost_curve:
            self._costs = (self.cost_curve, self.cost_curve.table(B_max, "cpu").numpy())
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
            self._draft_overhead = 0.8 * self._draft_overhead + 0.2 * secs[0]
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


_WARM = threading.Lock()
_warmed = False


def warm_host_kernels() -> None:
    """Compile (or load from numba's disk cache) the host kernels of ``hostjit`` with the
    argument types decoding passes them, once per process: a kernel compiled at its first use
    would stall that step for a second or more (all of them: seconds on a small CPU the first
    time on a machine, a fraction of a second from the cache after; ``tests/infer/test_hostjit.py`` checks that
    decoding then compiles nothing). Signatures not met here (rarer dtypes) still compile at
    first use. A no-op where numba is not in use."""
    global _warmed
    if _warmed or not hostjit.ENABLED:
        return
    with _WARM:
        if _warmed:
            return
        from redraft.infer.beamcost import BeamCost, plan_beam

        paths = np.array([[[1, 2, -1], [1, 3, 4]]], np.int64)
        values = np.array([[[0.5, 0.25, 0.0], [0.5, 0.2, 0.1]]], np.float32)
        last = np.array([9], np.int64)
        for tree in (
            build_tree_np(paths, values, 3, root=last),
            build_tree_np(paths, root=last, size=6),
            build_tree_np(np.zeros((1, 0, 1), np.int64), root=last, size=1),  # plain step
        ):
            N = tree.tokens.shape[1]
            for rule, R in (("greedy", 1), ("typical", 3)):
                acc = walk(rule, tree, np.zeros((R, 1, N), np.int64))
            step_feedback_np(tree, acc.path, np.array([0, 1], np.int64), 2)
        stats = HostStats(2)
        for owner, group in ((np.array([0, 1], np.int64), np.zeros((1, 2), np.int64)), (0, None)):
            stats.values(owner, paths.shape, group)
            stats.update(owner, paths, np.ones((1, 2), np.int64), group, paths >= 0)
        best_budget_np(np.ones((1, 4), np.float32), np.arange(10, dtype=np.float32), 4)
        row = np.array([5, 1, 2, 5, 1], np.int64)
        context_matches_np([row], 1, 3, 8, 12, 16)
        context_matches_np([row, row[:3]], 1, 3, 8, 12, 16)
        tables = HostTables(extended=np.zeros((16, 2, 3), np.int32))
        ngrammys_np([row], last[:1] % 16, tables, 16, 8, 12, 1, 3)
        curve = CostCurve([1, 8], [0.01, 0.02])
        plan_beam(
            np.full((32, 5), 0.3), np.eye(2, 6), BeamCost(curve, curve), curve, 1, [1, 2], [1]
        )
        hostjit._beam_groups(np.zeros((1, 2, 3), np.int64), np.eye(2, 6), 0.9, 5, 5)
        _warmed = True


def exclusive_gains(credit: np.ndarray, called: list[int], n_acc: np.ndarray) -> np.ndarray:
    """``[B, len(called)]``: per row, the accepted draft tokens of the step that no other called
    drafter had proposed (``credit [B, drafters]``: each drafter's accepted tokens), for two or
    more drafters called (one called alone has every accepted token to itself)."""
    c = credit[:, called]
    best_other = np.stack([np.delete(c, k, axis=1).max(axis=1) for k in range(len(called))], 1)
    return np.maximum(0, n_acc[:, None] - best_other)


_EMPTY_PATHS = np.full((1 << 16, 0, 1), PAD, np.int64)  # [B, 0, 1] views for plain steps
_EMPTY_OWNER = np.zeros(0, np.int64)


def lower_hidden_layers(drafters) -> tuple[int, ...]:
    """The layers below the last whose hidden states the verify forward must also return, for
    the drafters that read several (multi-layer ReDrafter heads: ``hidden_layers``, the last
    layer last); ``()`` when none does (the forward is then unchanged). Drafters that read
    different layer sets cannot share one decoder (``DecodeState.hidden`` has one layout)."""
    sets = {tuple(getattr(d, "hidden_layers", ())) for d in drafters} - {()}
    if len(sets) > 1:
        raise ConfigError(
            f"drafters read the target's hidden states of different layer sets ({sorted(sets)}); "
            f"use heads trained with the same feature_layers in one decoder."
        )
    return sets.pop()[:-1] if sets else ()


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


def row_seed(seed: int, i: int) -> int:
    """The seed of prompt ``i`` of a batch given ``seed`` (prompt 0 keeps ``seed`` itself)."""
    return (int(seed) * 1_000_003 + i) % (1 << 63)


def _from_numpy(x):
    """A NumPy array of token ids as a tensor (``encode`` reads tensors); anything else as is."""
    if type(x).__module__ != "numpy" or not hasattr(x, "dtype"):
        return x
    if x.dtype.kind not in "iu":
        raise ConfigError(
            f"token ids must be integers; got a NumPy array of dtype {x.dtype}.", param="prompt"
        )
    return torch.as_tensor(x.astype("int64", copy=False))


def _check_unicode(text: str, where: str, param: str) -> None:
    """A tokenizer cannot encode a lone UTF-16 surrogate (``"\\ud83d"`` without its pair): name it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{where} holds a lone UTF-16 surrogate {text[exc.start]!r} at character {exc.start}, "
            f"which is not valid Unicode; pass valid text (decode bytes with errors='replace').",
            param=param,
        ) from None


@torch.no_grad()
def plain_greedy(target, inputs, max_new_tokens: int = 128, **kw) -> list[Generation]:
    """Plain autoregressive greedy decoding with the same model and cache (the baseline)."""
    return SpeculativeDecoder(target, [], budget=0).generate(
        inputs, max_new_tokens=max_new_tokens, **kw
    )

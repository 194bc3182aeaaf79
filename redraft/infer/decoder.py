"""The speculative decoder: draft -> tree -> verify -> accept -> commit, for a batch of requests.

    decoder = SpeculativeDecoder(target, [NGrammysDrafter(tables, V), ReDrafterDrafter(head)])
    out = decoder.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=128)
    out[0].text, out[0].stats.tokens_per_call

What a step does (``redraft.infer.engine.Engine.step`` runs them in order):

1. :meth:`SpeculativeDecoder.propose`: every drafter the gate lets through proposes paths
   continuing the last token ``y`` of each row; each entry gets a value, its estimated chance of
   being accepted (observed acceptance rate of its drafter, path group and depth);
2. :meth:`SpeculativeDecoder.choose_budget` and ``tree.build_tree``: the node budget that
   maximises expected tokens per unit of verify time, and one tree of the best nodes with shared
   prefixes stored once;
3. ``Verifier.verify``: one target forward over ``[y, tree nodes]`` with a 4D mask over cache +
   tree and depth-based position ids;
4. :meth:`SpeculativeDecoder.accept`: greedy / rejection / typical acceptance picks the accepted
   path and the bonus token; :meth:`SpeculativeDecoder.credit` counts each drafter's accepted
   tokens;
5. the cache keeps only the accepted path's keys and values (``TreeKVCache.commit``), drafters
   observe what was accepted (:meth:`SpeculativeDecoder.feedback`), the rates, the gate and the
   per-request stats are updated, finished rows leave the batch and new ones join.

With no drafters the same loop is plain autoregressive decoding (the tree is the root alone),
which is the baseline every speculative result is compared with.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from redraft.errors import ConfigError
from redraft.infer.accept import ACCEPT, Acceptance, RowSampling, accepted_tokens
from redraft.infer.budget import AcceptanceStats, CostCurve, DrafterGate, SpeculationGuard, best_budget
from redraft.infer.config import DecoderConfig, SamplingParams
from redraft.infer.drafters.base import PAD, DecodeState, Drafter, Feedback, clean_paths, pad_paths
from redraft.infer.engine import Engine, _Clock
from redraft.infer.stats import Generation, StreamEvent
from redraft.infer.tree import Tree, cached_arange
from redraft.infer.verify import Verifier


@dataclass
class Proposal:
    """The paths of every drafter called in one step, merged.

    Attributes:
        paths: ``[B, P, L]`` all drafters' paths side by side (``PAD``-padded).
        values: ``[B, P, L]`` estimated acceptance probability of every entry.
        owner: ``[P]`` long: the drafter (index into ``decoder.drafters``) of every path.
        group: ``[B, P]`` long: every path's statistics group (its rank when the drafter gave none).
        drafts: ``(drafter index, its Draft, first path, end path)`` per drafter called.
        raw_entries: ``[B]`` long draft tokens proposed per row (before pruning and sharing).
        marks: ``(drafter index, clock mark before, after)`` for drafting times.
        k: the budget the cost model chose (``[B]`` on the device) when it is not the tree's own
            (static trees are filled to their size); read back to size the next step's tree.
    """

    paths: torch.Tensor
    values: torch.Tensor
    owner: torch.Tensor
    group: torch.Tensor
    drafts: list
    raw_entries: torch.Tensor
    marks: list
    k: torch.Tensor | None = None


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

    def __init__(self, target, drafters: Sequence[Drafter] = (), config: DecoderConfig | None = None, *,
                 cost_curve: CostCurve | None = None, **settings):
        config = config or DecoderConfig()
        self.config = config.replace(**settings) if settings else config
        self.target = target
        self.model = target.model
        self.drafters = list(drafters)
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ConfigError(f"drafter names must be unique (they label stats): {names}")
        cfg = self.config
        dev = target.device
        static = cfg.static_verify if cfg.static_verify != "auto" else dev.type == "cuda"
        self.verifier = Verifier(target, fp32_logits=cfg.fp32_logits, cpu_pack=cfg.cpu_pack, static=static)
        self.cost_curve = cost_curve
        self.eos = set(target.eos_token_ids)
        self.stats = AcceptanceStats(len(self.drafters), device=dev)
        self.gate = DrafterGate(len(self.drafters), cfg.gate_explore,
                                enabled=cfg.gate and len(self.drafters) > 1 and cfg.budget == "auto")
        self.guard = SpeculationGuard(cfg.gate_explore, enabled=cfg.guard and bool(self.drafters) and cfg.budget == "auto")
        self.generator: torch.Generator | None = None  # the shared sampling generator (None: torch's)
        self._accept = ACCEPT[cfg.acceptance]
        self._clock = _Clock(dev)
        self._draft_overhead = 0.0  # EMA of drafting seconds per step (part of the budget's cost)
        self._k_hint = cfg.max_nodes  # last step's chosen budget: the static tree size of the next

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
            return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                     for t in x)

        def one(x, i):
            x = _from_numpy(x)
            if isinstance(x, str):
                _check_unicode(x, f"prompt {i}", "prompt")
                return list(self.target.tokenizer(x, add_special_tokens=False)["input_ids"])
            if is_chat(x):
                for j, m in enumerate(x):
                    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                        raise ConfigError(f"prompt {i}, message {j}: a chat message needs a string 'role' and a "
                                          f"string 'content' (got keys {sorted(m)}).", param="messages")
                    _check_unicode(m["content"], f"prompt {i}, message {j}", "messages")
                return self.target.chat_ids(list(x))
            if isinstance(x, torch.Tensor) and x.dim() == 1:
                return [int(t) for t in x.tolist()]
            if is_ids(x):
                return list(x)
            if isinstance(x, (list, tuple)) and not x:
                raise ConfigError(f"prompt {i} is empty; give at least one token.", param="prompt")
            raise ConfigError(f"prompt {i}: cannot read a prompt of type {type(x).__name__}; pass text, a chat "
                              f"(list of role/content dicts) or token ids.", param="prompt")

        if isinstance(inputs, str) or is_chat(inputs) or is_ids(inputs) or (
                isinstance(inputs, torch.Tensor) and inputs.dim() == 1):
            return [one(inputs, 0)]
        if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
            return [one(row, i) for i, row in enumerate(inputs)]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise ConfigError(f"no prompts: pass text, a chat, token ids or a non-empty list of them "
                              f"(got {type(inputs).__name__} {inputs!r:.40}).", param="prompt")
        return [one(x, i) for i, x in enumerate(inputs)]

    # ------------------------------------------------------------------ decoding

    def engine(self) -> Engine:
        """A step-level :class:`~redraft.infer.engine.Engine` (continuous batching) over this
        decoder: ``add`` requests, ``step`` until ``has_work`` is false, ``cancel`` any time."""
        return Engine(self)

    @torch.no_grad()
    def stream(self, inputs, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               stop: str | Sequence[str] | None = None, seed: int | None = None) -> Iterator[StreamEvent]:
        """Decode and yield :class:`StreamEvent` s as tokens are accepted (text deltas per request).

        Args:
            inputs: see :meth:`encode` (one prompt or a batch).
            max_new_tokens: new tokens per request at most.
            temperature: 0 for greedy; > 0 samples (needs acceptance "rejection", lossless, or
                "typical").
            top_p: nucleus sampling threshold (with temperature > 0).
            stop: a string or strings that end a request (the text is cut before the first).
            seed: seeds the batch's sampling generator (drafters that sample use it too).
        """
        params = SamplingParams.checked(max_new_tokens, temperature, top_p, stop, seed)
        prompts = self.encode(inputs)
        engine = self.engine()
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(seed)
        shared = dataclasses.replace(params, seed=None)
        for p in prompts:
            engine.add(p, shared, generator=gen)
        while engine.has_work:
            yield from engine.step()

    def generate(self, inputs, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 stop: str | Sequence[str] | None = None, stream: bool = False, seed: int | None = None):
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

    # ------------------------------------------------------------------ the step's pieces

    def propose(self, state: DecodeState, speculate: bool = True) -> Proposal:
        """Call the drafters the gate lets through (none for a plain step, ``speculate=False``);
        merge their paths and value every entry."""
        B, dev = state.batch_size, state.device
        drafts, marks = [], []
        for i in (self.gate.active() if speculate else ()):
            m0 = self._clock.mark()
            dr = self.drafters[i].propose(state)
            marks.append((i, m0, self._clock.mark()))
            if dr.num_paths:
                drafts.append((i, dr))
        if not drafts:
            empty = torch.full((B, 0, 1), PAD, dtype=torch.long, device=dev)
            z = torch.zeros(B, dtype=torch.long, device=dev)
            return Proposal(empty, empty.float(), empty.new_zeros(0), empty[:, :, 0], [], z, marks)
        L = max(dr.path_length for _, dr in drafts)
        toks, owner, group, slices, start = [], [], [], [], 0
        for i, dr in drafts:
            t = clean_paths(pad_paths(dr.tokens.to(dev), L))
            p = t.shape[1]
            toks.append(t)
            owner.append(_filled(p, i, dev))
            group.append(cached_arange(p, dev)[None].expand(B, p) if dr.group is None else dr.group.to(dev).long())
            slices.append((i, dr, start, start + p))
            start += p
        if len(drafts) == 1:  # the common single-drafter step: nothing to merge
            paths, owner, group = toks[0], owner[0], group[0]
        else:
            paths, owner, group = torch.cat(toks, 1), torch.cat(owner), torch.cat(group, 1)
        values = self.stats.values(owner, tuple(paths.shape), group)
        if self.config.budget != "auto":  # fixed budget: rank by the drafter's own path probability
            for i, dr, a, b in slices:
                if dr.logp is not None:
                    values[:, a:b] = pad_paths(dr.logp.float().cumsum(-1).exp().to(dev), L).clamp_min(0)
        return Proposal(paths, values, owner, group, slices, (paths >= 0).sum(dim=(1, 2)), marks)

    def choose_budget(self, prop: Proposal, verifier: Verifier):
        """``(budget, size)`` for ``build_tree``: nodes to keep per row, and the packed tree size
        when the verifier needs it static (else ``None``: the real node count)."""
        B, P, L = prop.paths.shape
        cfg = self.config
        if P == 0:
            return None, (verifier.tree_size(1) if verifier.static else None)
        if cfg.budget != "auto":
            if not verifier.static:
                return cfg.budget, None
            size = verifier.tree_size(1 + min(cfg.budget, P * L), limit=1 + cfg.budget)
            return size - 1, size
        if self.cost_curve is None:
            self.measure_cost()
        values = torch.where(prop.paths >= 0, prop.values, torch.zeros_like(prop.values)).reshape(B, -1)
        k = best_budget(values, self.cost_curve, cfg.max_nodes, self._draft_overhead)  # [B] on the device
        if not verifier.static:
            return k, None
        # static shapes: the tree size comes from the host (last step's budget), filled with the best nodes
        size = verifier.tree_size(1 + min(self._k_hint, P * L, cfg.max_nodes), limit=1 + cfg.max_nodes)
        prop.k = k
        return size - 1, size

    def accept(self, tree: Tree, logits: torch.Tensor, sampling: RowSampling) -> Acceptance:
        """The acceptance rule chosen at construction."""
        if self.config.acceptance == "typical":
            return self._accept(tree, logits, sampling, self.config.typical_eps, self.config.typical_delta)
        return self._accept(tree, logits, sampling)

    def credit(self, prop: Proposal, tree: Tree, acc: Acceptance) -> tuple[torch.Tensor, torch.Tensor]:
        """``(credit [B, drafters], hit [B, P, L])``: accepted draft tokens each drafter had
        proposed (a token several drafters proposed counts for each), and which path entries lie
        on the accepted path."""
        B, P, L = prop.paths.shape
        nd = max(len(self.drafters), 1)
        dev = prop.paths.device
        if P == 0:
            return torch.zeros((B, len(self.drafters)), dtype=torch.long, device=dev), prop.paths >= 0
        N = tree.size
        on_path = tree.anc[torch.arange(B, device=dev), acc.last_node]  # [B, N]
        node = tree.path_node.clamp_min(0)
        hit = (tree.path_node >= 0) & on_path.gather(1, node.reshape(B, -1)).reshape(B, P, L)
        idx = (prop.owner[None, :, None] * N + node).reshape(B, -1)
        cred = torch.zeros((B, nd * N), dtype=torch.uint8, device=dev)
        cred.scatter_reduce_(1, idx, hit.reshape(B, -1).to(torch.uint8), reduce="amax")
        return cred.view(B, nd, N)[:, : len(self.drafters), 1:].sum(dim=-1), hit

    def feedback(self, state: DecodeState, prop: Proposal, tree: Tree, acc: Acceptance, hit: torch.Tensor) -> None:
        """Tell every drafter called what happened to its paths, and update the acceptance rates."""
        if not prop.drafts:
            return
        prefix = hit.long().cumprod(dim=-1).sum(dim=-1)  # [B, P] accepted leading tokens per path
        kept = tree.path_node >= 0
        verified = kept.sum(dim=-1)
        accepted = accepted_tokens(tree, acc)
        for i, dr, a, b in prop.drafts:
            fb = Feedback(accepted_prefix=prefix[:, a:b], accepted=accepted, num_accepted=acc.num_accepted,
                          bonus=acc.bonus, verified=verified[:, a:b])
            self.drafters[i].observe(state, dr, fb)
        if self.config.adapt:
            self.stats.update(prop.owner, prop.paths, prefix, prop.group, kept=kept)

    def after_step(self, prop: Proposal, host: list[list[int]], secs: tuple[float, float], n_acc: list[int]) -> None:
        """Host-side bookkeeping from the step's one read: drafting-time averages, the gate's
        exclusive gains, the next static tree size."""
        nd = len(self.drafters)
        if prop.marks:  # drafters ran (not a plain step)
            self._draft_overhead = 0.8 * self._draft_overhead + 0.2 * secs[0]
        if prop.k is not None:
            self._k_hint = max(r[-1] for r in host)
        for i, m0, m1 in prop.marks:
            self.gate.record_time(i, self._clock.seconds(m0, m1))
        called = [i for i, _, _ in prop.marks]
        exclusive = {}
        if nd:
            D1 = len(host[0]) - 5 - nd
            credit = [r[1 + D1:1 + D1 + nd] for r in host]
            for i in called:
                gain = [max(0, n - max((c[j] for j in called if j != i), default=0)) for n, c in zip(n_acc, credit)]
                exclusive[i] = sum(gain) / len(gain)
        if called:  # a plain step (the guard's) says nothing about the drafters
            self.gate.update(secs[0] + secs[1], sum(n_acc) / len(n_acc) + 1.0, exclusive)
        self.guard.record(len(n_acc), bool(called), sum(n_acc) + len(n_acc), secs[0] + secs[1])


def _from_numpy(x):
    """A NumPy array of token ids as a tensor (``encode`` reads tensors); anything else as is."""
    if type(x).__module__ != "numpy" or not hasattr(x, "dtype"):
        return x
    if x.dtype.kind not in "iu":
        raise ConfigError(f"token ids must be integers; got a NumPy array of dtype {x.dtype}.", param="prompt")
    return torch.as_tensor(x.astype("int64", copy=False))


def _check_unicode(text: str, where: str, param: str) -> None:
    """A tokenizer cannot encode a lone UTF-16 surrogate (``"\\ud83d"`` without its pair): name it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{where} holds a lone UTF-16 surrogate {text[exc.start]!r} at character {exc.start}, "
                          f"which is not valid Unicode; pass valid text (decode bytes with errors='replace').",
                          param=param) from None


@functools.lru_cache(maxsize=256)
def _filled(n: int, value: int, device) -> torch.Tensor:
    """``[n]`` long filled with ``value`` (made once per shape: the owner of a drafter's paths)."""
    return torch.full((n,), value, dtype=torch.long, device=device)


@torch.no_grad()
def plain_greedy(target, inputs, max_new_tokens: int = 128, **kw) -> list[Generation]:
    """Plain autoregressive greedy decoding with the same model and cache (the baseline)."""
    return SpeculativeDecoder(target, [], budget=0).generate(inputs, max_new_tokens=max_new_tokens, **kw)

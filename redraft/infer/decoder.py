"""The speculative decoder: draft -> tree -> verify -> accept -> commit, for a batch of requests.

    decoder = SpeculativeDecoder(target, [NGrammysDrafter(tables), ReDrafterDrafter(head)])
    out = decoder.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=128)
    out[0].text, out[0].stats.tokens_per_call

One step for the whole batch (rows = requests, each with its own cache length):

1. every drafter proposes paths continuing the last token ``y`` of each row (``Draft``);
2. the paths are scored (observed acceptance rate of their drafter, group and depth), pruned to
   the node budget that maximises expected tokens per unit of verify time, and merged into one
   tree with shared prefixes stored once (``tree.build_tree``);
3. one target forward verifies ``[y, tree nodes]`` with a 4D mask over cache + tree and
   depth-based position ids;
4. acceptance (greedy / rejection / typical) picks the accepted path and the bonus token;
5. the cache keeps only the accepted path's keys and values (``TreeKVCache.commit``), drafters
   observe what was accepted, finished rows leave the batch.

With no drafters the same loop is plain autoregressive decoding (the tree is the root alone),
which is the baseline every speculative result is compared with.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from redraft.errors import ConfigError
from redraft.models import cpu
from redraft.infer import accept as acc_mod
from redraft.infer.budget import AcceptanceStats, CostCurve, best_budget, measure_cost_curve
from redraft.infer.drafters.base import PAD, DecodeState, Drafter, Feedback, pad_paths
from redraft.infer.kv import TreeKVCache
from redraft.infer.tree import build_tree, prune_paths

ACCEPTANCE = ("greedy", "rejection", "typical")


@dataclass
class RequestStats:
    """Per-request decoding statistics.

    ``tokens_per_call`` = new tokens / target forwards, the prefill included (tau; exactly 1
    for plain decoding). Times are the
    batch's wall time for the steps this request took part in.
    """

    new_tokens: int = 0
    target_calls: int = 1  # the prefill produced the first token
    accepted_hist: Counter = field(default_factory=Counter)  # accepted draft tokens per call
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    total_time: float = 0.0
    drafter_accepted: Counter = field(default_factory=Counter)  # name -> accepted tokens it proposed
    tree_entries: int = 0  # draft tokens proposed (before prefix sharing, after pruning)
    tree_nodes: int = 0  # tree nodes verified (after sharing, root excluded)
    tree_entries_raw: int = 0  # draft tokens proposed before pruning

    @property
    def tokens_per_call(self) -> float:
        return self.new_tokens / max(self.target_calls, 1)

    def drafter_share(self) -> dict:
        total = sum(self.accepted_hist[k] * k for k in self.accepted_hist)
        return {k: v / max(total, 1) for k, v in self.drafter_accepted.items()}

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tokens_per_call": round(self.tokens_per_call, 4),
            "accepted_hist": dict(sorted(self.accepted_hist.items())),
            "draft_time_s": round(self.draft_time, 4),
            "verify_time_s": round(self.verify_time, 4),
            "prefill_time_s": round(self.prefill_time, 4),
            "total_time_s": round(self.total_time, 4),
            "drafter_accepted": dict(self.drafter_accepted),
            "drafter_share": {k: round(v, 4) for k, v in self.drafter_share().items()},
            "tree_entries_proposed": self.tree_entries_raw,
            "tree_entries": self.tree_entries,
            "tree_nodes": self.tree_nodes,
        }


@dataclass
class Generation:
    """One request's result: ``text`` (decoded new tokens, cut at a stop string), ``tokens``
    (new token ids), ``finish_reason`` ("eos", "length" or "stop") and ``stats``."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: RequestStats


@dataclass
class StreamEvent:
    """Text accepted in one step for request ``index`` (``done`` on its last event)."""

    index: int
    text: str
    tokens: list[int]
    done: bool = False
    generation: Generation | None = None


class SpeculativeDecoder:
    """Lossless tree speculative decoding with any mix of drafters.

    Args:
        target: a :class:`redraft.models.Target`.
        drafters: drafters whose paths are merged into one tree each step (empty: plain
            autoregressive decoding).
        acceptance: "greedy" (temperature 0; output equals plain greedy), "rejection"
            (lossless sampling; greedy when temperature is 0) or "typical" (Medusa's typical
            acceptance, not lossless).
        budget: nodes verified per step besides the root: an int, or "auto" to choose per step
            from the measured verify-cost curve and the drafters' observed acceptance rates.
        max_nodes: upper bound on nodes per step for "auto".
        cost_curve: a :class:`CostCurve` to use instead of measuring one at the first generate.
        fp32_logits: compute verify logits with a float32 LM head (matters for bf16 targets:
            fewer argmax flips at near-ties).
        typical_eps, typical_delta: typical-acceptance thresholds.
        adapt: update per-drafter acceptance rates during decoding (node values for pruning).
        gate: with several drafters and budget "auto", skip calling a drafter while the tokens
            only it gets accepted are worth less time than its drafting costs (pruning drops a
            weak drafter's nodes, but its drafting time is paid before pruning); every
            ``gate_explore`` steps a skipped drafter runs again to refresh its estimate; each
            run that finds it still not worth it doubles that wait (up to 16x), so a useless
            drafter ends up costing almost nothing.
            Skipping a drafter never changes the output, only the speed.
        cpu_pack: on CPU, use faster layouts (``redraft.models.cpu``; the model itself is not
            modified, derived weights are shared by all decoders over it): the LM head as a
            contiguous ``W.T`` copy, and for a float32 target a oneDNN-packed copy of every
            linear layer for multi-token forwards. Verifying 8 tokens in float32 then costs
            ~1.6x one token instead of ~2.1x on the 2-core Xeon, for a second copy of the
            weights. One-token forwards of the layers use the original weights.
    """

    def __init__(self, target, drafters: Sequence[Drafter] = (), acceptance: str = "greedy",
                 budget: int | str = "auto", max_nodes: int = 64, cost_curve: CostCurve | None = None,
                 fp32_logits: bool = False, typical_eps: float = acc_mod.TYPICAL_EPS,
                 typical_delta: float = acc_mod.TYPICAL_DELTA, adapt: bool = True,
                 gate: bool = True, gate_explore: int = 8, cpu_pack: bool = True):
        if acceptance not in ACCEPTANCE:
            raise ConfigError(f"acceptance={acceptance!r} is unknown; use one of {ACCEPTANCE}.")
        if not (budget == "auto" or (isinstance(budget, int) and budget >= 0)):
            raise ConfigError(f"budget={budget!r}: use 'auto' or a number of tree nodes >= 0.")
        self.target = target
        self.model = target.model
        self.base = getattr(self.model, self.model.base_model_prefix)
        self.drafters = list(drafters)
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ConfigError(f"drafter names must be unique (they label stats): {names}")
        self.acceptance = acceptance
        self.budget = budget
        self.max_nodes = max_nodes
        self.cost_curve = cost_curve
        self.fp32_logits = fp32_logits
        self.typical = (typical_eps, typical_delta)
        self.adapt = adapt
        self.eos = set(target.eos_token_ids)
        self.stats = AcceptanceStats(max(len(self.drafters), 1))
        head = target.output_head
        head_dtype = torch.float32 if fp32_logits else head.weight.dtype
        self._head_b = None if head.bias is None else head.bias.detach().to(head_dtype)
        self._head_packed, self._packs = None, {}
        if cpu_pack and head.weight.device.type == "cpu":
            self._head_wt, self._head_packed = cpu.head_weights(head, head_dtype)  # [H, V]
            if target.dtype == torch.float32:
                self._packs = cpu.pack_linears(self.base)
        else:
            self._head_wt = head.weight.detach().to(head_dtype).T  # [H, V] view
        self._draft_overhead = 0.0
        # drafter gating (see `gate`): EMAs of each drafter's drafting seconds and of the accepted
        # tokens per step that no other drafter proposed; seconds one output token costs
        n = len(self.drafters)
        self.gate = gate and n > 1 and budget == "auto"
        self.gate_explore = max(int(gate_explore), 1)
        self._gate_secs = [0.0] * n
        self._gate_gain: list[float | None] = [None] * n
        self._gate_idle = [0] * n
        self._gate_wait = [self.gate_explore] * n  # steps a skipped drafter waits before a re-run
        self._sec_per_token: float | None = None

    # ------------------------------------------------------------------ inputs and outputs

    def encode(self, inputs) -> list[list[int]]:
        """Normalise inputs to a batch of token-id lists.

        Accepts a string (plain text), a chat (list of ``{"role", "content"}`` dicts; the
        tokenizer's template with the generation prompt), a list of token ids, or a list of any
        of these (a batch).
        """
        def one(x):
            if isinstance(x, str):
                return list(self.target.tokenizer(x, add_special_tokens=False)["input_ids"])
            if isinstance(x, (list, tuple)) and x and isinstance(x[0], dict):
                return self.target.chat_ids(list(x))
            if isinstance(x, torch.Tensor):
                return [int(t) for t in x.reshape(-1).tolist()]
            if isinstance(x, (list, tuple)) and all(isinstance(t, int) for t in x):
                return list(x)
            raise ConfigError(f"cannot read a prompt of type {type(x).__name__}: pass text, a chat "
                              f"(list of role/content dicts) or token ids.")

        single = isinstance(inputs, str) or isinstance(inputs, torch.Tensor) and inputs.dim() == 1 or (
            isinstance(inputs, (list, tuple)) and inputs and (isinstance(inputs[0], dict) or isinstance(inputs[0], int)))
        batch = [one(inputs)] if single else [one(x) for x in inputs]
        for i, ids in enumerate(batch):
            if not ids:
                raise ConfigError(f"prompt {i} is empty after tokenisation; give at least one token.")
        return batch

    # ------------------------------------------------------------------ target forwards

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.to(self._head_wt.dtype)
        if self._head_packed is not None and cpu.MIN_PACKED_ROWS <= h.numel() // h.shape[-1] <= cpu.MAX_PACKED_ROWS:
            return cpu.packed_linear(h, self._head_packed, self._head_b)
        out = h @ self._head_wt
        return out if self._head_b is None else out + self._head_b

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, cache) -> torch.Tensor:
        with cpu.use_packed(self._packs):
            out = self.base(input_ids=ids, attention_mask=bias, position_ids=positions,
                            past_key_values=cache, use_cache=True)
        return out.last_hidden_state  # [B, n, H] after the final norm

    def _new_cache(self, batch: int, capacity: int) -> TreeKVCache:
        return TreeKVCache(self.model.config, batch, capacity, self.target.dtype, self.target.device)

    @torch.no_grad()
    def measure_cost(self, context: int = 256, sizes=None) -> CostCurve:
        """Measure the verify-cost curve on this device (one row, a ``context``-token cache)."""
        from redraft.infer.budget import SIZES

        sizes = [s for s in (sizes or SIZES) if s <= max(self.max_nodes + 1, 1)] or [1]
        if sizes[-1] < self.max_nodes + 1:
            sizes.append(self.max_nodes + 1)
        dev = self.target.device
        cache = self._new_cache(1, context + max(sizes) + 1)
        ids = torch.zeros((1, context), dtype=torch.long, device=dev)
        anc = torch.tril(torch.ones((1, context, context), dtype=torch.bool, device=dev))
        self._forward(ids, torch.arange(context, device=dev)[None], cache.attention_bias(anc, self.target.dtype), cache)
        cache.set_prefill(torch.tensor([context], device=dev))

        def fwd(n):
            anc_n = torch.tril(torch.ones((1, n, n), dtype=torch.bool, device=dev))
            h = self._forward(torch.zeros((1, n), dtype=torch.long, device=dev),
                              context + torch.arange(n, device=dev)[None],
                              cache.attention_bias(anc_n, self.target.dtype), cache)
            self._logits(h)
            cache.physical = context  # drop what this forward appended
            if dev.type == "cuda":
                torch.cuda.synchronize()

        curve = measure_cost_curve(fwd, sizes)
        self.cost_curve = curve
        return curve

    # ------------------------------------------------------------------ drafting

    def _draft(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor, list]:
        """All drafters' paths in one ``[B, P, L]`` tensor, their values, and per-drafter slices.

        Draft distributions ``q`` are not used here: the merged tree stores a token proposed by
        several paths once, which breaks the independence that ``min(1, p/q)`` acceptance needs,
        while verifying every candidate as a point mass is lossless whatever proposed it.
        """
        B = state.batch_size
        drafts = []
        for i in self._active_drafters():
            t = time.perf_counter()
            drafts.append((i, self.drafters[i].propose(state)))
            secs = time.perf_counter() - t
            self._gate_secs[i] = 0.8 * self._gate_secs[i] + 0.2 * secs if self._gate_secs[i] else secs
        if not drafts:
            empty = torch.full((B, 0, 1), PAD, dtype=torch.long, device=state.device)
            return empty, torch.zeros((B, 0, 1), device=state.device), []
        L = max(dr.path_length for _, dr in drafts)
        toks, vals, slices, start = [], [], [], 0
        for i, dr in drafts:
            t = pad_paths(dr.tokens.to(state.device), L)
            toks.append(t)
            if self.budget == "auto" or dr.logp is None:
                v = self.stats.values(i, tuple(t.shape), dr.group).to(state.device)
            else:  # fixed budget: rank by the drafter's own path probability
                v = pad_paths(dr.logp.float().cumsum(-1).exp().to(state.device), L).clamp_min(0)
            vals.append(v)
            slices.append((i, start, start + t.shape[1], dr))
            start += t.shape[1]
        return torch.cat(toks, 1), torch.cat(vals, 1), slices

    def _active_drafters(self) -> list[int]:
        """Indices of the drafters to call this step (all of them unless gating is on)."""
        n = len(self.drafters)
        if not self.gate or self._sec_per_token is None:
            return list(range(n))
        # net seconds a drafter saves per step: its exclusive accepted tokens times the cost of
        # one output token, minus its own drafting time; unknown gains count as worth it
        net = [float("inf") if g is None else g * self._sec_per_token - self._gate_secs[i]
               for i, g in enumerate(self._gate_gain)]
        active = []
        for i in range(n):
            if net[i] >= 0:
                self._gate_wait[i] = self.gate_explore
                active.append(i)
            elif self._gate_idle[i] + 1 >= self._gate_wait[i]:  # re-run; back off if still not worth it
                self._gate_wait[i] = min(2 * self._gate_wait[i], 16 * self.gate_explore)
                active.append(i)
        if not active:
            active = [max(range(n), key=lambda i: net[i])]
        for i in range(n):
            self._gate_idle[i] = 0 if i in active else self._gate_idle[i] + 1
        return active

    def _update_gate(self, counts: dict, n_acc: torch.Tensor, step_secs: float) -> None:
        """``counts[i]`` [B] accepted draft tokens drafter i had proposed this step."""
        tokens = float(n_acc.float().mean()) + 1.0
        spt = step_secs / tokens
        self._sec_per_token = spt if self._sec_per_token is None else 0.8 * self._sec_per_token + 0.2 * spt
        if not self.gate:
            return
        for i, c in counts.items():
            # tokens on the accepted path only drafter i proposed: paths start at the root, so
            # every drafter's credited on-path nodes form a prefix and the others reach the max
            others = [counts[j] for j in counts if j != i]
            covered = torch.stack(others).max(dim=0).values if others else torch.zeros_like(c)
            gain = float((n_acc - covered).clamp_min(0).float().mean())
            g = self._gate_gain[i]
            self._gate_gain[i] = gain if g is None else 0.7 * g + 0.3 * gain

    def _choose_budget(self, paths: torch.Tensor, values: torch.Tensor) -> torch.Tensor | int:
        if self.budget != "auto":
            return self.budget
        if self.cost_curve is None:
            self.measure_cost()
        B = paths.shape[0]
        v = torch.where(paths >= 0, values, torch.zeros_like(values)).reshape(B, -1)
        return best_budget(v, self.cost_curve, self.max_nodes, self._draft_overhead)

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def stream(self, inputs, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               stop: Sequence[str] | None = None, seed: int | None = None) -> Iterator[StreamEvent]:
        """Decode and yield :class:`StreamEvent` s as tokens are accepted (text deltas per request).

        Args:
            inputs: see :meth:`encode` (one prompt or a batch).
            max_new_tokens: new tokens per request at most.
            temperature: 0 for greedy; > 0 samples (use acceptance "rejection" to stay lossless).
            top_p: nucleus sampling threshold (with temperature > 0).
            stop: strings that end a request (the text is cut before them).
            seed: seeds the sampling generator.
        """
        if temperature > 0 and self.acceptance == "greedy":
            raise ConfigError("temperature > 0 needs acceptance='rejection' (lossless) or 'typical'.")
        prompts = self.encode(inputs)
        yield from self._run(prompts, max_new_tokens, temperature, top_p, list(stop or []), seed)

    def generate(self, inputs, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 stop: Sequence[str] | None = None, stream: bool = False, seed: int | None = None):
        """Decode a prompt or a batch; returns a list of :class:`Generation` (one per prompt),
        or, with ``stream=True``, the iterator of :meth:`stream`."""
        it = self.stream(inputs, max_new_tokens, temperature, top_p, stop, seed)
        if stream:
            return it
        results = {}
        for ev in it:
            if ev.done:
                results[ev.index] = ev.generation
        return [results[i] for i in sorted(results)]

    def _sample(self, logits: torch.Tensor, temperature: float, top_p: float, gen) -> torch.Tensor:
        if temperature <= 0:
            return acc_mod.greedy_tokens(logits)
        return torch.multinomial(acc_mod.warp_probs(logits, temperature, top_p), 1, generator=gen)[:, 0]

    def _run(self, prompts, max_new, temperature, top_p, stop, seed) -> Iterator[StreamEvent]:
        dev, dtype = self.target.device, self.target.dtype
        tok = self.target.tokenizer
        gen = None
        if seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
        B = len(prompts)
        plen = torch.tensor([len(p) for p in prompts], device=dev)
        Pmax = int(plen.max())
        slack = self.max_nodes + 2 if self.drafters else 2
        cache = self._new_cache(B, Pmax + max_new + slack + 1)
        stats = [RequestStats() for _ in range(B)]
        out_tokens: list[list[int]] = [[] for _ in range(B)]
        sent_text = ["" for _ in range(B)]
        req = torch.arange(B, device=dev)

        # prefill: right-padded prompts, each row sees its own tokens only
        t0 = time.perf_counter()
        ids = torch.zeros((B, Pmax), dtype=torch.long, device=dev)
        buf = torch.full((B, Pmax + max_new + slack + 1), PAD, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p, device=dev)
        buf[:, :Pmax] = torch.where(torch.arange(Pmax, device=dev)[None] < plen[:, None], ids, PAD)
        causal = torch.tril(torch.ones((Pmax, Pmax), dtype=torch.bool, device=dev))[None].expand(B, -1, -1)
        cache.lengths = torch.zeros(B, dtype=torch.long, device=dev)
        bias = cache.attention_bias(causal & (torch.arange(Pmax, device=dev)[None, None] < plen[:, None, None]), dtype)
        hid = self._forward(ids, torch.arange(Pmax, device=dev)[None].expand(B, -1), bias, cache)
        cache.set_prefill(plen)
        h_last = hid[torch.arange(B, device=dev), plen - 1]  # [B, H]
        y = self._sample(self._logits(h_last), temperature, top_p, gen)
        buf[torch.arange(B, device=dev), plen] = y
        lengths = plen + 1
        prefill = time.perf_counter() - t0
        for s in stats:
            s.prefill_time = prefill
        state = DecodeState(tokens=buf, lengths=lengths, last=y, hidden=h_last, prompt_lengths=plen.clone(),
                            step=0, request_ids=req, temperature=temperature)
        for d in self.drafters:
            d.begin(state)
        # acceptance rates carry over between requests (decayed): what a drafter achieves on one
        # prompt is the best prior for the next; call decoder.stats.reset() to forget them
        if self.drafters and self.budget == "auto" and self.cost_curve is None:
            self.measure_cost()
        pending = [[int(t)] for t in y.tolist()]  # tokens to emit per current row

        while True:
            # ---- emit what the last step produced, find finished rows
            keep_rows, events = [], []
            for r in range(state.batch_size):
                i = int(state.request_ids[r])
                new, reason = [], None
                for t in pending[r]:
                    if len(out_tokens[i]) >= max_new:
                        reason = "length"
                        break
                    out_tokens[i].append(t)
                    new.append(t)
                    if t in self.eos:
                        reason = "eos"
                        break
                if reason is None and len(out_tokens[i]) >= max_new:
                    reason = "length"
                stats[i].new_tokens = len(out_tokens[i])
                text = tok.decode(out_tokens[i], skip_special_tokens=True)
                if stop:
                    cut = min((text.find(s) for s in stop if s in text), default=-1)
                    if cut >= 0:
                        text, reason = text[:cut], "stop"
                # hold back a trailing partial UTF-8 character until it completes
                safe = text if reason else text.rstrip("\ufffd")
                delta = safe[len(sent_text[i]):] if safe.startswith(sent_text[i]) else safe
                sent_text[i] = safe if safe.startswith(sent_text[i]) else sent_text[i] + delta
                if reason:
                    stats[i].total_time = time.perf_counter() - t0
                    g = Generation(text=text, tokens=out_tokens[i], finish_reason=reason, stats=stats[i])
                    events.append(StreamEvent(i, delta, new, True, g))
                else:
                    keep_rows.append(r)
                    if new:
                        events.append(StreamEvent(i, delta, new))
            yield from events
            if not keep_rows:
                return
            if len(keep_rows) < state.batch_size:
                keep = torch.tensor(keep_rows, device=dev)
                cache.select_rows(keep)
                state = DecodeState(tokens=state.tokens[keep], lengths=state.lengths[keep], last=state.last[keep],
                                    hidden=state.hidden[keep], prompt_lengths=state.prompt_lengths[keep],
                                    step=state.step, request_ids=state.request_ids[keep], temperature=temperature)
                for d in self.drafters:
                    d.select_rows(keep)
            B = state.batch_size
            rows = torch.arange(B, device=dev)

            # ---- draft
            td = time.perf_counter()
            paths, values, slices = self._draft(state)
            n_raw = (paths >= 0).sum(dim=(1, 2))
            if paths.shape[1]:
                budget = self._choose_budget(paths, values)
                pruned = prune_paths(paths, values, budget)
            else:
                pruned = paths
            tree = build_tree(pruned)
            tree.tokens[:, 0] = state.last
            t_draft = time.perf_counter() - td

            # ---- verify
            tv = time.perf_counter()
            positions = (cache.lengths[:, None] + tree.depth)
            bias = cache.attention_bias(tree.anc, dtype)
            hid = self._forward(tree.tokens.clamp_min(0), positions, bias, cache)
            logits = self._logits(hid)  # [B, N, V]
            if self.acceptance == "greedy" or (self.acceptance == "rejection" and temperature <= 0):
                acc = acc_mod.accept_greedy(tree, logits)
            elif self.acceptance == "typical":
                acc = acc_mod.accept_typical(tree, logits, temperature, *self.typical, generator=gen)
            else:
                acc = acc_mod.accept_rejection(tree, logits, temperature, top_p, generator=gen)
            cache.commit(acc.path, acc.num_accepted + 1)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_verify = time.perf_counter() - tv

            # ---- bookkeeping: new tokens, feedback to drafters, stats
            acc_toks = acc_mod.accepted_tokens(tree, acc)  # [B, D]
            on_path = tree.anc[rows, acc.last_node]  # [B, N] nodes on the accepted path
            feedback_all = []
            for (i, a, b_, dr) in slices:
                pn = tree.path_node[:, a:b_]  # [B, p, L]
                hit = (pn >= 0) & on_path.gather(1, pn.clamp_min(0).reshape(B, -1)).reshape(pn.shape)
                prefix = hit.long().cumprod(dim=-1).sum(dim=-1)  # [B, p]
                fb = Feedback(accepted_prefix=prefix, accepted=acc_toks, num_accepted=acc.num_accepted, bonus=acc.bonus,
                              verified=(pn >= 0).sum(dim=-1))
                feedback_all.append((i, dr, fb, pn, hit))
                if self.adapt:
                    self.stats.update(i, pruned[:, a:b_], prefix, dr.group)
            # drafter credit: a drafter gets an accepted token when one of its paths holds it
            per_drafter = {}
            for (i, dr, fb, pn, hit) in feedback_all:
                credited = torch.zeros_like(on_path)
                credited.scatter_(1, pn.clamp_min(0).reshape(B, -1), hit.reshape(B, -1))
                credited[:, 0] = False
                per_drafter[i] = (credited & on_path).sum(dim=1)  # [B]
                counts = per_drafter[i].tolist()
                for r in range(B):
                    stats[int(state.request_ids[r])].drafter_accepted[self.drafters[i].name] += counts[r]
            self._update_gate(per_drafter, acc.num_accepted, t_draft + t_verify)
            old_state = state
            n_acc = acc.num_accepted
            new_len = state.lengths + n_acc + 1
            new_toks = acc_mod.emitted_tokens(tree, acc)  # [B, D+1]
            buf = state.tokens
            need = int(new_len.max()) + 1
            if need > buf.shape[1]:
                buf = torch.cat([buf, buf.new_full((B, need - buf.shape[1] + 64), PAD)], dim=1)
            ar = torch.arange(new_toks.shape[1], device=dev)[None]
            pos = (state.lengths[:, None] + ar).clamp(max=buf.shape[1] - 1)
            buf = buf.scatter(1, pos, torch.where(new_toks >= 0, new_toks, buf.gather(1, pos)))
            h_next = hid[rows, acc.last_node]
            state = DecodeState(tokens=buf, lengths=new_len, last=acc.bonus, hidden=h_next,
                                prompt_lengths=state.prompt_lengths, step=state.step + 1,
                                request_ids=state.request_ids, temperature=temperature)
            for (i, dr, fb, pn, hit) in feedback_all:
                self.drafters[i].observe(old_state, dr, fb)
            n_list, raw_list = n_acc.tolist(), n_raw.tolist()
            ent_list, node_list = (pruned >= 0).sum(dim=(1, 2)).tolist(), (tree.num_nodes - 1).tolist()
            pending = [[t for t in row if t >= 0] for row in new_toks.tolist()]
            self._draft_overhead = 0.8 * self._draft_overhead + 0.2 * t_draft
            for r in range(B):
                s = stats[int(state.request_ids[r])]
                s.target_calls += 1
                s.accepted_hist[n_list[r]] += 1
                s.draft_time += t_draft
                s.verify_time += t_verify
                s.tree_entries_raw += raw_list[r]
                s.tree_entries += ent_list[r]
                s.tree_nodes += node_list[r]


@torch.no_grad()
def plain_greedy(target, inputs, max_new_tokens: int = 128, **kw) -> list[Generation]:
    """Plain autoregressive greedy decoding with the same model and cache (the baseline)."""
    return SpeculativeDecoder(target, [], budget=0).generate(inputs, max_new_tokens=max_new_tokens, **kw)

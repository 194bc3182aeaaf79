"""Distillation replies from redraft's own engine: continuous batching, the target's dtype.

:class:`EngineReplies` is a ``redraft.data.replies.ReplyGenerator`` (``submit`` prompts,
``poll`` finished replies) over an :class:`~redraft.infer.engine.engine.Engine` that speculates with
the context n-gram drafter where it pays (``ReplySettings.speculate``; else plain
autoregressive decoding) with redraft's slot KV cache (and, on CUDA, its captured verify
graphs). Unlike one ``model.generate`` per batch, a reply that ends frees its row at once and
the distiller's next prompt joins at the next step, so the batch stays full. Greedy replies are
the same tokens as Hugging Face ``generate`` gives in float32 (``tests/infer/test_replies.py``;
bfloat16 rounding flips near-ties with the batch shape); sampled ones follow the same
distribution, each request seeded from the run's seed and its key.

``redraft.entry`` injects it into ``redraft-distill-data``, ``redraft-train`` and
``redraft-cache-features`` (``data`` and ``train`` may not import ``infer``);
``python -m redraft.bench.replies`` measures it against ``generate``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from redraft.infer.config import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, row_seed
from redraft.infer.drafters.ngram import ContextNGramDrafter

if TYPE_CHECKING:  # the protocol's types; infer does not import data at run time
    from redraft.data.replies import ReplySettings


class EngineReplies:
    """A ``ReplyGenerator`` over one engine (made once, its cache reused by every request); the
    class is the factory ``redraft.data.replies.use_replies`` takes.

    Args:
        target: a :class:`redraft.models.Target` (its dtype and device are the engine's).
        settings: a ``redraft.data.replies.ReplySettings``.
    """

    name = "engine"

    def __init__(self, target, settings: ReplySettings):
        self.settings = settings
        sample = settings.temperature > 0
        # speculate: the context n-gram drafter (prompt lookup: replies repeat their prompts and
        # themselves; no artifact needed) with the cost-aware budget and the speculation guard,
        # which runs plain steps at the batch sizes where drafting does not pay (on a small
        # CPU in float32: 1.03-1.19x at batch 16, 0.98x at batch 64). Greedy replies are the
        # same tokens; sampling uses the lossless rule (with no draft, plain sampling). Without
        # it every step verifies the root alone (budget 0). Prefill is not chunked
        # (prefill_chunk 0): chunks keep a server's running rows responsive, but here only
        # throughput counts, and a prompt in one forward reads the weights once (measured in
        # docs/train.md, "Who generates, and how fast")
        speculate = settings.speculate
        self.decoder = SpeculativeDecoder(
            target,
            [ContextNGramDrafter(target.vocab_size)] if speculate else [],
            budget="auto" if speculate else 0,
            acceptance="rejection" if sample else "greedy",
            prefill_chunk=0,
        )
        self.engine = self.decoder.engine(text=False)  # replies are token ids: no detokenising
        self.params = SamplingParams.checked(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            stop_token_ids=list(settings.stop_ids),
        )
        self.keys: dict[int, int] = {}  # engine request id -> the caller's key
        # replies to wait for before poll returns (their next prompts then join in one prefill
        # forward); None: chosen from measured costs (:meth:`group`)
        self.join_group: int | None = None
        self._c0: float | None = None  # an eager one-token prefill forward (seconds)
        self._finished = 0
        self._new_tokens = 0  # tokens of the finished replies (stop ids included)
        self._group = 1  # what the last poll waited for

    def stats(self) -> dict:
        """Where the time went so far: steps, the mean batch, prefill forwards and their
        seconds, decode seconds, the last poll's join group, the verifier's graph counts
        (``redraft-distill-data`` prints them: on a GPU they say whether a step ran as a graph
        replay or eagerly)."""
        eng, tot = self.engine, self.engine.totals
        g = self.decoder.verifier.graph_stats
        return {
            "steps": eng.steps,
            "row_steps": tot["row_steps"],
            "mean_batch": round(tot["row_steps"] / max(eng.steps, 1), 1),
            "prefills": tot["prefills"],
            "fused_prefills": tot["fused"],  # pieces in a verify forward (timed as decode)
            "prefill_s": round(tot["prefill_s"], 4),
            "decode_s": round(tot["step_s"] - tot["prefill_s"], 4),
            "ms_per_decode_step": round(
                1e3 * (tot["step_s"] - tot["prefill_s"]) / max(eng.steps, 1), 2
            ),
            "new_tokens": self._new_tokens,
            # decode tokens per row and step (a reply's first token comes from its prefill):
            # 1.0 on plain steps, more where drafts were accepted
            "tokens_per_row_step": round(
                (self._new_tokens - self._finished) / max(tot["row_steps"], 1), 3
            ),
            "join_group": self._group,
            "graphs": {k: round(v, 2) if isinstance(v, float) else v for k, v in g.items()},
        }

    def submit(self, key: int, prompt: list[int]) -> None:
        params = self.params
        if self.settings.temperature > 0:  # its own seed: the reply does not depend on the batch
            params = dataclasses.replace(params, seed=row_seed(self.settings.seed, key))
        self.keys[self.engine.add(list(prompt), params)] = key

    def group(self, flying: int) -> int:
        """How many replies :meth:`poll` waits for while ``flying`` are in flight. Each prefill
        forward pays a fixed cost ``c0`` (on a GPU an eager forward of the default target costs
        ~10x a graph-replayed step); prompts that join one at a time pay it per
        reply. Waiting for ``k`` replies leaves on average ``k / 2`` rows idle for ``k / rate``
        steps (``rate``: replies per step), so per reply the cost is ``k / (2 rate)`` row-steps
        idle plus ``flying c0 / (k step)`` row-steps of prefill stall; the least is at
        ``k = sqrt(2 rate flying c0 / step)`` (``step``: a decode step's seconds), at most a
        quarter of the batch. 1 until 16 steps and 4 replies are measured; on a CPU, where a
        step costs more than ``c0``, it stays near 1, and where pieces ride in the verify
        forward (``Engine.fuse``) a join pays no ``c0``: 1."""
        eng = self.engine
        if self.join_group is not None:
            return max(1, min(self.join_group, flying))
        if eng.fuse:
            return 1
        if eng.steps < 16 or self._finished < 4 or flying < 8:
            return 1
        if self._c0 is None:
            self._c0 = self.decoder.verifier.prefill_fixed_cost()
        tot = eng.totals
        step = (tot["step_s"] - tot["prefill_s"]) / eng.steps
        rate = self._finished / eng.steps
        k = math.sqrt(2 * rate * flying * self._c0 / max(step, 1e-6))
        return int(max(1, min(round(k), flying // 4)))

    def poll(self) -> list[tuple[int, list[int], bool]]:
        """Engine steps until :meth:`group` replies (at least one) have ended, or none is left in
        flight; ``(key, tokens, stopped)`` per reply (a ``Reply``), ``tokens`` without the stop
        id that ended it."""
        done = []
        want = self._group = self.group(len(self.keys))
        while self.engine.has_work and len(done) < want:
            for ev in self.engine.step():
                if not ev.done:
                    continue
                g = ev.generation
                self._new_tokens += len(g.tokens)
                stopped = g.finish_reason in ("eos", "stop")  # "length": ran into max_new_tokens
                toks = list(g.tokens[:-1] if stopped else g.tokens)
                done.append((self.keys.pop(ev.index), toks, stopped))
        self._finished += len(done)
        return done

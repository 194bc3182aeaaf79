"""The speculative decoder: draft -> tree -> verify -> accept -> commit, for a batch of requests.

    decoder = SpeculativeDecoder(target, [NGrammysDrafter(tables, V), ReDrafterDrafter(head)])
    out = decoder.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=128)
    out[0].text, out[0].stats.tokens_per_call

The facade over the three rooms of :mod:`redraft.infer`: it builds the target's
:class:`~redraft.infer.runner.verify.Verifier` (runner), the
:class:`~redraft.infer.spec.speculator.Speculator` over the drafters (spec), and hands both to
an :class:`~redraft.infer.engine.engine.Engine` (continuous batching) whenever one is asked for.
What a step does is the speculator's module doc; how steps, rows and prefill interleave is the
engine's.

With no drafters the same loop is plain autoregressive decoding (the tree is the root alone),
which is the baseline every speculative result is compared with.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.infer.config import DecoderConfig, SamplingParams
from redraft.infer.engine.engine import Engine
from redraft.infer.engine.prefix import PrefixCache
from redraft.infer.runner.cost import BatchCost, CostCurve
from redraft.infer.runner.verify import Verifier
from redraft.infer.spec import hostjit
from redraft.infer.spec.accept import (
    walk,
)
from redraft.infer.spec.drafter import Drafter
from redraft.infer.spec.hostdraft import HostTables, context_matches_np, ngrammys_np
from redraft.infer.spec.hoststats import HostStats, best_budget_np
from redraft.infer.spec.hosttree import build_tree_np, step_feedback_np
from redraft.infer.spec.speculator import Speculator
from redraft.infer.stats import Generation, StreamEvent


class SpeculativeDecoder:
    """Lossless tree speculative decoding with any mix of drafters.

    Args:
        target: a :class:`redraft.models.Target`.
        drafters: drafters whose paths are merged into one tree each step (empty: plain
            autoregressive decoding).
        config: a :class:`~redraft.infer.config.DecoderConfig` (default: its defaults).
        cost_curve: a :class:`~redraft.infer.runner.cost.CostCurve` to use instead of measuring one
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
        # thread of a CPU process warns (engine())
        self.home_thread = threading.get_ident()
        self._thread_warned = False
        cfg = self.config
        static = cfg.static_verify if cfg.static_verify != "auto" else target.device.type == "cuda"
        self.verifier = Verifier(
            target,
            fp32_logits=cfg.fp32_logits,
            cpu_pack=cfg.cpu_pack,
            lean_walk=cfg.lean_walk,
            compiled_attention=cfg.compiled_attention,
            static=static,
            span_buckets=static if cfg.span_buckets == "auto" else cfg.span_buckets,
        )
        drafters = list(drafters)
        self.verifier.hidden_layers = lower_hidden_layers(drafters)
        self.speculator = Speculator(drafters, cfg, self.verifier, cost_curve)
        self.eos = set(target.eos_token_ids)
        if drafters:
            warm_host_kernels()  # compiled now, not inside a timed or served step
        self.generator: torch.Generator | None = None  # the shared sampling generator (torch's)
        self._engine: Engine | None = None  # the engine generate() reuses while idle
        # earlier requests' KV entries by their tokens, shared by every engine of this decoder
        self.prefix_cache = PrefixCache(cfg.prefix_cache) if cfg.prefix_cache else None

    # ------------------------------------------------------------------ the speculator's parts

    @property
    def drafters(self) -> list[Drafter]:
        return self.speculator.drafters

    @property
    def stats(self):
        """The drafters' acceptance rates (``redraft.infer.spec.hoststats.HostStats``)."""
        return self.speculator.stats

    @property
    def gate(self):
        return self.speculator.gate

    @property
    def guard(self):
        return self.speculator.guard

    @property
    def cost_curve(self) -> CostCurve | None:
        """The verify-cost curve (measured at the first "auto" step, or given)."""
        return self.speculator.cost_curve

    @cost_curve.setter
    def cost_curve(self, curve: CostCurve | None) -> None:
        self.speculator.cost_curve = curve

    @property
    def batch_cost(self) -> BatchCost | None:
        """Measured batched verify costs (:meth:`measure_batch_cost`, or given)."""
        return self.speculator.batch_cost

    @batch_cost.setter
    def batch_cost(self, cost: BatchCost | None) -> None:
        self.speculator.batch_cost = cost

    def forget(self) -> None:
        """Forget the requests decoded so far: the prefix cache's entries and what the drafters
        keep of earlier outputs (:meth:`Drafter.forget`), so the next requests run as on a
        freshly loaded decoder (learned acceptance rates and measured costs stay).
        ``redraft-bench`` calls it before every pass at a concurrency, as vLLM's engine starts
        each pass empty: the prompts of the pass before would otherwise come from the cache."""
        if self._engine is not None:
            if self._engine.has_work:
                raise RuntimeError("forget() while requests are decoding: call it between them.")
            # finished rows leave the batch lazily, at the next step, and store their entries and
            # outputs as they leave: drop them now, or they fill what is emptied below
            self._engine._retire()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        for d in self.drafters:
            d.forget()

    def measure_cost(self, context: int = 256, sizes=None) -> CostCurve:
        """Measure the verify-cost curve on this device (one row, a ``context``-token cache)."""
        return self.speculator.measure_cost(context, sizes)

    def measure_batch_cost(self, max_batch: int, context: int = 256) -> BatchCost:
        """Measure batched verify forwards (see ``Speculator.measure_batch_cost``; a server
        calls this at warm-up)."""
        return self.speculator.measure_batch_cost(max_batch, context)

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
        """A step-level :class:`~redraft.infer.engine.engine.Engine` (continuous batching) over this
        decoder: ``add`` requests, ``step`` until ``has_work`` is false, ``cancel`` any time.
        ``text=False``: events and generations carry token ids only (their text is empty; no
        stop strings), which saves the per-step detokenisation of every row."""
        if self.target.device.type == "cpu":
            self._check_thread()
        return Engine(
            self.target,
            self.speculator,
            self.verifier,
            self.config,
            eos=self.eos,
            generator=self.generator,
            text=text,
            prefix=self.prefix_cache,
        )

    def _check_thread(self) -> None:
        """Warn (once per decoder) when a CPU engine is made on another thread than the one that
        built the decoder. PyTorch's CPU kernels run in a GNU OpenMP team that belongs to the thread
        that opened it; a second thread's team leaves more OpenMP threads than cores, and libgomp's
        idle workers then stop spinning between kernels, so every kernel pays a wake-up: on a
        small CPU a step of the default target took 1.2-1.5x as long on the other thread
        (``redraft.serve.scheduler.ComputeThread``, which ``redraft-serve`` loads and decodes on)."""
        if self.home_thread == threading.get_ident() or torch.get_num_threads() < 2:
            return
        if self._thread_warned:  # once per decoder
            return
        self._thread_warned = True
        warnings.warn(
            "redraft: this engine decodes on another thread than the one that loaded the decoder; "
            "on a CPU each step can take 1.2-1.5x as long (PyTorch's OpenMP threads belong to the "
            "thread that started them). Load and decode on one thread, e.g. "
            "redraft.serve.scheduler.ComputeThread: decoder = compute.call(load_decoder, ...), then "
            "run the decoding there.",
            RuntimeWarning,
            stacklevel=3,
        )

    @torch.no_grad()
    def stream(
        self,
        inputs,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        whole_prompts: bool = False,
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
            whole_prompts: prefill every prompt before the first decoding step (the most tokens
                per second for the batch), instead of the first tokens of the short prompts
                first, the long prompts' pieces riding in the decoding steps (``prefill_chunk``
                "auto"). :meth:`generate` without ``stream`` does: it returns when all are done.
        """
        params = SamplingParams.checked(max_new_tokens, temperature, top_p, stop, seed)
        prompts = self.encode(inputs)
        engine = (
            self._engine
            if self._engine is not None and not self._engine.has_work
            else self.engine()
        )
        engine.eos, engine.generator = self.eos, self.generator  # (either may have been set since)
        engine.whole_prompts = whole_prompts
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
        it = self.stream(
            inputs, max_new_tokens, temperature, top_p, stop, seed, whole_prompts=not stream
        )
        if stream:
            return it
        results = {ev.index: ev.generation for ev in it if ev.done}
        return [results[i] for i in sorted(results)]


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
        from redraft.infer.drafters.redrafter.beamcost import BeamCost, plan_beam

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


def lower_hidden_layers(drafters) -> tuple[int, ...]:
    """The layers below the last whose hidden states the verify forward must also return, for
    the drafters that read several (multi-layer ReDrafter heads: ``hidden_layers``, the last
    layer last); ``()`` when none does (the forward is then unchanged). Drafters that read
    different layer sets cannot share one decoder (``DecodeState.hidden`` has one layout)."""
    sets = {tuple(d.hidden_layers) for d in drafters} - {()}
    if len(sets) > 1:
        raise ConfigError(
            f"drafters read the target's hidden states of different layer sets ({sorted(sets)}); "
            f"use heads trained with the same feature_layers in one decoder."
        )
    return sets.pop()[:-1] if sets else ()


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

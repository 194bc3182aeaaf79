"""redraft's host drafters as a vLLM speculative proposer (``method: custom_class``).

Each step vLLM hands the proposer, per running request (a *row* of its input batch), the tokens
it sampled this step, the row's token count and a view of every row's tokens; it takes back one
draft chain of at most ``k`` tokens per row, which its rejection sampler verifies (greedy:
the output is the target's own). The proposer:

1. **learns** from the last step: the tokens sampled since are the truth that every candidate of
   the last step is scored against (not only the chain that was sent: each candidate's leading
   tokens that equal the sampled ones were right, and positions past what was sampled are not
   counted), into the per-(drafter, group, depth) acceptance rates of
   :class:`redraft.infer.spec.hostdraft.HostStats`;
2. **drafts** candidates with redraft's host kernels: ``context`` (suffix matches of length
   ``q_max .. q_min`` in the request's own tokens, grouped by match length and rank), ``ngrammys``
   (the model's extended bigram chains from the tables) and ``trigram`` (greedy chains through
   ADED's corpus tri-gram table, from the row's last two tokens) and ``suffix`` (SuffixDecoding's
   suffix trees over the request and over the outputs of earlier requests, arctic-inference);
3. **picks** per row the candidate with the most expected accepted tokens (the sum over its
   depths of the product of learned rates), cuts it where that product falls below
   ``min_value`` (+ ``min_value_per_row`` per extra row), and sends, across all rows, the draft
   tokens that maximise the expected tokens per second of the step under vLLM's step cost as
   measured between calls (:mod:`redraft.vllm.pacing`): at batch 1 on a GPU nearly every
   candidate token, on a CPU or at a large batch only the likely ones. With nothing worth
   verifying a row gets an empty chain, and a step where no row has a candidate costs vLLM
   nothing.

vLLM passes rows, not request ids, and moves requests between rows as others finish. A row's
last chain is scored only when its token count grew by exactly the number of tokens sampled for
it and its last token before the step is unchanged; anything else (a new request in that row)
skips the update. That keeps the statistics correct without request ids; per-request adaptive
state (ADED's tri-gram boosts, HSDDW's thresholds) is not kept here, for the same reason. The
suffix drafter tells requests apart the same way: a row whose tokens do not continue what it
held last step is a new request (its tokens so far start a new local tree; the row's earlier
request stops, its output staying in the global tree).

The candidates and the learned rates are deterministic numpy on the inputs every rank receives,
the same on every tensor-parallel rank; how much of a chain is sent follows each rank's own
timing, and vLLM verifies the drafts of one rank on all of them (:mod:`redraft.vllm.pacing`).
With ``cost: off`` the chains themselves are deterministic too.
"""

from __future__ import annotations

import time

import numpy as np

try:  # numba is a dependency; the plain Python loop is the fallback
    from numba import njit as _njit
except ImportError:  # pragma: no cover

    def _njit(f):
        return f


from redraft.errors import ArtifactError, ConfigError
from redraft.infer.drafters.suffix import suffix_available
from redraft.infer.spec.hostdraft import HostStats, HostTables, context_matches_np
from redraft.infer.spec.paths import PAD
from redraft.vllm.pacing import StepCost, chain_lengths
from redraft.vllm.settings import DRAFTERS, ENV_VAR, ProposerSettings, read_settings

TRIGRAM_BRANCHES = 4  # first tokens of the tri-gram chains (each then followed greedily)
# the context drafter's extra candidate, the earliest place of the longest match: a group of its
# own, so the learned rates judge it apart from the (count, recency)-ranked matches
EARLIEST_GROUP = 31


class Proposer:
    """vLLM's ``custom_class`` proposer backed by redraft's artifacts; see the module doc.

    Built by vLLM in every worker as ``Proposer(vllm_config)``; settings from
    :data:`redraft.vllm.settings.ENV_VAR`. A missing artifact, tables built for another tokenizer
    or a bad setting raise here, while vLLM starts, never inside a step.
    """

    def __init__(self, vllm_config, settings: ProposerSettings | None = None):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.settings = settings if settings is not None else read_settings()
        s = self.settings
        tokenizer = _tokenizer(vllm_config.model_config)
        self.vocab_size = int(
            getattr(vllm_config.model_config.hf_config, "vocab_size", 0) or len(tokenizer)
        )
        tables = _load_tables(s.ngrams, tokenizer, self.vocab_size) if s.ngrams else None
        have = {"context"} | ({"suffix"} if suffix_available() else set())
        if tables is not None and "extended" in tables.kinds:
            have.add("ngrammys")
        if tables is not None and "trigram" in tables.kinds:
            have.add("trigram")
        if s.drafters is None:
            self.drafters = [d for d in DRAFTERS if d in have]
        else:
            missing = [d for d in s.drafters if d not in have]
            if "suffix" in missing:
                raise ConfigError(
                    f"{ENV_VAR}: the suffix drafter needs the package arctic-inference "
                    f"(pip install arctic-inference)."
                )
            if missing:
                kinds = " and ".join("extended" if d == "ngrammys" else d for d in missing)
                where = (
                    "no ngrams are set"
                    if tables is None
                    else f"{s.ngrams} holds {', '.join(tables.kinds)}"
                )
                raise ConfigError(
                    f"{ENV_VAR}: drafters {', '.join(missing)} need n-gram tables with the "
                    f"{kinds} kind, but {where}; set ngrams to tables built with "
                    f"redraft-build-ngrams --kinds {kinds.replace(' and ', ',')}."
                )
            self.drafters = list(s.drafters)
        self.host_tables = HostTables(tables) if "ngrammys" in self.drafters else None
        self.trigram = tables.trigram if "trigram" in self.drafters else None
        self.stats = HostStats(len(self.drafters), max_depth=max(self.k, 1))
        self.suffix = SuffixRows(s.suffix_tokens, self.k) if "suffix" in self.drafters else None
        self._last = None  # what the last step proposed, to be scored by this one
        self.clock = time.perf_counter
        self.cost = StepCost() if s.cost == "measured" else None
        self._sent = (0.0, 0)  # (when the last call started, tokens its step verifies)
        self.steps = self.proposed_tokens = 0
        self._warm()

    def load_model(self, model) -> None:
        """vLLM hands over the target; the host drafters draft from token ids alone."""

    # ------------------------------------------------------------------ the step

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        """One chain (a list of at most ``k`` token ids, maybe empty) per row of the batch."""
        start = self.clock()
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = np.array(
            [
                i
                for i, s in enumerate(sampled_token_ids)
                if len(s) and 0 < num_tokens_no_spec[i] < self.max_model_len
            ],
            dtype=np.int64,
        )
        if self._last is not None:
            same_rows = self._learn(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
            if same_rows and self.cost is not None:
                self.cost.record(self._sent[1], start - self._sent[0])
            self._last = None
        if not len(rows) or self.k < 1:
            return out
        n = np.asarray(num_tokens_no_spec, dtype=np.int64)[rows]
        paths, owner, group = self._candidates(rows, n, token_ids_cpu)
        lengths = np.zeros(len(rows), dtype=np.int64)
        if paths.shape[1]:
            values = self.stats.values(owner, paths.shape, group)  # [B, P, k]
            values = np.where(paths >= 0, values, 0.0)
            best = values.sum(-1).argmax(-1)  # [B]
            b = np.arange(len(rows))
            chosen, v = paths[b, best], values[b, best]  # [B, k]
            floor = self.settings.min_value + self.settings.min_value_per_row * (len(rows) - 1)
            keep = np.cumprod((chosen >= 0) & (v >= floor) & (v > 0), axis=1).astype(bool)
            v = np.where(keep, v, 0.0)
            lengths = keep.sum(1) if self.cost is None else chain_lengths(v, self.cost)
            # never past the model's length: the chain's tokens and the bonus token must fit
            lengths = np.minimum(lengths, np.maximum(self.max_model_len - n - 1, 0))
            for j, i in enumerate(rows):
                if lengths[j]:
                    out[i] = chosen[j, : lengths[j]].tolist()
        self.steps += 1
        self.proposed_tokens += int(lengths.sum())
        self._last = (rows, n, token_ids_cpu[rows, n - 1].copy(), paths, owner, group)
        self._sent = (start, len(rows) + int(lengths.sum()))
        return out

    def _candidates(self, rows, n, tok):
        """``(paths int64 [B, P, k], owner int64 [P], group int64 [B, P])`` of every drafter."""
        s, k = self.settings, self.k
        seqs = [tok[i, : n[j]] for j, i in enumerate(rows)]
        last = tok[rows, n - 1].astype(np.int64)
        parts = []
        for d, name in enumerate(self.drafters):
            if name == "context":
                p, g = context_matches_np(
                    seqs, s.q_min, s.q_max, s.paths, k, self.vocab_size, s.window
                )
                e = earliest_longest_match(seqs, s.q_min, s.q_max, k, s.window)  # [B, k]
                p = np.concatenate([p, e[:, None]], axis=1)
                g = np.concatenate([g, np.full((len(seqs), 1), EARLIEST_GROUP, g.dtype)], axis=1)
            elif name == "ngrammys":
                p = _fit(self.host_tables.extended(last)[:, : s.paths], k)
                g = np.broadcast_to(np.arange(p.shape[1]), p.shape[:2])
            elif name == "suffix":
                p, g = self.suffix.candidates(rows, n, tok, s.paths, k)
            else:
                before = np.where(n >= 2, tok[rows, np.maximum(n - 2, 0)], -1).astype(np.int64)
                p = trigram_chains(self.trigram, before, last, k, min(s.paths, TRIGRAM_BRANCHES))
                g = np.broadcast_to(np.arange(p.shape[1]), p.shape[:2])
            parts.append((p, np.full(p.shape[1], d, np.int64), np.minimum(g, 31)))
        paths = np.concatenate([p for p, _, _ in parts], axis=1)
        owner = np.concatenate([o for _, o, _ in parts])
        group = np.concatenate([g for _, _, g in parts], axis=1).astype(np.int64)
        return paths, owner, group

    def _learn(self, sampled_token_ids, num_tokens_no_spec, tok) -> bool:
        """Score the last step's candidates of every row that still holds the same request
        against the tokens sampled since (see the module doc). True when the step just run held
        exactly the last step's rows, each continuing its request (no prefill in it)."""
        rows, n0, last0, paths, owner, group = self._last
        B, P, k = paths.shape
        nrows = len(sampled_token_ids)
        truth = np.full((B, k), -2, dtype=np.int64)  # -2: not known (never equals a token)
        known = np.zeros(B, dtype=np.int64)
        for j, i in enumerate(rows):
            if i >= nrows:
                continue
            m = len(sampled_token_ids[i])
            if not m or int(num_tokens_no_spec[i]) != n0[j] + m or tok[i, n0[j] - 1] != last0[j]:
                continue  # another request now, or none sampled: nothing to learn
            known[j] = min(m, k)
            truth[j, : known[j]] = tok[i, n0[j] : n0[j] + known[j]]
        same_rows = nrows == B and bool(known.all())
        if P and known.any():
            depth = np.arange(k)
            right = np.cumprod(paths == truth[:, None, :], axis=2).sum(2)  # [B, P] leading
            kept = (paths >= 0) & (depth < known[:, None, None])
            self.stats.update(owner, paths, right, group, kept)
        return same_rows

    def _warm(self) -> None:
        """Compile the host kernels (numba) with the argument types of a step, at start-up."""
        tok = np.zeros((2, max(self.k + 8, 16)), dtype=np.int32)
        tok[0, :8] = [5, 1, 2, 5, 1, 2, 5, 1]
        tok[1, :3] = [5, 1, 2]
        self.propose([[1], [2]], np.array([8, 3], np.int32), tok)
        self.propose([[1], [2]], np.array([9, 4], np.int32), tok)
        self.stats.reset()
        self.cost = StepCost() if self.cost is not None else None
        self._last = None
        self.steps = self.proposed_tokens = 0
        if self.suffix is not None:  # the warm-up's requests are not the server's
            self.suffix = SuffixRows(self.settings.suffix_tokens, self.k)


class SuffixRows:
    """The suffix drafter's trees (:class:`redraft.infer.drafters.suffix.SuffixTrees`) over
    vLLM's rows: a row whose tokens continue what it held at the last step (its token count did
    not shrink and the token it ended with is still there) is the same request, anything else a
    new one. The trees are at least twice as deep as a chain (``k``): a match and its draft
    share the depth, and a chain of ``k`` needs a match of ``k``."""

    def __init__(self, max_tokens: int, k: int = 12):
        from redraft.infer.drafters.suffix import SuffixTrees

        self.trees = SuffixTrees(max(24, 2 * k), max_tokens=max_tokens)
        self.held: dict[int, tuple[int, int, int]] = {}  # row -> (request, tokens held, last)

    def _sync(self, rows, n, tok) -> None:
        seen = set()
        for j, i in enumerate(rows):
            i, nj = int(i), int(n[j])
            seen.add(i)
            rid, m, last = self.held.get(i, (-1, 0, -1))
            if rid >= 0 and m <= nj and int(tok[i, m - 1]) == last:
                self.trees.append(rid, tok[i, m:nj])
            else:
                if rid >= 0:
                    self.trees.stop(rid)
                # the last token is the first one sampled (vLLM's first step after the
                # prompt): output, for the global tree too
                rid = self.trees.start(tok[i, : nj - 1])
                self.trees.append(rid, tok[i, nj - 1 : nj])
            self.held[i] = (rid, nj, int(tok[i, nj - 1]))
        for i in [i for i in self.held if i not in seen]:  # rows no longer in the batch
            self.trees.stop(self.held.pop(i)[0])

    def candidates(self, rows, n, tok, paths: int, k: int):
        """``(paths int64 [B, paths, k], group int64 [B, paths])`` of every row."""
        self._sync(rows, n, tok)
        out = np.full((len(rows), paths, k), PAD, np.int64)
        group = np.zeros((len(rows), paths), np.int64)
        for j, i in enumerate(rows):
            p, g = self.trees.paths(self.held[int(i)][0], tok[i, : n[j]], paths, k)
            out[j, : len(p)], group[j, : len(p)] = p, g
        return out, group


def earliest_longest_match(seqs, q_min: int, q_max: int, k: int, window: int) -> np.ndarray:
    """``[B, k]``: per row, what followed the earliest place (within the last ``window``
    tokens) where the row's longest suffix of ``q_min .. q_max`` tokens occurred before (vLLM's
    ``ngram`` rule; ``PAD`` where no suffix recurs)."""
    out = np.full((len(seqs), k), PAD, dtype=np.int64)
    for b, row in enumerate(seqs):
        _earliest(np.asarray(row, dtype=np.int64), q_min, q_max, k, window, out[b])
    return out


@_njit
def _earliest(row, q_min, q_max, k, window, out):
    n = row.shape[0]
    best, where = 0, -1
    for p in range(max(1, n - window), n):  # a match ends at p - 1; its continuation starts at p
        m = 0
        while m < q_max and p - 1 - m >= 0 and row[p - 1 - m] == row[n - 1 - m] and p < n:
            m += 1
        if p == n:
            break
        if m > best and m >= q_min:  # strictly longer: the earliest of the longest is kept
            best, where = m, p
    if where >= 0:
        for j in range(min(k, n - where)):
            out[j] = row[where + j]


def trigram_chains(table, w1, w2, k: int, branches: int) -> np.ndarray:
    """``[B, branches, k]`` chains through a tri-gram table: the ``branches`` most probable
    successors of ``(w1, w2)``, each followed by its most probable successor ``k - 1`` times
    (``PAD`` from the first context the table has not seen)."""
    B = len(w2)
    out = np.full((B, branches, k), PAD, dtype=np.int64)
    ids, _ = table.successors(w1, w2, branches)  # [B, branches]
    out[:, :, 0] = ids
    a = np.broadcast_to(w2[:, None], (B, branches)).copy()
    b = ids.copy()
    for d in range(1, k):
        nxt, _ = table.successors(a, b, 1)
        nxt = np.where(b >= 0, nxt[..., 0], PAD)
        out[:, :, d] = nxt
        a, b = b, nxt
    return out


def _fit(paths: np.ndarray, k: int) -> np.ndarray:
    """``[B, P, L]`` -> ``[B, P, k]``: cut or ``PAD``-padded."""
    L = paths.shape[2]
    if L >= k:
        return np.ascontiguousarray(paths[:, :, :k])
    pad = np.full((*paths.shape[:2], k - L), PAD, dtype=paths.dtype)
    return np.concatenate([paths, pad], axis=2)


def _tokenizer(model_config):
    from transformers import AutoTokenizer

    name = getattr(model_config, "tokenizer", None) or model_config.model
    try:
        return AutoTokenizer.from_pretrained(
            name, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
        )
    except Exception as e:  # noqa: BLE001 (any loader failure: say which tokenizer)
        raise ArtifactError(
            f"redraft's vLLM proposer could not load the tokenizer {name!r} to check the n-gram "
            f"tables against it: {e}"
        ) from e


def _load_tables(spec: str, tokenizer, vocab_size: int):
    """The n-gram tables, checked against the served model's tokenizer (fingerprint, vocab)."""
    from types import SimpleNamespace

    from redraft.models import tokenizer_fingerprint
    from redraft.ngrams.tables import NGramTables

    target = SimpleNamespace(
        model_id=getattr(tokenizer, "name_or_path", "the served model"),
        fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=vocab_size,
    )
    try:
        return NGramTables.load(spec, target=target)
    except ArtifactError as e:
        raise ArtifactError(f"{ENV_VAR}: ngrams={spec!r}: {e}") from e

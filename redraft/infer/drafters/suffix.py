"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) as a drafter: suffix trees over the
request and over everything the decoder has already written.

Two kinds of suffix tree, both from ``arctic_inference.suffix_decoding.SuffixDecodingCache``
(Snowflake's compiled implementation, the one vLLM's ``suffix`` method uses):

* a **local** tree per running request over its prompt and output so far (what the context
  drafter also matches, with frequencies over every match length);
* one **global** tree over the outputs of earlier requests, living as long as the drafter (the
  decoder, the server): a server sees the same system prompts, code, tool calls and phrasing
  again and again. It is bounded by ``max_tokens`` (output tokens held; the oldest requests'
  outputs are evicted first).

Every step each row's last tokens are matched in both trees; the better match speculates a
small tree whose size follows how long the match is (at most ``max_spec_factor`` tokens per
matched token, at most ``max_tokens_per_path``) and how often each continuation followed it
(``min_token_prob``). Its root-to-leaf paths join the decoder's one verification tree beside the
other drafters' candidates; each path's statistics group is its match length class and its
probability class, so the decoder learns how reliable each kind of match is and the budget and
the drafter gate weigh it like any other drafter.

Rows are requests: :meth:`SuffixDrafter.add_rows_host` starts them (prompt into their local
tree), every step's new tokens are appended (local and global trees), and
:meth:`SuffixDrafter.retire_rows_host` stops them when they leave the batch (finished or
cancelled: their output so far stays in the global tree).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from redraft.errors import ConfigError
from redraft.infer.spec.drafter import Draft, HostDrafter, HostFeedback, HostState
from redraft.infer.spec.paths import PAD

# statistics groups: match length class x probability class (4 x 4 of HostStats' 32 groups)
MATCH_CLASSES = np.array([3, 6, 12])  # match lengths < 3, < 6, < 12, >= 12 tokens
PROB_CLASSES = np.array([0.25, 0.5, 0.8])  # the path's estimated probability


def suffix_available() -> bool:
    """Whether arctic-inference (the suffix trees) is installed."""
    from importlib.util import find_spec

    return find_spec("arctic_inference") is not None


def suffix_cache(max_depth: int, global_tree: bool = True):
    """A ``SuffixDecodingCache`` without arctic-inference's own request bound (the drafter keeps
    a token bound), with or without the global tree; a clear error when the package is
    missing."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise ConfigError(
            "the suffix drafter needs the package arctic-inference (Snowflake's suffix trees, "
            "the ones vLLM's `suffix` method uses): pip install arctic-inference"
        ) from e
    return SuffixDecodingCache(
        max_tree_depth=max_depth, max_cached_requests=-1 if global_tree else 0
    )


def tree_paths(
    token_ids, parents, probs, max_paths: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """The root-to-leaf paths of a speculated tree (``parents[i]`` the index of token i's parent,
    ``-1`` under the root; a parent comes before its children), the most probable leaves first.

    Returns ``(paths [P, max_len] int64 PAD-padded, leaf probability [P])`` with ``P <= max_paths``.
    """
    n = len(token_ids)
    if n == 0:
        return np.full((0, max_len), PAD, np.int64), np.zeros(0, np.float32)
    parents = np.asarray(parents, np.int64)
    is_leaf = np.ones(n, bool)
    is_leaf[parents[parents >= 0]] = False
    leaves = np.flatnonzero(is_leaf)
    prob = np.asarray(probs, np.float32)
    leaves = leaves[np.argsort(-prob[leaves], kind="stable")][:max_paths]
    paths = np.full((len(leaves), max_len), PAD, np.int64)
    for p, leaf in enumerate(leaves):
        chain = []
        node = int(leaf)
        while node >= 0:
            chain.append(token_ids[node])
            node = int(parents[node])
        chain = chain[::-1][:max_len]
        paths[p, : len(chain)] = chain
    return paths, prob[leaves]


def path_groups(match_len: int, leaf_prob: np.ndarray) -> np.ndarray:
    """``[P]`` statistics group of each path: match length class * 4 + probability class (the
    more probable, the lower)."""
    m = int(np.searchsorted(MATCH_CLASSES, match_len, side="right"))
    p = len(PROB_CLASSES) - np.searchsorted(PROB_CLASSES, leaf_prob, side="right")
    return (m * (len(PROB_CLASSES) + 1) + p).astype(np.int64)


class SuffixTrees:
    """The suffix trees of a stream of requests, however the caller knows them (the engine's
    rows, the vLLM proposer's rows): a local tree per active request, the global tree over
    outputs bounded to ``max_tokens`` (oldest requests evicted first; 0: none).

    ``start(tokens)`` -> request id (``tokens``: its prompt, and output so far, in its local tree
    only); ``append(rid, tokens)`` (new output: local and global trees); ``stop(rid)``;
    ``paths(rid, context, ...)`` speculates.
    """

    def __init__(self, max_depth: int = 24, max_tokens: int = 1_000_000):
        if max_tokens < 0:
            raise ConfigError(
                f"suffix drafter: max_tokens={max_tokens}; use 0 (no global tree) or more."
            )
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.cache = suffix_cache(max_depth, global_tree=max_tokens > 0)
        self._ids = itertools.count()
        self.held: OrderedDict[int, int] = OrderedDict()  # global tree: request -> output tokens
        self.held_tokens = 0

    def start(self, tokens) -> int:
        rid = next(self._ids)
        self.cache.start_request(rid, np.ascontiguousarray(tokens, np.int32))
        if self.max_tokens:
            self.held[rid] = 0
        return rid

    def append(self, rid: int, tokens) -> None:
        if not len(tokens):
            return
        self.cache.add_active_response(rid, np.ascontiguousarray(tokens, np.int32))
        if rid in self.held:
            self.held[rid] += len(tokens)
            self.held_tokens += len(tokens)
            while self.held_tokens > self.max_tokens and self.held:  # the oldest outputs go
                old, n = self.held.popitem(last=False)
                self.cache.evict_cached_response(old)
                self.held_tokens -= n

    def stop(self, rid: int) -> None:
        if rid in self.cache.active_requests:
            self.cache.stop_request(rid)

    def forget(self) -> None:
        """Drop every finished request's output from the global tree (an active request's
        stays: its local tree drafts from it)."""
        for rid in [r for r in self.held if r not in self.cache.active_requests]:
            self.cache.evict_cached_response(rid)
            self.held_tokens -= self.held.pop(rid)

    @property
    def active(self) -> int:
        return len(self.cache.active_requests)

    def paths(
        self,
        rid: int,
        context,
        max_paths: int,
        max_len: int,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(paths [P, max_len], group [P])`` speculated after ``context`` (the request's last
        tokens) from the better of its local tree and the global tree."""
        d = self.cache.speculate(
            rid,
            np.ascontiguousarray(context[-self.max_depth :], np.int32),
            max_spec_tokens=max_len,
            max_spec_factor=max_spec_factor,
            min_token_prob=min_token_prob,
            use_tree_spec=True,
        )
        paths, prob = tree_paths(d.token_ids, d.parents, d.probs, max_paths, max_len)
        return paths, path_groups(d.match_len, prob)


class SuffixDrafter(HostDrafter):
    """SuffixDecoding's per-request and global suffix trees (see the module docstring).

    Args:
        max_paths: at most this many root-to-leaf paths per row (the speculated tree's leaves).
        max_tokens_per_path: tokens per path (the tree's depth).
        max_spec_factor: speculate at most this many tokens per matched token (SuffixDecoding's
            adaptive length: a long match earns a long draft).
        min_token_prob: drop continuations estimated less likely than this.
        max_depth: the suffix trees' depth, a match and its draft together (default twice
            ``max_tokens_per_path``: a match as long as a path drafts a whole path; at 24, the
            depth vLLM's ``suffix`` method uses, drafts stop at 12 tokens, and a repeated
            answer that could be verified 32 tokens a step takes 12).
        max_tokens: output tokens the global tree holds; the oldest requests' outputs leave
            first. 0: no global tree (each request drafts from itself only).
    """

    def __init__(
        self,
        max_paths: int = 8,
        max_tokens_per_path: int = 32,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_depth: int | None = None,
        max_tokens: int = 1_000_000,
        name: str = "suffix",
    ):
        self.max_paths, self.max_len = max_paths, max_tokens_per_path
        self.max_spec_factor, self.min_token_prob, self.name = max_spec_factor, min_token_prob, name
        self.trees = SuffixTrees(max_depth or 2 * max_tokens_per_path, max_tokens)
        self.rows: list[int] = []  # the trees' request id of every batch row
        self.added: list[int] = []  # tokens of each row the trees hold (prompt + output)

    # ------------------------------------------------------------------ rows = requests

    def add_rows_host(self, host: HostState, start: int) -> None:
        for b in range(start, host.batch_size):
            seq, n = host.seqs[b], int(host.prompt_lengths[b])
            self.rows.append(self.trees.start(seq[:n]))
            self.added.append(n)
            self._append(b, seq)

    def _append(self, b: int, seq: np.ndarray) -> None:
        """Give the trees row ``b``'s tokens they do not hold yet."""
        self.trees.append(self.rows[b], seq[self.added[b] :])
        self.added[b] = len(seq)

    def retire_rows_host(self, host: HostState, rows: list[int]) -> None:
        """Rows ``rows`` of ``host`` leave the batch: their last tokens into the trees, then
        their local trees go (their output stays in the global tree until evicted)."""
        for b in rows:
            self._append(int(b), host.seqs[b])
            self.trees.stop(self.rows[b])

    def forget(self) -> None:
        self.trees.forget()

    def select_rows(self, keep) -> None:
        keep = np.asarray(keep.cpu() if hasattr(keep, "cpu") else keep, np.int64)
        for b in set(range(len(self.rows))) - set(keep.tolist()):
            self.trees.stop(self.rows[b])  # (a no-op after retire_rows_host)
        self.rows = [self.rows[b] for b in keep]
        self.added = [self.added[b] for b in keep]

    # ------------------------------------------------------------------ drafting

    def propose_host(self, host: HostState) -> Draft:
        B = host.batch_size
        tokens = np.full((B, self.max_paths, self.max_len), PAD, np.int64)
        group = np.zeros((B, self.max_paths), np.int64)
        width = 0
        for b in range(B):
            seq = host.seqs[b]
            self._append(b, seq)
            paths, g = self.trees.paths(
                self.rows[b],
                seq,
                self.max_paths,
                self.max_len,
                self.max_spec_factor,
                self.min_token_prob,
            )
            P = len(paths)
            tokens[b, :P], group[b, :P] = paths, g
            width = max(width, P)
        if width == 0:
            return Draft(tokens=np.full((B, 0, 1), PAD, np.int64))
        L = int((tokens[:, :width] >= 0).sum(axis=-1).max())
        return Draft(tokens=tokens[:, :width, :L], group=group[:, :width])

    def observe_host(self, host: HostState, draft: Draft, feedback: HostFeedback) -> None:
        """Nothing to learn beyond the tokens, which :meth:`propose_host` appends (the decoder
        keeps the per-group acceptance rates)."""

    @property
    def global_requests(self) -> int:
        """Requests whose output the global tree holds."""
        return len(self.trees.held)

"""Prefix caching: a request whose prompt starts with tokens an earlier request held in the KV
cache copies their keys and values instead of computing them again.

A server sees the same system prompt, the same document, the same conversation with one more
turn, the same question asked again; vLLM and SGLang keep finished requests' KV for that
(automatic prefix caching, RadixAttention). Here a finished or cancelled row's cached tokens are
cut into blocks of ``BLOCK`` tokens, each kept as its own tensor ``[layers, 2, kv_heads, BLOCK,
head_dim]`` under the key ``(its parent block's id, its tokens)``: a key names exactly one
prefix (tokens are compared, not hashed, so two prompts never share a block by a collision), and
requests that share a prefix share its blocks. A new request walks its prompt block by block and
starts its prefill after the last block found (never at its last token: the prefill computes the
hidden state its first output token is sampled from).

The store is bounded by ``max_tokens`` (whole blocks) and evicts the least recently used block
first. Using or storing a chain touches its blocks from the last to the first, so a prefix is
always more recent than what extends it and a block never outlives its parent's turn to go: the
leaves of stale conversations go first, a shared system prompt stays.

Keys and values are stored after rotary embedding, at the positions they were computed at; a
prefix is only ever reused at the same positions (a prompt's first tokens). Reused entries were
computed by other forwards (a prefill of a longer prompt, a verify of a tree) than a fresh
prefill would be: the same float rounding as chunked prefill or speculative decoding itself, which
already compute a prompt's or an output's entries in forwards of varying shapes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np
import torch

BLOCK = 16  # tokens per block (vLLM's default block size too)


class PrefixCache:
    """Blocks of earlier requests' KV entries by the tokens before them (see the module doc).

    ``store(tokens, kv)`` keeps the full blocks of a row (``kv [layers, 2, kv_heads, n, d]``,
    the row's cache columns ``0 .. n - 1``); ``match(tokens, limit)`` finds the longest stored
    prefix of ``tokens`` (at most ``limit`` tokens) and ``copy(blocks, m, out)`` writes its
    first ``m`` tokens' entries into a row's columns.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self.blocks: OrderedDict[tuple, tuple[int, torch.Tensor]] = OrderedDict()
        self._ids = itertools.count(1)  # 0: the root every first block hangs from
        self.reused = 0  # prompt tokens found, over every match

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK

    def clear(self) -> None:
        self.blocks.clear()

    def _keys(self, tokens, n_blocks: int):
        """The keys of ``tokens``' first blocks while they are stored: ``[(key, entry)]``."""
        found, parent = [], 0
        for i in range(n_blocks):
            key = (parent, tuple(int(t) for t in tokens[i * BLOCK : (i + 1) * BLOCK]))
            entry = self.blocks.get(key)
            if entry is None:
                break
            found.append((key, entry))
            parent = entry[0]
        return found

    def _touch(self, keys) -> None:
        for key in reversed(keys):  # the first block ends most recent: prefixes outlive leaves
            self.blocks.move_to_end(key)

    def match(self, tokens, limit: int) -> tuple[int, list[torch.Tensor]]:
        """``(m, blocks)``: the stored prefix of ``tokens`` of ``m <= limit`` tokens (whole
        blocks, the last one possibly cut by ``limit``) and its blocks."""
        if limit <= 0 or not self.blocks:
            return 0, []
        found = self._keys(tokens, -(-min(limit, len(tokens)) // BLOCK))
        self._touch([k for k, _ in found])
        m = min(len(found) * BLOCK, limit)
        self.reused += m
        return m, [e[1] for _, e in found]

    @staticmethod
    def copy(blocks: list[torch.Tensor], m: int, out: torch.Tensor) -> None:
        """Write the first ``m`` tokens' entries of ``blocks`` into ``out [layers, 2,
        kv_heads, >= m, d]`` (a row's cache columns)."""
        for i, b in enumerate(blocks):
            n = min(BLOCK, m - i * BLOCK)
            if n <= 0:
                break
            out[:, :, :, i * BLOCK : i * BLOCK + n].copy_(b[:, :, :, :n])

    def store(self, tokens, kv: torch.Tensor) -> None:
        """Keep the full blocks of ``tokens`` (``len(tokens)`` = ``kv.shape[3]``) not stored
        yet; then evict the least recently used blocks beyond ``max_tokens``."""
        n_blocks = min(len(tokens), kv.shape[3]) // BLOCK
        if n_blocks == 0 or self.max_tokens < BLOCK:
            return
        tokens = np.asarray(tokens)
        keys = [k for k, _ in self._keys(tokens, n_blocks)]
        parent = self.blocks[keys[-1]][0] if keys else 0
        for i in range(len(keys), n_blocks):
            key = (parent, tuple(int(t) for t in tokens[i * BLOCK : (i + 1) * BLOCK]))
            entry = (next(self._ids), kv[:, :, :, i * BLOCK : (i + 1) * BLOCK].clone())
            self.blocks[key] = entry
            keys.append(key)
            parent = entry[0]
        self._touch(keys)
        while self.tokens > self.max_tokens:
            self.blocks.popitem(last=False)

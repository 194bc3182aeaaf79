"""The drafter interface: what every drafter gives the decoder and what it gets back.

A drafter turns the decoding state of a batch into candidate *paths*: token sequences that may
continue each row after the token the target produced last (the "bonus" token ``y``). The
decoder merges the paths of all drafters into one tree (shared prefixes stored once), verifies
the tree with one target forward, accepts the longest verified path per row, and then calls
every drafter's :meth:`Drafter.observe` with what was accepted, so drafters can learn.

Life cycle (rows join and leave the batch at step boundaries, as in a server)::

    drafter.add_rows(state, start)            # rows start..B-1 of state are new requests
    while rows remain:
        draft = drafter.propose(state)        # Draft(tokens [B, P, L], ...)
        ... verify ...
        drafter.observe(state, draft, feedback)
        drafter.retire_rows_host(host, gone)  # host drafters: rows about to leave, final tokens
        drafter.select_rows(keep)             # finished rows left the batch

Shapes: ``B`` rows, ``P`` paths per row, ``L`` tokens per path, ``V`` target vocab size.

Every drafted token is verified as a point mass (whatever proposed it), so the decoder never
needs a drafter's own distribution: greedy verification reproduces plain greedy decoding, and
rejection sampling over the tree keeps the target's distribution exactly
(``redraft.infer.spec.accept``). A drafter may still sample its tokens (HSDDW's chains do at
temperature > 0, from the generators in ``state.sampling``); that changes which candidates are
proposed, never the output's distribution. Drafters built from drafters (hierarchies, mixes)
hold their children and return one ``Draft``; per-request state lives in the drafter, indexed by
batch row, and :meth:`add_rows` / :meth:`select_rows` keep it aligned with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from redraft.infer.spec.paths import PAD


@dataclass
class DecodeState:
    """What a drafter may look at. Read-only for drafters.

    Attributes:
        tokens: ``[B, T]`` long: prompt + output so far per row, right-padded with ``PAD``;
            the last valid token of each row is the bonus token ``y`` (not yet in the KV cache).
        lengths: ``[B]`` long: valid tokens per row (``tokens[b, lengths[b]-1] == last[b]``).
        last: ``[B]`` long: the bonus token ``y`` each path continues.
        hidden: ``[B, H]``: the target's last-layer hidden state (after the final norm) at the
            position that produced ``y`` (the token before it), or ``None`` before the first
            verify. ReDrafter and other hidden-state drafters condition on it. When a drafter
            reads several layers (a ``multi`` ReDrafter head's ``hidden_layers``), it is
            ``[B, k*H]``: those layers' states concatenated, the last H columns the last layer's.
        prompt_lengths: ``[B]`` long: how many of ``tokens`` are the prompt.
        step: verify steps done so far in this batch.
        request_ids: ``[B]`` long: which request each row is (rows join and leave the batch).
        sampling: the rows' sampling settings (``redraft.infer.spec.accept.RowSampling``:
            ``temperature [B]``, ``top_p [B]``, per-row ``generators``), or ``None`` (greedy).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    last: torch.Tensor
    hidden: torch.Tensor | None
    prompt_lengths: torch.Tensor
    step: int
    request_ids: torch.Tensor
    sampling: object = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device


@dataclass
class HostState:
    """What host drafters see: ``seqs[b]`` row b's tokens (int64 numpy, prompt + output, the
    last one is ``last[b]``), ``prompt_lengths [B]``."""

    seqs: list[np.ndarray]
    last: np.ndarray
    prompt_lengths: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.seqs)


@dataclass
class Draft:
    """Candidate paths of one drafter for every row.

    Attributes:
        tokens: ``[B, P, L]`` long target-vocab ids; a path ends at its first ``PAD`` (paths may
            have different lengths, a row may have fewer paths: all-``PAD`` rows of paths).
            ``tokens[b, p, 0]`` is the token proposed right after ``state.last[b]``.
        logp: ``[B, P, L]`` float or ``None``: the drafter's log-probability of each token given
            the path before it. Used to rank nodes when the tree is pruned to a fixed verify
            budget (higher is kept first); ``None`` ranks by the observed acceptance rates.
        group: ``[B, P]`` long or ``None``: the statistics group of each path. The decoder
            estimates how likely a node is to be accepted from the observed acceptance rate of
            (drafter, group, depth); paths of one group should be alike in reliability (e.g. a
            context match of 3 tokens vs. of 1 token). ``None``: the path's rank ``p``.
    """

    tokens: torch.Tensor
    logp: torch.Tensor | None = None
    group: torch.Tensor | None = None

    @property
    def num_paths(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def path_length(self) -> int:
        return int(self.tokens.shape[2])

    @staticmethod
    def empty(batch_size: int, device=None) -> Draft:
        """A draft with no paths (the tree is the root alone)."""
        return Draft(tokens=torch.full((batch_size, 0, 1), PAD, dtype=torch.long, device=device))


@dataclass
class Feedback:
    """What verification did with a drafter's paths (given to :meth:`Drafter.observe`).

    Attributes:
        accepted_prefix: ``[B, P]`` long: how many leading tokens of each of this drafter's
            paths were accepted (the path's token at that index, if any, was rejected or lies
            on a branch the verifier did not take).
        accepted: ``[B, A]`` long: the accepted draft tokens per row, ``PAD``-padded.
        num_accepted: ``[B]`` long: accepted draft tokens per row (the bonus not counted).
        bonus: ``[B]`` long: the token the target produced after the accepted ones (the next
            ``state.last``).
        verified: ``[B, P]`` long: how many leading tokens of each path were in the verified
            tree (the rest were cut by the node budget). A path token at index
            ``accepted_prefix < verified`` was verified and not accepted.
    """

    accepted_prefix: torch.Tensor
    accepted: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    verified: torch.Tensor


@dataclass
class HostFeedback:
    """What verification did with a host drafter's paths (numpy; see :class:`Feedback`):
    ``accepted_prefix [B, P]``, ``acceptance`` (``redraft.infer.spec.accept.HostAcceptance``: the
    accepted path, tokens and bonus of every row), ``verified [B, P]``."""

    accepted_prefix: object
    acceptance: object
    verified: object


class Drafter:
    """A device drafter, and the hooks every drafter has. Two protocols, one per side:

    * device (this class): :meth:`add_rows`, :meth:`propose` (required), :meth:`observe`, on
      a :class:`DecodeState` of device tensors; the speculator reads its paths back;
    * host (:class:`HostDrafter`): :meth:`HostDrafter.add_rows_host`,
      :meth:`HostDrafter.propose_host` (required), :meth:`HostDrafter.observe_host`, on the
      host's token lists (:class:`HostState`) with numpy: no device work, no device read.

    Every hook but ``propose`` / ``propose_host`` is optional (the defaults do nothing); the
    decoder calls one side's hooks, chosen by ``host``, and those below for both.

    Class attributes:
        name: short name used in stats and benchmark tables.
        host: False here, True for a :class:`HostDrafter`.
        hidden_layers: the target layers below the last whose hidden states it reads in
            ``DecodeState.hidden``, the last one last (``()``: the last hidden state only;
            multi-layer ReDrafter heads).
    """

    name: str = "drafter"
    host: bool = False
    hidden_layers: tuple[int, ...] = ()

    # ---- both sides

    def bind(self, speculator, index: int) -> None:
        """Called once when a decoder is built: the ``redraft.infer.spec.speculator.Speculator``
        whose measurements (acceptance rates ``speculator.stats``, the verify-cost curve, the
        drafting time) this drafter, number ``index``, may plan from. Default: nothing."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows ``keep`` ([B'] long indices into the current batch) stay; drop the others'
        per-request state. Called when requests finish."""

    def forget(self) -> None:
        """Forget what earlier requests' tokens taught beyond acceptance statistics (the suffix
        drafter's global tree of their outputs): afterwards it drafts as a fresh drafter would
        for a new request. Called by :meth:`redraft.infer.decoder.SpeculativeDecoder.forget`
        between requests. Default: nothing."""

    # ---- the device side

    def add_rows(self, state: DecodeState, start: int) -> None:
        """Rows ``start .. state.batch_size - 1`` of ``state`` are new requests (appended after
        the running ones; ``start == 0``: a fresh batch): set up their per-request state."""

    def propose(self, state: DecodeState) -> Draft:
        """Return candidate paths continuing ``state.last`` for every row."""
        raise NotImplementedError(f"{type(self).__name__} drafts on the device: define propose")

    def observe(self, state: DecodeState, draft: Draft, feedback: Feedback) -> None:
        """Called after verification with the draft this drafter proposed in this step.

        ``state`` is the state the draft was made from. Adaptive drafters update here (ADED's
        tri-gram boosts, HSDDW's entropy threshold from rejected tokens).
        """


class HostDrafter(Drafter):
    """A drafter that drafts on the host: from every row's tokens (:class:`HostState`) with
    numpy, returning a :class:`Draft` of numpy arrays. The n-gram drafters and ADED are host
    drafters (the n-gram drafters also keep a device :meth:`propose`, their torch reference)."""

    host = True

    def add_rows_host(self, host: HostState, start: int) -> None:
        """Rows ``start ..`` of ``host`` (prompt + first output token, ``prompt_lengths``) are
        new requests: set up their per-request state."""

    def propose_host(self, host: HostState) -> Draft:
        """Candidate paths (numpy ``[B, P, L]``) continuing ``host.last`` for every row."""
        raise NotImplementedError(f"{type(self).__name__} drafts on the host: define propose_host")

    def observe_host(self, host: HostState, draft: Draft, feedback: HostFeedback) -> None:
        """What verification did with this step's draft (the host side of :meth:`observe`)."""

    def retire_rows_host(self, host: HostState, rows: list[int]) -> None:
        """Rows ``rows`` (indices into ``host``, which holds their final tokens) are about to
        leave the batch, finished or cancelled. Called before :meth:`select_rows`; drafters that
        learn across requests (the suffix drafter's global tree) take the rows' last tokens
        here."""

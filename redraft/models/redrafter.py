"""The ReDrafter draft head (Zhang et al., Apple 2024), as a transformers model.

One small recurrent head on top of a frozen target LLM::

    e_i = E[tokens[..., i]]                    target's input embedding (shared, frozen, not saved)
    s_i = f(U s_{i-1} + W e_i + b)             f = SiLU by default;  s_{-1} = 0  (see below)
    h_i = [s_i, x]                             x = target's last hidden state (the LM head's input)
    h_i <- h_i + SiLU(Linear(h_i))             ``num_layers`` ResNet blocks
    logits_i = O h_i                           the head's own output layer, [Vd] draft vocabulary

``rnn=False`` is the paper's ablation: U = I, W = I, b = 0, f = identity, so ``s_i`` is the plain
running sum of the draft tokens' embeddings.

Which hidden state pairs with which token (the one contract training and decoding share)
------------------------------------------------------------------------------------------
At decode time the decoder has committed tokens ``y_1 .. y_t``; ``y_t`` (the "bonus" token) was
just produced by the target's LM head from the hidden state at position ``t-1``. The drafter gets

    context   x         = hidden state at position t-1   (the one whose LM-head output gave y_t)
    tokens[..., 0]      = y_t                              (a target id)
    tokens[..., i > 0]  = draft tokens y_{t+1}, ...        (target ids)
    logits[..., i]      predicts y_{t+i+1}

and the recurrence starts from ``s_{-1} = 0``, so its first state is exactly
``s_0 = f(W e(y_t) + b)`` (``U @ 0`` vanishes; for ``rnn=False``: ``s_0 = e(y_t)``). This is what
Apple's reference does: its beam search starts from a zero state and feeds ``init_token`` (the
token sampled from the target's own LM head) first, and its trainer pairs the hidden state
``h_t`` with the embeddings of ``ids[t+1], ids[t+2], ...`` to predict ``ids[t+2], ids[t+3], ...``.

In training on a sequence ``ids`` with hidden states ``hid`` (``hid[t]`` is the LM-head input
that predicts ``ids[t+1]``), the same pairing reads, for every position ``t`` at once::

    context = hid[t]              tokens = ids[t+1 .. t+n]          targets = ids[t+2 .. t+n+1]

so step ``i`` (0-based) predicts token ``t+i+2``, i.e. ``i+2`` tokens past the hidden state: the
target itself already predicts ``t+1``. (The issue text's "from the hidden state at t, step i
predicts token t+i+1" counts steps from 1.) ``redraft.train`` builds exactly these windows.

Tokens fed to :meth:`ReDrafter.forward` / :meth:`ReDrafter.step` are always *target* ids (they
index the shared embedding); logits index the *draft* vocabulary, which equals the target's unless
``draft_vocab_size`` is set: map draft ids back with :meth:`ReDrafter.to_target_ids`.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN

from redraft.errors import ArtifactError, RedraftError
from redraft.models.target import Target, check_fingerprint
from redraft.utils import resolve_dtype

__all__ = ["ReDrafterConfig", "ReDrafter", "load_drafter"]


class ReDrafterConfig(PretrainedConfig):
    """Configuration of a :class:`ReDrafter` head.

    Args:
        hidden_size: width H of the target's last hidden state ``x``.
        embedding_dim: width E of the target's input embedding (= the RNN state width S);
            ``None`` means ``hidden_size``.
        vocab_size: the target's vocabulary size V (rows of its input embedding).
        draft_vocab_size: size Vd of the reduced draft vocabulary (the Vd most frequent target
            tokens in the training data), or ``None`` for the full vocabulary (the default).
        num_layers: number of ResNet blocks ``h + act(Linear(h))`` before the output layer.
        rnn: ``True`` for the recurrence ``s_i = f(U s_{i-1} + W e_i + b)``; ``False`` for the
            paper's ablation ``s_i = s_{i-1} + e_i``.
        activation: ``f`` of the recurrence and of the ResNet blocks (a transformers ACT2FN name).
        num_steps: the training horizon n (draft tokens predicted per hidden state).
        target_model, tokenizer_fingerprint, target_vocab_size, target_hidden_size: the target
            this head belongs to (DESIGN.md); ``load_drafter`` checks the fingerprint.
        initializer_range: std of the normal init of every linear layer.
    """

    model_type = "redrafter"

    def __init__(
        self,
        hidden_size: int = 576,
        embedding_dim: int | None = None,
        vocab_size: int = 49152,
        draft_vocab_size: int | None = None,
        num_layers: int = 2,
        rnn: bool = True,
        activation: str = "silu",
        num_steps: int = 5,
        target_model: str | None = None,
        tokenizer_fingerprint: str | None = None,
        target_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        kwargs.setdefault("tie_word_embeddings", False)  # the head owns its output layer
        self.hidden_size = int(hidden_size)
        self.embedding_dim = int(embedding_dim) if embedding_dim is not None else int(hidden_size)
        self.vocab_size = int(vocab_size)
        self.draft_vocab_size = int(draft_vocab_size) if draft_vocab_size else None
        self.num_layers = int(num_layers)
        self.rnn = bool(rnn)
        self.activation = activation
        self.num_steps = int(num_steps)
        self.target_model = target_model
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.target_vocab_size = int(target_vocab_size) if target_vocab_size else self.vocab_size
        self.target_hidden_size = int(target_hidden_size) if target_hidden_size else self.hidden_size
        self.initializer_range = float(initializer_range)
        super().__init__(**kwargs)
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}] "
                f"(or None for the full vocabulary)."
            )
        if activation not in ACT2FN:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACT2FN)}")

    @property
    def state_size(self) -> int:
        """Width S of the RNN state (= E: the ablation adds embeddings into it)."""
        return self.embedding_dim

    @property
    def out_vocab_size(self) -> int:
        """Vd: rows of the output layer."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def for_target(cls, target: Target, **kwargs) -> "ReDrafterConfig":
        """A config sized for ``target`` that records its id, sizes and tokenizer fingerprint."""
        meta = target.artifact_metadata()
        return cls(
            hidden_size=target.hidden_size,
            embedding_dim=int(target.input_embedding.weight.shape[1]),
            vocab_size=int(target.input_embedding.weight.shape[0]),
            **meta,
            **kwargs,
        )


class ResBlock(nn.Module):
    """``h + act(Linear(h))``: one residual block of the head."""

    def __init__(self, width: int, activation: str):
        super().__init__()
        self.linear = nn.Linear(width, width, bias=True)
        self.act = ACT2FN[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.linear(h))


class ReDrafter(PreTrainedModel):
    """The ReDrafter head: its own weights only (U, W, b, ResNet blocks, output layer).

    The target's input embedding is attached with :meth:`attach_embeddings` /
    :meth:`attach_target`; it is held outside the module tree, so it is never trained, moved or
    saved with the drafter.
    """

    config_class = ReDrafterConfig
    base_model_prefix = "redrafter"
    main_input_name = "tokens"
    _no_split_modules = ["ResBlock"]

    def __init__(self, config: ReDrafterConfig):
        super().__init__(config)
        H, S = config.hidden_size, config.state_size
        if config.rnn:
            self.rnn_w = nn.Linear(config.embedding_dim, S, bias=False)  # W
            self.rnn_u = nn.Linear(S, S, bias=True)  # U and b
        self.act = ACT2FN[config.activation]
        self.blocks = nn.ModuleList([ResBlock(S + H, config.activation) for _ in range(config.num_layers)])
        self.lm_head = nn.Linear(S + H, config.out_vocab_size, bias=False)  # O
        if config.draft_vocab_size is not None:
            # [Vd] target id of each draft id; set by set_draft_vocab and saved in the checkpoint.
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        self._embedding: tuple[nn.Embedding, ...] = ()  # a tuple hides it from nn.Module
        self.post_init()

    # ---------------------------------------------------------------- target embedding, vocab

    def attach_embeddings(self, embedding: nn.Embedding) -> "ReDrafter":
        """Use ``embedding`` (the target's input embedding, [V, E]) for draft tokens. Returns self."""
        V, E = embedding.weight.shape
        if (V, E) != (self.config.vocab_size, self.config.embedding_dim):
            raise RedraftError(
                f"The drafter expects an input embedding of shape [{self.config.vocab_size}, "
                f"{self.config.embedding_dim}] (vocab_size, embedding_dim) but got [{V}, {E}]; the "
                f"drafter belongs to target {self.config.target_model!r}."
            )
        self._embedding = (embedding,)
        return self

    def attach_target(self, target: Target) -> "ReDrafter":
        """Attach ``target.input_embedding``. Returns self."""
        return self.attach_embeddings(target.input_embedding)

    @property
    def embedding(self) -> nn.Embedding:
        if not self._embedding:
            raise RedraftError(
                "This ReDrafter has no input embedding attached: call drafter.attach_target(target) "
                "(or load it with redraft.models.redrafter.load_drafter(path, target))."
            )
        return self._embedding[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids ``[...]`` -> embeddings ``[..., E]`` in the head's dtype (no gradient flows
        into the frozen table)."""
        emb = self.embedding
        with torch.no_grad():
            e = emb(tokens.to(emb.weight.device))
        return e.to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Fill the reduced vocabulary: ``target_ids`` [Vd] are the target ids of draft ids 0..Vd-1."""
        if self.config.draft_vocab_size is None:
            raise RedraftError("set_draft_vocab needs a config with draft_vocab_size set.")
        target_ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if target_ids.numel() != self.config.draft_vocab_size:
            raise RedraftError(
                f"set_draft_vocab got {target_ids.numel()} ids for draft_vocab_size="
                f"{self.config.draft_vocab_size}."
            )
        if target_ids.unique().numel() != target_ids.numel() or target_ids.min() < 0 or \
                target_ids.max() >= self.config.vocab_size:
            raise RedraftError("set_draft_vocab needs distinct target ids in [0, vocab_size).")
        self.draft_to_target.copy_(target_ids.to(self.draft_to_target.device))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> target ids (identity without a reduced vocab)."""
        if self.config.draft_vocab_size is None:
            return draft_ids
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, ``-1`` where a token is outside the draft vocab."""
        if self.config.draft_vocab_size is None:
            return target_ids
        lut = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        lut[self.draft_to_target.to(target_ids.device)] = torch.arange(
            self.config.draft_vocab_size, device=target_ids.device)
        return torch.where(target_ids >= 0, lut[target_ids.clamp(min=0)], target_ids)

    # ---------------------------------------------------------------- the math

    def _next_state(self, state: torch.Tensor | None, e: torch.Tensor) -> torch.Tensor:
        """``s_i = f(U s_{i-1} + W e_i + b)`` (or ``s_{i-1} + e_i``); ``state=None`` means 0.
        ``state`` [..., S], ``e`` [..., E] -> [..., S]."""
        if not self.config.rnn:
            return e if state is None else state + e
        we = self.rnn_w(e)
        # U @ 0 + b = b; the module is called (not .bias read) so ZeRO-3 gathers its weights.
        return self.act(we + self.rnn_u(torch.zeros_like(we) if state is None else state))

    def head(self, state: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``[s, x]`` -> ResNet blocks -> output layer. ``state`` [..., S], ``context`` [..., H]
        (broadcast against each other) -> logits [..., Vd]."""
        if context.shape[:-1] != state.shape[:-1]:
            context = context.expand(*state.shape[:-1], context.shape[-1])
        h = torch.cat([state, context.to(state.dtype)], dim=-1)  # [..., S + H]
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h)

    def states(self, tokens: torch.Tensor) -> torch.Tensor:
        """RNN states of a chain: target ids ``[..., L]`` -> ``[..., L, S]`` (s_0 .. s_{L-1})."""
        e = self.embed(tokens)  # [..., L, E]
        if not self.config.rnn:
            return e.cumsum(dim=-2)
        we = self.rnn_w(e)  # [..., L, S]: one matmul for all steps; only U s is sequential
        out, s = [], None
        for i in range(tokens.shape[-1]):  # L <= num_steps (5): a loop over steps, not positions
            s = self.act(we[..., i, :] + self.rnn_u(torch.zeros_like(we[..., i, :]) if s is None else s))
            out.append(s)
        return torch.stack(out, dim=-2)

    def forward(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of a whole chain in one pass.

        Args:
            context: ``[..., H]`` the target's last hidden state at the last accepted token.
            tokens: ``[..., L]`` target ids; ``tokens[..., 0]`` is the last token the target
                produced, ``tokens[..., i > 0]`` are draft tokens.

        Returns:
            ``[..., L, Vd]`` logits; ``logits[..., i, :]`` predicts the token after ``tokens[..., i]``.
        """
        s = self.states(tokens)  # [..., L, S]
        return self.head(s, context.unsqueeze(-2))  # [..., L, Vd]

    def step(self, state: torch.Tensor | None, context: torch.Tensor,
             token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence step (for beam search).

        Args:
            state: ``[N, S]`` the previous state, or ``None`` for the first step (s_{-1} = 0).
            context: ``[N, H]`` the target's hidden state (constant along a chain).
            token: ``[N]`` target ids just appended to each chain.

        Returns:
            ``(new_state [N, S], logits [N, Vd])``; ``logits`` predicts the token after ``token``.
        """
        s = self._next_state(state, self.embed(token))
        return s, self.head(s, context)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------ loading


def _resolve(path) -> Path:
    """A local directory, or ``REPO_ID[@rev]`` through ``redraft.hub.resolve_artifact`` when the
    hub module exists."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        return p
    try:
        hub = importlib.import_module("redraft.hub")
    except ImportError:
        hub = None
    if hub is not None and hasattr(hub, "resolve_artifact"):
        return Path(hub.resolve_artifact(str(path)))
    raise ArtifactError(
        f"Drafter artifact {path} does not exist. Pass the directory redraft-train wrote "
        f"(it holds config.json and model.safetensors) or a hub id REPO_ID[@revision]."
    )


def load_drafter(path, target: Target, dtype: torch.dtype | str | None = None) -> ReDrafter:
    """Load a drafter artifact for ``target``: check its tokenizer fingerprint, attach the
    target's input embedding, move it to the target's device, eval mode.

    Args:
        path: artifact directory (or ``REPO_ID[@rev]`` once ``redraft.hub`` is installed).
        target: the loaded :class:`~redraft.models.target.Target`.
        dtype: weights dtype; default the target's dtype.

    Raises:
        ArtifactError: the directory is missing or not a ReDrafter artifact.
        FingerprintMismatchError: the drafter was trained for another tokenizer (names both).
    """
    p = _resolve(path)
    if not (p / "config.json").is_file():
        raise ArtifactError(f"{p} holds no config.json; it is not a drafter artifact written by redraft-train.")
    try:
        config = ReDrafterConfig.from_pretrained(str(p))
    except Exception as exc:  # wrong model_type, broken JSON
        raise ArtifactError(f"{p / 'config.json'} is not a ReDrafter config ({type(exc).__name__}: {exc}).") from exc
    if getattr(config, "model_type", None) != "redrafter":
        raise ArtifactError(f"{p / 'config.json'} has model_type {config.model_type!r}, expected 'redrafter'.")
    check_fingerprint(config.tokenizer_fingerprint, target, p)
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    try:
        drafter = ReDrafter.from_pretrained(str(p), dtype=dtype)
    except Exception as exc:
        raise ArtifactError(
            f"Could not load the drafter weights from {p} ({type(exc).__name__}: {exc}). The "
            f"directory should hold model.safetensors as written by redraft-train."
        ) from exc
    drafter.attach_target(target)
    return drafter.to(target.device).eval()

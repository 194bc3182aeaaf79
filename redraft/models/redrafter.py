"""The ReDrafter draft head (Zhang et al., Apple 2024), as a transformers model.

One small recurrent head on top of a frozen target LLM::

    e_i = E[tokens[..., i]]                    target's input embedding (shared, frozen, not saved)
    s_i = f(U s_{i-1} + W e_i + b)             f = SiLU by default;  s_{-1} = 0  (see below)
    h_i = [s_i, x]                             x = target's last hidden state (the LM head's input)
    h_i <- h_i + SiLU(Linear(h_i))             ``num_layers`` ResNet blocks
    logits_i = O h_i                           the head's own output layer, [Vd] draft vocabulary

``rnn=False`` is the paper's ablation: U = I, W = I, b = 0, f = identity, so ``s_i`` is the plain
running sum of the draft tokens' embeddings.

``features="multi"`` (EAGLE-3's fusion) replaces ``x`` by ``P [rms(h_a), rms(h_b), h_L]``: the
target's hidden states at a low, a middle and the last layer (``config.feature_layers``; the
lower two RMS-normalised without weights), concatenated ``[..., 3H]`` and projected to H by the
trained ``feature_proj`` P (initialised to pick ``h_L``: an untrained multi head is a last head).
Everything after ``x`` is unchanged. The decoder's verify forward then also returns those
layers' states (:attr:`redraft.infer.drafters.redrafter.drafter.ReDrafterDrafter.hidden_layers`).

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

The artifact and transformers' Auto classes
-------------------------------------------
``save_pretrained`` writes ``config.json`` (model_type ``redrafter``, with ``auto_map`` and the
sha256 of the weights), ``model.safetensors`` and ``redraft_head.py`` (two import lines: with it,
``AutoModel.from_pretrained(dir, trust_remote_code=True)`` works even before ``import redraft``).
Once redraft is imported, ``AutoConfig``/``AutoModel`` know the ``redrafter`` model type
(registered at the end of this module; :mod:`redraft.models.auto` registers it as soon as
transformers' Auto classes load after a bare ``import redraft``). Loading is strict
(:mod:`redraft.models.artifact`): missing or unexpected tensors, shapes that disagree with the
config, a changed file, non-finite weights and config values of the wrong type are errors that
name the key. :func:`load_drafter` also reads Apple's layout (:mod:`redraft.models.apple`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

from redraft.errors import ArtifactError, RedraftError
from redraft.models import artifact
from redraft.models.losses import IGNORE_INDEX, drafter_loss
from redraft.models.redrafter_config import (  # noqa: F401  (public names of this module)
    AUTO_MAP,
    AUTO_MODULE,
    AUTO_MODULE_SOURCE,
    MODEL_TYPE,
    ReDrafterConfig,
    describe,
    parse_config,
)
from redraft.models.target import Target
from redraft.utils import atomic_write_text

__all__ = [
    "ReDrafterConfig",
    "ReDrafter",
    "ReDrafterOutput",
    "check_artifact",
    "expected_shapes",
    "parse_config",
]


class ResBlock(nn.Module):
    """``h + act(Linear(h))``: one residual block of the head."""

    def __init__(self, width: int, activation: str):
        super().__init__()
        self.linear = nn.Linear(width, width, bias=True)
        self.act = ACT2FN[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.linear(h))


@dataclass
class ReDrafterOutput(ModelOutput):
    """What :meth:`ReDrafter.forward` returns with ``labels`` (or ``return_dict=True``).

    Attributes:
        loss: the training loss (:func:`redraft.models.losses.drafter_loss`), when labels were given.
        logits: ``[..., L, Vd]`` draft-vocabulary logits.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


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
        self.blocks = nn.ModuleList(
            [ResBlock(S + H, config.activation) for _ in range(config.num_layers)]
        )
        self.lm_head = nn.Linear(S + H, config.out_vocab_size, bias=False)  # O
        if config.features == "multi":
            # [k*H] -> [H]: the concatenated layers' hidden states back to the context width
            self.feature_proj = nn.Linear(config.feature_size, H, bias=False)
        if config.draft_vocab_size is not None:
            # [Vd] target id of each draft id; set by set_draft_vocab and saved in the checkpoint.
            self.register_buffer(
                "draft_to_target", torch.arange(config.draft_vocab_size), persistent=True
            )
        self._embedding: tuple[nn.Embedding, ...] = ()  # a tuple hides it from nn.Module
        self.post_init()
        if config.features == "multi":
            self._init_feature_proj()

    @torch.no_grad()
    def _init_feature_proj(self) -> None:
        """``feature_proj`` starts as "take the last layer": zeros on the lower layers' columns,
        the identity on the last layer's, so an untrained ``multi`` head is exactly a ``last``
        head and the lower layers' weights grow from there (their gradients are not zero)."""
        H = self.config.hidden_size
        w = self.feature_proj.weight  # [H, k*H]
        w.zero_()
        w[:, -H:] = torch.eye(H, dtype=w.dtype, device=w.device)

    # ---------------------------------------------------------------- target embedding, vocab

    def attach_embeddings(self, embedding: nn.Embedding) -> ReDrafter:
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

    def attach_target(self, target: Target) -> ReDrafter:
        """Attach ``target.input_embedding`` (a ``multi`` head: after checking that the target has
        the layers it reads). Returns self."""
        if self.config.features == "multi":
            from redraft.models.redrafter_config import target_num_layers

            L = target_num_layers(target)
            if L != self.config.target_num_layers:
                raise RedraftError(
                    f"This ReDrafter reads the hidden states of layers "
                    f"{list(self.config.hidden_layers)} of a {self.config.target_num_layers}-layer "
                    f"target, but target {target.model_id!r} has {L} decoder layers: it was "
                    f"trained for another model."
                )
        return self.attach_embeddings(target.input_embedding)

    @property
    def embedding(self) -> nn.Embedding:
        if not self._embedding:
            raise RedraftError(
                "This ReDrafter has no input embedding attached: call drafter.attach_target(target) "
                "(or load it with redraft.models.load_drafter(path, target))."
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
        if (
            target_ids.unique().numel() != target_ids.numel()
            or target_ids.min() < 0
            or target_ids.max() >= self.config.vocab_size
        ):
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
        lut = self._draft_lut(target_ids.device)
        return torch.where(target_ids >= 0, lut[target_ids.clamp(min=0)], target_ids)

    def _draft_lut(self, device) -> torch.Tensor:
        """``[V]`` draft id of each target id (-1 outside), built once per vocabulary and device."""
        key = (self.draft_to_target.data_ptr(), self.draft_to_target._version, str(device))
        if getattr(self, "_lut_key", None) != key:
            lut = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=device)
            lut[self.draft_to_target.to(device)] = torch.arange(
                self.config.draft_vocab_size, device=device
            )
            self._lut, self._lut_key = lut, key
        return self._lut

    # ---------------------------------------------------------------- the math

    def _next_state(self, state: torch.Tensor | None, e: torch.Tensor) -> torch.Tensor:
        """``s_i = f(U s_{i-1} + W e_i + b)`` (or ``s_{i-1} + e_i``); ``state=None`` means 0.
        ``state`` [..., S], ``e`` [..., E] -> [..., S]."""
        if not self.config.rnn:
            return e if state is None else state + e
        we = self.rnn_w(e)
        # U @ 0 + b = b; the module is called (not .bias read) so ZeRO-3 gathers its weights.
        return self.act(we + self.rnn_u(torch.zeros_like(we) if state is None else state))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[..., F]`` -> the context ``x`` ``[..., H]``: the identity for a
        ``last`` head (F = H); for ``multi`` (F = k*H, the layers of ``config.feature_layers`` in
        order) the lower layers' states are RMS-normalised without weights (the residual stream
        below the final norm grows with depth and spikes at attention-sink tokens; the last one
        is already normalised), then ``feature_proj``."""
        if self.config.features == "last":
            return features
        H = self.config.hidden_size
        if features.shape[-1] != self.config.feature_size:
            raise RedraftError(
                f"This multi-layer ReDrafter reads the target's hidden states of layers "
                f"{list(self.config.hidden_layers)} concatenated ({self.config.feature_size} "
                f"values per position) but got {features.shape[-1]}."
            )
        low = features[..., :-H].unflatten(-1, (-1, H))  # [..., k-1, H]
        low = nn.functional.rms_norm(low, (H,), eps=1e-6).flatten(-2)
        x = torch.cat([low, features[..., -H:]], dim=-1).to(self.feature_proj.weight.dtype)
        return self.feature_proj(x)  # [..., H]

    def head_features(self, state: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``[s, x]`` -> ResNet blocks: the output layer's input. ``state`` [..., S], ``context``
        [..., H] (broadcast against each other) -> [..., S + H]."""
        if context.shape[:-1] != state.shape[:-1]:
            context = context.expand(*state.shape[:-1], context.shape[-1])
        h = torch.cat([state, context.to(state.dtype)], dim=-1)  # [..., S + H]
        for block in self.blocks:
            h = block(h)
        return h

    def head(self, state: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``[s, x]`` -> ResNet blocks -> output layer: logits [..., Vd]."""
        return self.lm_head(self.head_features(state, context))

    def states(self, tokens: torch.Tensor) -> torch.Tensor:
        """RNN states of a chain: target ids ``[..., L]`` -> ``[..., L, S]`` (s_0 .. s_{L-1})."""
        e = self.embed(tokens)  # [..., L, E]
        if not self.config.rnn:
            return e.cumsum(dim=-2)
        we = self.rnn_w(e)  # [..., L, S]: one matmul for all steps; only U s is sequential
        out, s = [], None
        for i in range(tokens.shape[-1]):  # L <= num_steps (5): a loop over steps, not positions
            s = self.act(
                we[..., i, :] + self.rnn_u(torch.zeros_like(we[..., i, :]) if s is None else s)
            )
            out.append(s)
        return torch.stack(out, dim=-2)

    def forward(
        self,
        context: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        target_logprobs: torch.Tensor | None = None,
        ce_weight: float = 1.0,
        kd_weight: float = 0.0,
        return_dict: bool | None = None,
        return_features: bool = False,
    ):
        """Teacher-forced logits of a whole chain in one pass (and the training loss with ``labels``).

        Args:
            context: ``[..., F]`` the target's features at the last accepted token: its last
                hidden state (F = H), or for a ``multi`` head the hidden states of
                ``config.feature_layers`` concatenated (:meth:`project` maps them to H).
            tokens: ``[..., L]`` target ids; ``tokens[..., 0]`` is the last token the target
                produced, ``tokens[..., i > 0]`` are draft tokens.
            labels: ``[..., L]`` target ids that ``logits[..., i, :]`` should predict (not shifted
                here: the last step's label is not among the inputs); ``-100`` takes no part.
                Labels outside a reduced draft vocabulary count in the mean but cannot be learned,
                exactly as in training.
            target_logprobs: ``[..., L, Vd]`` the target's log-probabilities, for the KD term.
            ce_weight, kd_weight: weights of cross-entropy and KL(target || drafter) (the trainer's
                ``--loss ce`` / ``kd`` / ``ce+kd``).
            return_dict: return a :class:`ReDrafterOutput`; default: only when ``labels`` is given
                (the trainer and the decoder take the bare logits tensor).
            return_features: return the output layer's input ``[..., L, S + H]`` instead of the
                logits (the trainer's fused loss applies the output layer chunk by chunk).

        Returns:
            ``[..., L, Vd]`` logits (``logits[..., i, :]`` predicts the token after
            ``tokens[..., i]``), or a :class:`ReDrafterOutput` with ``loss`` and ``logits``.
        """
        context = self.project(context)  # [..., F] -> [..., H] (identity for "last")
        s = self.states(tokens)  # [..., L, S]
        if return_features:
            return self.head_features(s, context.unsqueeze(-2))  # [..., L, S + H]
        logits = self.head(s, context.unsqueeze(-2))  # [..., L, Vd]
        if return_dict is None:
            return_dict = labels is not None
        if not return_dict:
            return logits
        loss = None
        if labels is not None:
            if labels.shape != tokens.shape:
                raise RedraftError(
                    f"labels have shape {list(labels.shape)}, tokens {list(tokens.shape)}: "
                    f"they must be equal (labels[..., i] is what logits[..., i] predicts)."
                )
            L, Vd = logits.shape[-2:]
            lab = labels.reshape(-1, L).to(logits.device)  # [P, L]
            tlp = None if target_logprobs is None else target_logprobs.reshape(-1, L, Vd)
            loss, _ = drafter_loss(
                logits.reshape(-1, L, Vd),
                self.to_draft_ids(lab),
                lab != IGNORE_INDEX,
                tlp,
                ce_weight=ce_weight,
                kd_weight=kd_weight,
            )
        return ReDrafterOutput(loss=loss, logits=logits)

    def step(
        self, state: torch.Tensor | None, context: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence step (for beam search).

        Args:
            state: ``[N, S]`` the previous state, or ``None`` for the first step (s_{-1} = 0).
            context: ``[N, H]`` the context ``x`` (constant along a chain): ``project(features)``,
                which beam search computes once per chain; ``[N, F]`` features of a ``multi``
                head are projected here (every call).
            token: ``[N]`` target ids just appended to each chain.

        Returns:
            ``(new_state [N, S], logits [N, Vd])``; ``logits`` predicts the token after ``token``.
        """
        if context.shape[-1] != self.config.hidden_size:
            context = self.project(context)
        s = self._next_state(state, self.embed(token))
        return s, self.head(s, context)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # ---------------------------------------------------------------- artifacts

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """A no-op, as :meth:`ReDrafterConfig.register_for_auto_class`."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained`` (``config.json`` + ``model.safetensors``), then
        ``redraft_head.py`` (for ``auto_map``) and the weights' sha256 recorded in ``config.json``.

        ``push_to_hub=True`` is refused (the upload would start before the sha256 is recorded):
        call :meth:`push_to_hub` or ``redraft-push``.
        """
        if kwargs.get("push_to_hub"):
            raise RedraftError(
                "save_pretrained(push_to_hub=True) is not supported for a ReDrafter head: save it, "
                "then call head.push_to_hub(repo_id) or `redraft-push DIR REPO_ID`."
            )
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        directory = Path(save_directory)
        atomic_write_text(directory / f"{AUTO_MODULE}.py", AUTO_MODULE_SOURCE)
        artifact.record_sha256(directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, verify: bool = True, **kwargs):
        """transformers' ``from_pretrained``, strict: a local directory is checked first (tensor names
        and shapes against ``config.json``, the recorded sha256 when ``verify``); after loading, any
        missing, unexpected or mismatched tensor and any non-finite weight is an ArtifactError.

        Also what ``AutoModel.from_pretrained`` calls for a ``redrafter`` config.
        """
        path = Path(os.fspath(pretrained_model_name_or_path)).expanduser()
        if path.is_dir() and not kwargs.get("subfolder"):
            check_artifact(path, verify=verify)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
        )
        bad = {
            k: sorted(map(str, v))
            for k, v in info.items()
            if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
        }
        if bad:
            raise ArtifactError(
                f"{pretrained_model_name_or_path} does not match its config: "
                + "; ".join(f"{k.replace('_', ' ')} {', '.join(v)}" for k, v in bad.items())
            )
        artifact.check_finite(model.state_dict(), pretrained_model_name_or_path)
        return (model, info) if want_info else model


def _register_auto_classes() -> None:
    """``AutoConfig``/``AutoModel`` resolve model_type ``redrafter`` to these classes."""
    AutoConfig.register(MODEL_TYPE, ReDrafterConfig, exist_ok=True)
    AutoModel.register(ReDrafterConfig, ReDrafter, exist_ok=True)


_register_auto_classes()


# ------------------------------------------------------------------ checking an artifact's layout


def expected_shapes(config: ReDrafterConfig) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` that a head of ``config`` saves (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = ReDrafter(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_artifact(directory: Path, verify: bool = True) -> ReDrafterConfig:
    """Check a redraft-layout drafter directory without loading its weights: config types, the
    tensor names and shapes in the safetensors headers, and (``verify``) the recorded sha256.
    Returns the parsed config; raises ArtifactError naming the key at fault."""
    directory = Path(directory)
    raw = artifact.read_config_json(directory)
    config = parse_config(raw, directory)
    files = artifact.weight_files(directory)
    artifact.check_tensor_layout(
        artifact.tensor_shapes(files),
        expected_shapes(config),
        files[0] if len(files) == 1 else directory,
        describe(config),
    )
    if verify:
        artifact.verify_sha256(directory, raw, files)
    return config

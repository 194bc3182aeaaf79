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

import importlib
import numbers
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

from redraft.errors import ArtifactError, ConfigError, RedraftError
from redraft.models import artifact
from redraft.models.losses import IGNORE_INDEX, drafter_loss
from redraft.models.target import Target, check_fingerprint
from redraft.utils import atomic_write_text, resolve_dtype

__all__ = ["ReDrafterConfig", "ReDrafter", "ReDrafterOutput", "load_drafter", "read_drafter"]

MODEL_TYPE = "redrafter"
# transformers' trust_remote_code loads this file from a saved head; it re-exports redraft's own
# classes (so the objects are the same as after ``import redraft``), instead of the copy of this
# whole module that transformers' register_for_auto_class would write into every head.
AUTO_MODULE = "redraft_head"
AUTO_MAP = {"AutoConfig": f"{AUTO_MODULE}.ReDrafterConfig", "AutoModel": f"{AUTO_MODULE}.ReDrafter"}
AUTO_MODULE_SOURCE = (
    '"""Written by redraft: lets transformers load this ReDrafter head with trust_remote_code=True\n'
    'before redraft is imported. The classes are redraft\'s own: `pip install redraft` is needed."""\n'
    "from redraft.models.redrafter import ReDrafter, ReDrafterConfig  # noqa: F401\n"
)


def _int(name: str, value, minimum: int, optional: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (``None`` allowed when ``optional``); anything else --
    a bool, a float, a string such as ``"576"`` -- is a ConfigError naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"ReDrafterConfig {name}={value!r} ({type(value).__name__}) must be an integer "
                          f">= {minimum}{' or null' if optional else ''}.", param=name)
    return int(value)


def _str(name: str, value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"ReDrafterConfig {name}={value!r} ({type(value).__name__}) must be a string or null.",
                          param=name)
    return value


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
            this head belongs to (docs/hub.md); ``load_drafter`` checks the fingerprint.
        initializer_range: std of the normal init of every linear layer.
    """

    model_type = MODEL_TYPE

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
        # Recorded by save_pretrained for the file it just wrote and checked by the loader; never
        # kept on the object, where it would go stale as soon as the weights change.
        kwargs.pop(artifact.SHA_KEY, None)
        kwargs.pop("auto_map", None)  # always ours (AUTO_MAP), set below
        self.hidden_size = _int("hidden_size", hidden_size, 1)
        self.embedding_dim = _int("embedding_dim", embedding_dim, 1, optional=True) or self.hidden_size
        self.vocab_size = _int("vocab_size", vocab_size, 1)
        # 0 was written by old configs for "full vocabulary"; None is the spelling now.
        self.draft_vocab_size = _int("draft_vocab_size", draft_vocab_size, 0, optional=True) or None
        self.num_layers = _int("num_layers", num_layers, 0)
        if not isinstance(rnn, bool):
            raise ConfigError(f"ReDrafterConfig rnn={rnn!r} ({type(rnn).__name__}) must be true or false.", param="rnn")
        self.rnn = rnn
        if not isinstance(activation, str) or activation not in ACT2FN:
            raise ConfigError(f"ReDrafterConfig activation={activation!r} is not one of {sorted(ACT2FN)}.",
                              param="activation")
        self.activation = activation
        self.num_steps = _int("num_steps", num_steps, 1)
        self.target_model = _str("target_model", target_model)
        self.tokenizer_fingerprint = _str("tokenizer_fingerprint", tokenizer_fingerprint)
        self.target_vocab_size = _int("target_vocab_size", target_vocab_size, 1, optional=True) or self.vocab_size
        self.target_hidden_size = (_int("target_hidden_size", target_hidden_size, 1, optional=True)
                                   or self.hidden_size)
        if isinstance(initializer_range, bool) or not isinstance(initializer_range, numbers.Real) \
                or not initializer_range >= 0:
            raise ConfigError(f"ReDrafterConfig initializer_range={initializer_range!r} must be a number >= 0.",
                              param="initializer_range")
        self.initializer_range = float(initializer_range)
        super().__init__(**kwargs)
        self.auto_map = dict(AUTO_MAP)
        if self.draft_vocab_size is not None and not self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"ReDrafterConfig draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size="
                f"{self.vocab_size}] (or null for the full vocabulary).", param="draft_vocab_size")

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """A no-op: redraft registers its Auto classes itself and saves ``auto_map`` pointing at
        ``redraft_head.py`` (transformers would copy this whole module into every saved head)."""

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

    def forward(self, context: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor | None = None, *,
                target_logprobs: torch.Tensor | None = None, ce_weight: float = 1.0, kd_weight: float = 0.0,
                return_dict: bool | None = None):
        """Teacher-forced logits of a whole chain in one pass (and the training loss with ``labels``).

        Args:
            context: ``[..., H]`` the target's last hidden state at the last accepted token.
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

        Returns:
            ``[..., L, Vd]`` logits (``logits[..., i, :]`` predicts the token after
            ``tokens[..., i]``), or a :class:`ReDrafterOutput` with ``loss`` and ``logits``.
        """
        s = self.states(tokens)  # [..., L, S]
        logits = self.head(s, context.unsqueeze(-2))  # [..., L, Vd]
        if return_dict is None:
            return_dict = labels is not None
        if not return_dict:
            return logits
        loss = None
        if labels is not None:
            if labels.shape != tokens.shape:
                raise RedraftError(f"labels have shape {list(labels.shape)}, tokens {list(tokens.shape)}: "
                                   f"they must be equal (labels[..., i] is what logits[..., i] predicts).")
            L, Vd = logits.shape[-2:]
            lab = labels.reshape(-1, L).to(logits.device)  # [P, L]
            tlp = None if target_logprobs is None else target_logprobs.reshape(-1, L, Vd)
            loss, _ = drafter_loss(logits.reshape(-1, L, Vd), self.to_draft_ids(lab), lab != IGNORE_INDEX,
                                   tlp, ce_weight=ce_weight, kd_weight=kd_weight)
        return ReDrafterOutput(loss=loss, logits=logits)

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
            raise RedraftError("save_pretrained(push_to_hub=True) is not supported for a ReDrafter head: save it, "
                               "then call head.push_to_hub(repo_id) or `redraft-push DIR REPO_ID`.")
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
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        bad = {k: sorted(map(str, v)) for k, v in info.items()
               if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise ArtifactError(f"{pretrained_model_name_or_path} does not match its config: "
                                + "; ".join(f"{k.replace('_', ' ')} {', '.join(v)}" for k, v in bad.items()))
        artifact.check_finite(model.state_dict(), pretrained_model_name_or_path)
        return (model, info) if want_info else model


# ------------------------------------------------------------------------------------ loading


def _resolve(path) -> Path:
    """A local directory, or ``REPO_ID[@rev]`` through ``redraft.hub_resolve.resolve_artifact`` when the
    hub module exists."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        return p
    try:
        hub = importlib.import_module("redraft.hub_resolve")
    except ImportError:
        hub = None
    if hub is not None and hasattr(hub, "resolve_artifact"):
        return Path(hub.resolve_artifact(str(path)))
    raise ArtifactError(
        f"Drafter artifact {path} does not exist. Pass the directory redraft-train wrote "
        f"(it holds config.json and model.safetensors) or a hub id REPO_ID[@revision]."
    )


def expected_shapes(config: ReDrafterConfig) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` that a head of ``config`` saves (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = ReDrafter(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def describe(config: ReDrafterConfig) -> str:
    """The config values that decide the tensor shapes, for error messages."""
    return (f"hidden_size={config.hidden_size}, embedding_dim={config.embedding_dim}, vocab_size="
            f"{config.vocab_size}, draft_vocab_size={config.draft_vocab_size}, num_layers={config.num_layers}, "
            f"rnn={config.rnn}")


def parse_config(raw: dict, where: Path) -> ReDrafterConfig:
    """A :class:`ReDrafterConfig` from the dict of ``where/config.json``; a value of the wrong type
    or range is an ArtifactError naming the file and the key."""
    if raw.get("model_type") != MODEL_TYPE:
        raise ArtifactError(f"{where / artifact.CONFIG_NAME} has model_type {raw.get('model_type')!r}, expected "
                            f"{MODEL_TYPE!r} (or Apple's 'recurrent_drafting_drafter', which load_drafter reads).")
    try:
        return ReDrafterConfig.from_dict(dict(raw))
    except RedraftError as exc:
        raise ArtifactError(f"{where / artifact.CONFIG_NAME}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{where / artifact.CONFIG_NAME} is not a ReDrafter config ({exc}).") from exc


def check_artifact(directory: Path, verify: bool = True) -> ReDrafterConfig:
    """Check a redraft-layout drafter directory without loading its weights: config types, the
    tensor names and shapes in the safetensors headers, and (``verify``) the recorded sha256.
    Returns the parsed config; raises ArtifactError naming the key at fault."""
    directory = Path(directory)
    raw = artifact.read_config_json(directory)
    config = parse_config(raw, directory)
    files = artifact.weight_files(directory)
    artifact.check_tensor_layout(artifact.tensor_shapes(files), expected_shapes(config),
                                 files[0] if len(files) == 1 else directory, describe(config))
    if verify:
        artifact.verify_sha256(directory, raw, files)
    return config


def read_drafter(path, dtype: torch.dtype | str | None = None, *, verify: bool = True) -> ReDrafter:
    """Load a drafter artifact (redraft's layout or Apple's) without a target: checked exactly
    (:mod:`redraft.models.artifact`), no embedding attached, on the CPU, eval mode.

    Args:
        path: artifact directory or hub ``REPO_ID[@rev]``.
        dtype: weights dtype; ``None`` keeps the stored one.
        verify: check the weights against the sha256 recorded in ``config.json``.
    """
    p = _resolve(path)
    raw = artifact.read_config_json(p)
    dtype = None if dtype is None else resolve_dtype(dtype)
    if raw.get("model_type") == _apple().APPLE_MODEL_TYPE:
        return _apple().read_apple_drafter(p, ReDrafter, raw, dtype=dtype, verify=verify).eval()
    parse_config(raw, p)  # the model_type and value checks first, with the file's name
    try:
        model = ReDrafter.from_pretrained(str(p), dtype=dtype or "auto", verify=verify)
    except RedraftError:
        raise
    except Exception as exc:
        raise ArtifactError(f"Could not load the drafter weights from {p} ({type(exc).__name__}: {exc}). The "
                            f"directory should hold model.safetensors as written by redraft-train.") from exc
    return model.eval()


def _apple():
    from redraft.models import apple  # on use: only Apple-layout heads need it

    return apple


def load_drafter(path, target: Target, dtype: torch.dtype | str | None = None, *, verify: bool = True) -> ReDrafter:
    """Load a drafter artifact for ``target``: check it exactly, check its tokenizer fingerprint,
    attach the target's input embedding, move it to the target's device, eval mode.

    Reads redraft's layout (model_type ``redrafter``) and Apple's ml-recurrent-drafter layout
    (model_type ``recurrent_drafting_drafter``, as ``redraft-export`` writes it or Apple's
    trainer does). A head in Apple's layout that records no tokenizer fingerprint (trained with
    Apple's code) is checked against the target's sizes only, with a warning.

    Args:
        path: artifact directory (or ``REPO_ID[@rev]`` through ``redraft.hub``).
        target: the loaded :class:`~redraft.models.target.Target`.
        dtype: weights dtype; default the target's dtype.
        verify: check the weights against the sha256 recorded at write time.

    Raises:
        ArtifactError: the directory is missing, not a drafter, or its weights do not match its
            config exactly (names the key), or were changed since they were written.
        FingerprintMismatchError: the drafter was trained for another tokenizer (names both).
    """
    p = _resolve(path)
    raw = artifact.read_config_json(p)
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    if raw.get("model_type") == _apple().APPLE_MODEL_TYPE:
        config = _apple().config_from_apple(raw, p, ReDrafterConfig)
    else:
        config = parse_config(raw, p)
    if config.tokenizer_fingerprint is None and raw.get("model_type") != MODEL_TYPE:
        _check_sizes(config, target, p)
        warnings.warn(f"{p} records no tokenizer fingerprint (a head trained outside redraft); only its sizes "
                      f"were checked against {target.model_id!r}. Make sure it was trained for this target.",
                      UserWarning, stacklevel=2)
    else:
        check_fingerprint(config.tokenizer_fingerprint, target, p)
    drafter = read_drafter(p, dtype=dtype, verify=verify)
    drafter.attach_target(target)
    return drafter.to(target.device).eval()


def _check_sizes(config: ReDrafterConfig, target: Target, where: Path) -> None:
    E = target.input_embedding.weight
    want = {"vocab_size": int(E.shape[0]), "hidden_size": int(target.hidden_size), "embedding_dim": int(E.shape[1])}
    for key, value in want.items():
        if getattr(config, key) != value:
            raise ArtifactError(f"{where / artifact.CONFIG_NAME} has {key}={getattr(config, key)}, but target "
                                f"{target.model_id!r} has {value}: the head was trained for another model.")


def _register_auto_classes() -> None:
    """``AutoConfig``/``AutoModel`` resolve model_type ``redrafter`` to these classes."""
    AutoConfig.register(MODEL_TYPE, ReDrafterConfig, exist_ok=True)
    AutoModel.register(ReDrafterConfig, ReDrafter, exist_ok=True)


_register_auto_classes()

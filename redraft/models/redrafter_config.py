"""The configuration of a ReDrafter head: :class:`ReDrafterConfig` and its value checks.

Every value is type- and range-checked when the config is made (from code, from a recipe or
from a saved ``config.json``, read by :func:`parse_config`); a wrong one is a ConfigError naming
the key (an ArtifactError naming the file, for a saved one). The head itself is
:mod:`redraft.models.redrafter`; the artifact I/O :mod:`redraft.models.drafter_io`.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from redraft.errors import ArtifactError, ConfigError, RedraftError
from redraft.models import artifact
from redraft.models.target import Target

__all__ = [
    "ReDrafterConfig",
    "MODEL_TYPE",
    "AUTO_MODULE",
    "AUTO_MAP",
    "AUTO_MODULE_SOURCE",
    "FEATURES",
    "default_feature_layers",
    "describe",
    "parse_config",
    "target_num_layers",
]

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

# What the head reads of the target: "last" = its last hidden state (the paper's ReDrafter),
# "multi" = a low, a middle and the last layer's hidden states, concatenated (EAGLE-3's fusion).
FEATURES = ("last", "multi")


def target_num_layers(target: Target) -> int:
    """Decoder layers L of ``target`` (hidden-state index L is the LM head's input)."""
    return int(target.model.config.num_hidden_layers)


def default_feature_layers(num_layers: int) -> list[int]:
    """A ``multi`` head's layers for an ``num_layers``-layer target: ~L/4, ~L/2 and L (the last,
    the LM head's input), e.g. ``[7, 15, 30]`` for SmolLM2-135M's 30 layers; duplicates of a
    shallow target merge (``[1, 2]`` for 2 layers)."""
    L = num_layers
    return sorted({max(1, L // 4), max(1, L // 2), L})


def _int(name: str, value, minimum: int, optional: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (``None`` allowed when ``optional``); anything else --
    a bool, a float, a string such as ``"576"`` -- is a ConfigError naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(
            f"ReDrafterConfig {name}={value!r} ({type(value).__name__}) must be an integer "
            f">= {minimum}{' or null' if optional else ''}.",
            param=name,
        )
    return int(value)


def _str(name: str, value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(
            f"ReDrafterConfig {name}={value!r} ({type(value).__name__}) must be a string or null.",
            param=name,
        )
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
        features: ``"last"`` (default; what every head before it was): the context ``x`` is the
            target's last hidden state. ``"multi"``: the hidden states of ``feature_layers``
            concatenated (``[..., len(layers) * H]``), projected back to H by the trained
            ``feature_proj`` (EAGLE-3's low/middle/high fusion).
        feature_layers: ``multi`` only: ascending indices into the target's hidden states
            (``i`` = the output of decoder layer ``i``, 1-based); the last must be
            ``target_num_layers`` (the LM head's input, after the final norm, which decoding
            computes anyway). Default :func:`default_feature_layers`.
        target_num_layers: the target's decoder layers L (recorded for ``multi`` heads, so the
            layer indices can be checked without the target).
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
        features: str = "last",
        feature_layers: list[int] | None = None,
        target_num_layers: int | None = None,
        **kwargs,
    ):
        kwargs.setdefault("tie_word_embeddings", False)  # the head owns its output layer
        # Recorded by save_pretrained for the file it just wrote and checked by the loader; never
        # kept on the object, where it would go stale as soon as the weights change.
        kwargs.pop(artifact.SHA_KEY, None)
        kwargs.pop("auto_map", None)  # always ours (AUTO_MAP), set below
        self.hidden_size = _int("hidden_size", hidden_size, 1)
        self.embedding_dim = (
            _int("embedding_dim", embedding_dim, 1, optional=True) or self.hidden_size
        )
        self.vocab_size = _int("vocab_size", vocab_size, 1)
        # 0 was written by old configs for "full vocabulary"; None is the spelling now.
        self.draft_vocab_size = _int("draft_vocab_size", draft_vocab_size, 0, optional=True) or None
        self.num_layers = _int("num_layers", num_layers, 0)
        if not isinstance(rnn, bool):
            raise ConfigError(
                f"ReDrafterConfig rnn={rnn!r} ({type(rnn).__name__}) must be true or false.",
                param="rnn",
            )
        self.rnn = rnn
        if not isinstance(activation, str) or activation not in ACT2FN:
            raise ConfigError(
                f"ReDrafterConfig activation={activation!r} is not one of {sorted(ACT2FN)}.",
                param="activation",
            )
        self.activation = activation
        self.num_steps = _int("num_steps", num_steps, 1)
        self.target_model = _str("target_model", target_model)
        self.tokenizer_fingerprint = _str("tokenizer_fingerprint", tokenizer_fingerprint)
        self.target_vocab_size = (
            _int("target_vocab_size", target_vocab_size, 1, optional=True) or self.vocab_size
        )
        self.target_hidden_size = (
            _int("target_hidden_size", target_hidden_size, 1, optional=True) or self.hidden_size
        )
        if (
            isinstance(initializer_range, bool)
            or not isinstance(initializer_range, numbers.Real)
            or not initializer_range >= 0
        ):
            raise ConfigError(
                f"ReDrafterConfig initializer_range={initializer_range!r} must be a number >= 0.",
                param="initializer_range",
            )
        self.initializer_range = float(initializer_range)
        self.target_num_layers = _int("target_num_layers", target_num_layers, 1, optional=True)
        self.features, self.feature_layers = _features(
            features, feature_layers, self.target_num_layers
        )
        super().__init__(**kwargs)
        self.auto_map = dict(AUTO_MAP)
        if self.draft_vocab_size is not None and not self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"ReDrafterConfig draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size="
                f"{self.vocab_size}] (or null for the full vocabulary).",
                param="draft_vocab_size",
            )

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """A no-op: redraft registers its Auto classes itself and saves ``auto_map`` pointing at
        ``redraft_head.py`` (transformers would copy this whole module into every saved head)."""

    @property
    def state_size(self) -> int:
        """Width S of the RNN state (= E: the ablation adds embeddings into it)."""
        return self.embedding_dim

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target hidden-state layers the head reads, in order (``()``: the last one only)."""
        return tuple(self.feature_layers or ())

    @property
    def feature_size(self) -> int:
        """Width F of the context the head takes: H (``last``) or ``len(feature_layers) * H``."""
        return self.hidden_size * max(1, len(self.hidden_layers))

    @property
    def out_vocab_size(self) -> int:
        """Vd: rows of the output layer."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def for_target(cls, target: Target, **kwargs) -> ReDrafterConfig:
        """A config sized for ``target`` that records its id, sizes and tokenizer fingerprint."""
        meta = target.artifact_metadata()
        if kwargs.get("features", "last") == "multi":
            L = target_num_layers(target)
            if kwargs.get("target_num_layers", L) != L:
                raise ConfigError(
                    f"target_num_layers={kwargs['target_num_layers']} but target "
                    f"{meta.get('target_model')!r} has {L} decoder layers.",
                    param="target_num_layers",
                )
            kwargs["target_num_layers"] = L
            if kwargs.get("feature_layers") is None:
                kwargs["feature_layers"] = default_feature_layers(L)
        return cls(
            hidden_size=target.hidden_size,
            embedding_dim=int(target.input_embedding.weight.shape[1]),
            vocab_size=int(target.input_embedding.weight.shape[0]),
            **meta,
            **kwargs,
        )


def _features(features, layers, num_layers: int | None) -> tuple[str, list[int] | None]:
    """``(features, feature_layers)`` checked; a ConfigError names the key, the value and what
    is valid."""
    if features not in FEATURES:
        raise ConfigError(
            f"ReDrafterConfig features={features!r} must be one of {', '.join(FEATURES)}.",
            param="features",
        )
    if features == "last":
        if layers is not None:
            raise ConfigError(
                f"ReDrafterConfig feature_layers={layers!r} needs features='multi' (a 'last' head "
                f"reads the last hidden state only); drop it or set features: multi.",
                param="feature_layers",
            )
        return features, None
    if num_layers is None:
        raise ConfigError(
            "ReDrafterConfig features='multi' needs target_num_layers (the target's decoder "
            "layers; ReDrafterConfig.for_target fills it).",
            param="target_num_layers",
        )
    L = num_layers
    if layers is None:
        layers = default_feature_layers(L)
    if (
        not isinstance(layers, (list, tuple))
        or len(layers) < 2
        or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in layers)
        or any(not 1 <= i <= L for i in layers)
        or list(layers) != sorted(set(layers))
        or layers[-1] != L
    ):
        raise ConfigError(
            f"ReDrafterConfig feature_layers={layers!r} is invalid for a target of "
            f"target_num_layers={L}: give at least 2 ascending, distinct layer indices in "
            f"[1, {L}] ending with {L} (the last layer, the LM head's input), e.g. "
            f"{default_feature_layers(L) if L > 1 else [L]}.",
            param="feature_layers",
        )
    return features, [int(i) for i in layers]


# ------------------------------------------------------------------ a saved config, checked


def describe(config: ReDrafterConfig) -> str:
    """The config values that decide the tensor shapes, for error messages."""
    return (
        f"hidden_size={config.hidden_size}, embedding_dim={config.embedding_dim}, vocab_size="
        f"{config.vocab_size}, draft_vocab_size={config.draft_vocab_size}, num_layers={config.num_layers}, "
        f"rnn={config.rnn}, features={config.features}, feature_layers={config.feature_layers}"
    )


def parse_config(raw: dict, where: Path) -> ReDrafterConfig:
    """A :class:`ReDrafterConfig` from the dict of ``where/config.json``; a value of the wrong type
    or range is an ArtifactError naming the file and the key."""
    if raw.get("model_type") != MODEL_TYPE:
        raise ArtifactError(
            f"{where / artifact.CONFIG_NAME} has model_type {raw.get('model_type')!r}, expected "
            f"{MODEL_TYPE!r} (or Apple's 'recurrent_drafting_drafter', which load_drafter reads)."
        )
    try:
        return ReDrafterConfig.from_dict(dict(raw))
    except RedraftError as exc:
        raise ArtifactError(f"{where / artifact.CONFIG_NAME}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ArtifactError(
            f"{where / artifact.CONFIG_NAME} is not a ReDrafter config ({exc})."
        ) from exc

"""Apple's ml-recurrent-drafter head layout (which TensorRT-LLM's ReDrafter converter reads) and
redraft's, both ways, exactly.

What Apple's code computes (``recurrent_drafting/modeling_drafter.py``, ``Drafter``; its trainer
``train/model.py`` and the MLX port compute the same)::

    s_0 = 0
    s_i = silu(rnn_w(e_i) + rnn_u(s_{i-1}))        rnn_u has the bias b; rnn=False: s_i = s_{i-1} + e_i
    h_i = cat([x, s_i])                            x = the target's hidden state: CONTEXT FIRST
    logits_i = lm_head(h_i)                        lm_head = Sequential(L x ResBlock, Linear(exit_dim, V, bias=False))
    ResBlock(h) = h + silu(linear(h))              exit_dim = 2 * hidden_size (else an input_proj precedes lm_head)

redraft's head (:mod:`redraft.models.redrafter`) is the same function with the halves of ``h``
the other way round, ``h = [s, x]`` (state first). With ``S = H`` (state width = hidden size),
let ``perm`` be the index that swaps the halves, ``h_apple = h[perm]``. Then, exactly::

    rnn_u.weight, rnn_u.bias, rnn_w.weight      = U, b, W                  (same meaning, copied)
    lm_head.{i}.linear.weight                   = blocks.{i}.linear.weight[perm][:, perm]   (P W Pᵀ)
    lm_head.{i}.linear.bias                     = blocks.{i}.linear.bias[perm]               (P b)
    lm_head.{L}.weight                          = lm_head.weight[:, perm]                    (O Pᵀ)

since ``P (h + silu(W h + b)) = P h + silu(P W Pᵀ P h + P b)`` and ``O h = O Pᵀ P h``. The
permutation is pure indexing, so redraft -> Apple -> redraft gives back the same tensors bit for
bit. What the layout cannot express is refused (:func:`check_exportable`): a reduced draft
vocabulary (the output layer has no bias, so missing rows cannot be made impossible), an
activation other than SiLU, and ``embedding_dim != hidden_size`` (Apple's ``rnn_u``/``rnn_w``
are ``hidden_size x hidden_size``).

Apple's beam search additionally keeps only the top 50 logits of each step before its
``log_softmax`` (``warp_logits``). That is not only a change of scores: a token outside a step's
top 50 can never be drafted there, so Apple's search can keep different beams than redraft's
(which searches the full distribution) from the same head; the head's weights and its
per-step distribution are the same. ``config.json`` also carries a ``redraft`` entry (the
target's id, tokenizer and weights fingerprints, ``num_steps``...) that Apple's
``DrafterConfig`` and TensorRT-LLM ignore and that makes the round trip exact, and
``weights_sha256``.

Apple's own PyTorch loader (``recurrent_drafting``) runs only under transformers 4.x: its
``Drafter`` never calls ``post_init()``, which transformers 5 requires of a ``PreTrainedModel``.
redraft reads the layout with its own code (:func:`read_apple_drafter`), under transformers 5.

This module imports the head's classes only for type checking: the head's loader
(:mod:`redraft.models.redrafter`) imports this module to read the layout, so the two functions
that build a head, :func:`config_from_apple` and :func:`read_apple_drafter`, are given the class
to build (no import cycle).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from redraft.errors import ArtifactError, ConfigError
from redraft.models import artifact

if TYPE_CHECKING:  # the head's module imports this one (see the module doc)
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

APPLE_MODEL_TYPE = "recurrent_drafting_drafter"
REDRAFT_KEY = "redraft"  # our own entry in Apple's config.json (ignored by Apple and TensorRT-LLM)
# Apple's DrafterConfig field; neither Apple's nor TensorRT-LLM's code reads it. 1: the head
# looks back at one hidden state (the last accepted token's).
NUM_LOOKBACK_TOKENS = 1
RNN_KEYS = ("rnn_u.weight", "rnn_u.bias", "rnn_w.weight")
# ReDrafterConfig fields that Apple's config has no place for, kept under REDRAFT_KEY.
_KEPT = (
    "num_steps",
    "activation",
    "target_model",
    "tokenizer_fingerprint",
    "target_vocab_size",
    "target_hidden_size",
    "initializer_range",
)
# Kept too when the config has it: the trainer records the target's weights fingerprint
# (redraft.train.fingerprint), a config built by hand has none.
_KEPT_IF_SET = ("target_weights_fingerprint",)


def swap_halves(first: int, second: int) -> torch.Tensor:
    """``perm`` [first + second] with ``v[perm] == cat([v[first:], v[:first]])``: the index that
    turns ``[a (first), b (second)]`` into ``[b, a]``."""
    return torch.cat([torch.arange(first, first + second), torch.arange(0, first)])


def check_exportable(config: ReDrafterConfig) -> None:
    """ConfigError, saying what to change, when Apple's layout cannot express the head."""
    if config.features != "last":
        raise ConfigError(
            f"this head reads the target's layers {list(config.hidden_layers)} (features: "
            f"{config.features}): a multi-layer head has no Apple or TensorRT-LLM equivalent (their "
            f"drafter reads the last hidden state only). Train with --head-features last to export.",
            param="features",
        )
    if config.draft_vocab_size is not None:
        raise ConfigError(
            f"this head has a reduced draft vocabulary (draft_vocab_size={config.draft_vocab_size} of "
            f"{config.vocab_size}); Apple's and TensorRT-LLM's output layer covers the full target vocabulary "
            f"and has no bias, so the missing tokens cannot be made impossible. Train with the full "
            f"vocabulary (draft_vocab_size: null, e.g. recipe llama3-8b-full-vocab-8xh100) to export.",
            param="draft_vocab_size",
        )
    if config.activation != "silu":
        raise ConfigError(
            f"this head uses activation {config.activation!r}; Apple's and TensorRT-LLM's recurrence and "
            f"residual blocks use SiLU. Train with --activation silu to export.",
            param="activation",
        )
    if config.embedding_dim != config.hidden_size:
        raise ConfigError(
            f"this head's embedding_dim ({config.embedding_dim}) differs from hidden_size "
            f"({config.hidden_size}); Apple's rnn_u/rnn_w are hidden_size x hidden_size. Only targets whose "
            f"input embedding is as wide as their hidden state can be exported.",
            param="embedding_dim",
        )


def apple_config(config: ReDrafterConfig) -> dict:
    """The ``config.json`` of Apple's ``DrafterConfig`` for ``config`` (plus our ``redraft`` entry)."""
    H = config.hidden_size
    return {
        "model_type": APPLE_MODEL_TYPE,
        "architectures": ["Drafter"],
        "vocab_size": config.vocab_size,
        "hidden_size": H,
        "exit_dim": 2 * H,
        "num_draft_layers": config.num_layers,
        "num_lookback_tokens": NUM_LOOKBACK_TOKENS,
        "rnn": config.rnn,
        REDRAFT_KEY: {
            **{k: getattr(config, k) for k in _KEPT},
            **{k: getattr(config, k) for k in _KEPT_IF_SET if getattr(config, k, None) is not None},
        },
    }


def to_apple(model: ReDrafter) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config dict, state dict)`` of ``model`` in Apple's layout (tensors on the CPU, the
    model's dtype, contiguous). Raises ConfigError when the layout cannot express it."""
    config = model.config
    check_exportable(config)
    S, H, L = config.state_size, config.hidden_size, config.num_layers
    perm = swap_halves(S, H)  # h_apple = h[perm]
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out = {}
    if config.rnn:
        for k in RNN_KEYS:  # U, b, W: the same tensors under the same names
            out[k] = sd[k]
    for i in range(L):
        out[f"lm_head.{i}.linear.weight"] = sd[f"blocks.{i}.linear.weight"][perm][:, perm]  # P W Pᵀ
        out[f"lm_head.{i}.linear.bias"] = sd[f"blocks.{i}.linear.bias"][perm]  # P b
    out[f"lm_head.{L}.weight"] = sd["lm_head.weight"][:, perm]  # O Pᵀ
    return apple_config(config), {k: v.contiguous() for k, v in out.items()}


def _field(raw: dict, key: str, where: Path, kind: type, minimum: int | None = None):
    value = raw.get(key)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok or (minimum is not None and value < minimum):
        want = "true or false" if kind is bool else f"an integer >= {minimum}"
        raise ArtifactError(
            f"{where / artifact.CONFIG_NAME}: {key}={value!r} must be {want} (Apple's DrafterConfig)."
        )
    return value


def config_from_apple(
    raw: dict, where: Path, config_class: type[ReDrafterConfig]
) -> ReDrafterConfig:
    """The ``config_class`` (:class:`~redraft.models.redrafter.ReDrafterConfig`) of an Apple-layout
    ``config.json`` (``raw``) read from directory ``where``. Values of the wrong type, and an
    ``exit_dim`` other than ``2 * hidden_size`` (an ``input_proj`` layer, which redraft's head
    does not have), are ArtifactErrors naming the key."""
    H = _field(raw, "hidden_size", where, int, 1)
    V = _field(raw, "vocab_size", where, int, 1)
    L = _field(raw, "num_draft_layers", where, int, 0)
    rnn = _field(raw, "rnn", where, bool)
    exit_dim = _field(raw, "exit_dim", where, int, 1)
    if exit_dim != 2 * H:
        raise ArtifactError(
            f"{where / artifact.CONFIG_NAME}: exit_dim={exit_dim} != 2 * hidden_size ({2 * H}): "
            f"the head has an input_proj layer, which redraft's head cannot express."
        )
    kept = raw.get(REDRAFT_KEY) or {}
    if not isinstance(kept, dict):
        raise ArtifactError(
            f"{where / artifact.CONFIG_NAME}: {REDRAFT_KEY} must be an object, got {kept!r}."
        )
    unknown = sorted(set(kept) - set(_KEPT) - set(_KEPT_IF_SET))
    if unknown:
        raise ArtifactError(
            f"{where / artifact.CONFIG_NAME}: unknown {REDRAFT_KEY} keys {unknown} "
            f"(known: {list(_KEPT + _KEPT_IF_SET)})."
        )
    try:
        return config_class(
            hidden_size=H, embedding_dim=H, vocab_size=V, num_layers=L, rnn=rnn, **kept
        )
    except ConfigError as exc:
        raise ArtifactError(f"{where / artifact.CONFIG_NAME}: {exc}") from exc


def apple_shapes(config: ReDrafterConfig) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of Apple's layout for ``config``."""
    H, V, L = config.hidden_size, config.vocab_size, config.num_layers
    shapes = (
        {"rnn_u.weight": (H, H), "rnn_u.bias": (H,), "rnn_w.weight": (H, H)} if config.rnn else {}
    )
    for i in range(L):
        shapes[f"lm_head.{i}.linear.weight"] = (2 * H, 2 * H)
        shapes[f"lm_head.{i}.linear.bias"] = (2 * H,)
    shapes[f"lm_head.{L}.weight"] = (V, 2 * H)
    return shapes


def from_apple(
    config: ReDrafterConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """redraft's state dict from Apple-layout ``tensors`` (the inverse of :func:`to_apple`)."""
    S, H, L = config.state_size, config.hidden_size, config.num_layers
    inv = torch.argsort(swap_halves(S, H))  # h = h_apple[inv]
    sd = {}
    if config.rnn:
        for k in RNN_KEYS:
            sd[k] = tensors[k]
    for i in range(L):
        sd[f"blocks.{i}.linear.weight"] = tensors[f"lm_head.{i}.linear.weight"][inv][:, inv]
        sd[f"blocks.{i}.linear.bias"] = tensors[f"lm_head.{i}.linear.bias"][inv]
    sd["lm_head.weight"] = tensors[f"lm_head.{L}.weight"][:, inv]
    return {k: v.contiguous() for k, v in sd.items()}


def read_apple_drafter(
    directory: Path,
    model_class: type[ReDrafter],
    raw: dict | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> ReDrafter:
    """A ``model_class`` (:class:`~redraft.models.redrafter.ReDrafter`) from an Apple-layout
    directory, checked exactly like redraft's own artifacts (tensor names and shapes, recorded
    sha256, finite weights). ``raw``: its parsed ``config.json`` when already read. ``dtype``
    None keeps the stored dtype. No embedding is attached."""
    from safetensors.torch import load_file

    directory = Path(directory)
    raw = artifact.read_config_json(directory) if raw is None else raw
    config = config_from_apple(raw, directory, model_class.config_class)
    files = artifact.weight_files(directory)
    artifact.check_tensor_layout(
        artifact.tensor_shapes(files),
        apple_shapes(config),
        files[0] if len(files) == 1 else directory,
        f"Apple layout: hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, "
        f"num_draft_layers={config.num_layers}, rnn={config.rnn}",
    )
    if verify:
        artifact.verify_sha256(directory, raw, files)
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    artifact.check_finite(tensors, directory)
    with torch.device("meta"):  # no random init of a possibly large head: the tensors are assigned
        model = model_class(config)
    model.load_state_dict(from_apple(config, tensors), strict=True, assign=True)
    return model if dtype is None else model.to(dtype)


def write_apple(
    model: ReDrafter,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    readme: str | None = None,
) -> Path:
    """Write ``model`` in Apple's layout into ``out_dir``: ``config.json`` (with the weights'
    sha256), ``model.safetensors`` and, when given, ``README.md``.

    The files are written into a temporary directory next to ``out_dir`` first; a new
    ``out_dir`` is then renamed into place in one step, an existing one gets each file replaced
    atomically. Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    config, tensors = to_apple(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        save_file(tensors, str(tmp / artifact.WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / artifact.CONFIG_NAME).write_text(
            json.dumps(config, indent=2) + "\n", encoding="utf-8"
        )
        artifact.record_sha256(tmp)
        if readme is not None:
            (tmp / "README.md").write_text(readme, encoding="utf-8")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)  # mkdtemp/mkstemp-style 0600 is wrong for shared artifacts
        if not out.exists():
            os.chmod(tmp, 0o777 & ~umask)
            os.replace(tmp, out)
        else:
            for f in sorted(
                tmp.iterdir(), key=lambda f: f.name == artifact.CONFIG_NAME
            ):  # config.json last
                os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = [
    "APPLE_MODEL_TYPE",
    "check_exportable",
    "config_from_apple",
    "from_apple",
    "read_apple_drafter",
    "swap_halves",
    "to_apple",
    "write_apple",
]

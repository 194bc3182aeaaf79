"""What redraft's vLLM proposer drafts with, and how the settings reach vLLM's worker processes.

vLLM builds the proposer class in each worker process from ``speculative_config`` alone, whose
fields are vLLM's own: there is no slot for a user class's arguments. The settings therefore
travel in one environment variable, :data:`ENV_VAR`, that every worker inherits from the process
that starts vLLM (``vllm serve`` or ``LLM(...)``): either a JSON object or the path of a YAML or
JSON file holding one. One variable (not one per field) keeps the settings one document that
``--help``, the docs and the errors can name, and a file keeps long paths out of shell quoting.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from redraft.errors import ConfigError

ENV_VAR = "REDRAFT_VLLM_CONFIG"
CLASS_PATH = "redraft.vllm.Proposer"
DRAFTERS = ("context", "ngrammys", "trigram", "suffix")
COSTS = ("measured", "off")


@dataclass
class ProposerSettings:
    """The proposer's settings (every field optional).

    Attributes:
        ngrams: an n-gram tables artifact (directory or hub id) built for the served model's
            tokenizer; ``None`` drafts from the request's own tokens only (``context``).
        drafters: which of :data:`DRAFTERS` propose candidates; default every one the tables
            allow (``ngrammys`` needs the ``extended`` kind, ``trigram`` the ``trigram`` kind)
            and ``suffix`` where arctic-inference is installed (SuffixDecoding's trees over the
            request and over earlier requests' outputs).
        q_min, q_max: shortest and longest suffix the context drafter matches.
        paths: candidate chains per drafter and request, of which one is sent to vLLM.
        window: the context drafter looks back this many tokens.
        min_value: a chain stops at the first token whose estimated probability of being
            accepted (the product of the learned per-depth rates) is below this: a token that
            is rarely accepted still costs the verify its slot. 0 keeps
            ``num_speculative_tokens`` tokens whenever a candidate is that long.
        min_value_per_row: added to ``min_value`` for every request beyond the first in the
            step (a fixed rule; ``cost: measured`` weighs the batch's verify cost itself).
        cost: ``measured`` sends, across the batch, the draft tokens that maximise the expected
            tokens per second under vLLM's step time as measured between steps (see
            :mod:`redraft.vllm.pacing`); ``off`` sends every token above the floors.
        suffix_tokens: tokens of earlier requests the suffix drafter's global tree holds (the
            oldest requests leave first); 0: each request drafts from itself only.
    """

    ngrams: str | None = None
    drafters: list[str] | None = None
    q_min: int = 1
    q_max: int = 4
    paths: int = 8
    window: int = 4096
    min_value: float = 0.03
    min_value_per_row: float = 0.0
    cost: str = "measured"
    suffix_tokens: int = 1_000_000
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.extra:
            raise ConfigError(
                f"{ENV_VAR}: unknown setting(s) {', '.join(sorted(self.extra))}; the proposer "
                f"takes {', '.join(f.name for f in fields(self) if f.name != 'extra')}."
            )
        if self.drafters is not None:
            bad = [d for d in self.drafters if d not in DRAFTERS]
            if bad or not self.drafters:
                raise ConfigError(
                    f"{ENV_VAR}: drafters={self.drafters!r}; use a non-empty list of "
                    f"{', '.join(DRAFTERS)}."
                )
        if not 1 <= self.q_min <= self.q_max:
            raise ConfigError(
                f"{ENV_VAR}: q_min={self.q_min}, q_max={self.q_max}; need 1 <= q_min <= q_max."
            )
        for name in ("paths", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{ENV_VAR}: {name}={getattr(self, name)} must be >= 1.")
        if self.cost not in COSTS:
            raise ConfigError(f"{ENV_VAR}: cost={self.cost!r}; use one of {', '.join(COSTS)}.")
        if self.suffix_tokens < 0:
            raise ConfigError(f"{ENV_VAR}: suffix_tokens={self.suffix_tokens} must be >= 0.")
        for name in ("min_value", "min_value_per_row"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{ENV_VAR}: {name}={v} must lie in [0, 1].")

    @classmethod
    def from_dict(cls, d: dict) -> ProposerSettings:
        if not isinstance(d, dict):
            raise ConfigError(f"{ENV_VAR} must hold a JSON/YAML object, got {type(d).__name__}.")
        known = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in known}
        return cls(**kw, extra={k: v for k, v in d.items() if k not in known})

    def replace(self, **changes) -> ProposerSettings:
        """A copy with ``changes`` (checked like any other settings)."""
        return ProposerSettings.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


def read_settings(environ=None) -> ProposerSettings:
    """The settings in :data:`ENV_VAR` (defaults when it is unset or empty).

    Raises:
        ConfigError: a value that is neither a JSON object nor an existing file, a file that
            does not parse, an unknown key or a value out of range (each named).
    """
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return ProposerSettings()
    if raw.startswith("{"):
        try:
            return ProposerSettings.from_dict(json.loads(raw))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_VAR} is not valid JSON ({e}): {raw[:200]!r}") from e
    path = Path(raw).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{ENV_VAR}={raw!r} is neither a JSON object nor an existing file; point it at a "
            f"YAML/JSON file of proposer settings or set it to a JSON object."
        )
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} ({ENV_VAR}) does not parse as YAML/JSON: {e}") from e
    return ProposerSettings.from_dict(data or {})


def speculative_config(num_speculative_tokens: int = 5, **settings) -> dict:
    """vLLM's ``speculative_config`` for redraft's proposer, with ``settings`` (the fields of
    :class:`ProposerSettings`) put in :data:`ENV_VAR` for the worker processes vLLM starts.
    Call it before ``vllm.LLM(...)``:

        LLM(model=..., speculative_config=speculative_config(5, ngrams="checkpoints/ngrams"))
    """
    if num_speculative_tokens < 1:
        raise ConfigError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1.")
    s = ProposerSettings.from_dict(settings)  # checked here, in the caller's process
    os.environ[ENV_VAR] = json.dumps(s.to_dict())
    return {
        "method": "custom_class",
        "model": CLASS_PATH,
        "num_speculative_tokens": int(num_speculative_tokens),
    }

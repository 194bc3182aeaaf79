"""Test helpers (like ``transformers.testing_utils``): the tiny random targets of
:mod:`redraft.models.tiny`, and drafter states over token rows.
"""

from __future__ import annotations

from redraft.models.tiny import (  # noqa: F401 (re-exported for tests)
    LLAMA2_TEMPLATE,
    make_tiny_model,
    make_tiny_target_dir,
    make_tiny_tokenizer,
)


def decode_state(rows, temperature: float = 0.0, generator=None):
    """A :class:`redraft.infer.spec.drafter.DecodeState` over token rows of any lengths (the
    whole row is the prompt; ``PAD`` after a row's end), every row sampled at ``temperature``
    from ``generator``, for drafter tests."""
    import torch

    from redraft.infer.spec.accept import RowSampling
    from redraft.infer.spec.drafter import DecodeState
    from redraft.infer.spec.paths import PAD

    T = max(len(r) for r in rows)
    toks = torch.full((len(rows), T), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        toks[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    return DecodeState(
        tokens=toks,
        lengths=lengths,
        last=toks[torch.arange(len(rows)), lengths - 1],
        hidden=None,
        prompt_lengths=lengths.clone(),
        step=0,
        request_ids=torch.arange(len(rows)),
        sampling=RowSampling.uniform(len(rows), temperature, generator=generator),
    )


def declared_scripts() -> dict[str, str]:
    """``{console script: "module:function"}`` as this checkout's ``pyproject.toml`` declares them
    (a source checkout: its installed metadata may be older than the file), else as the installed
    distribution records them (a wheel)."""
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = None
    if tomllib is not None and pyproject.is_file():
        return dict(tomllib.loads(pyproject.read_text())["project"]["scripts"])
    from importlib.metadata import distribution

    eps = distribution("redraft").entry_points
    return {ep.name: ep.value for ep in eps if ep.group == "console_scripts"}

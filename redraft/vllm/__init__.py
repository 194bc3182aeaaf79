"""redraft inside vLLM: the host drafters as a vLLM speculative proposer.

    from redraft.vllm import speculative_config
    llm = vllm.LLM(model=..., speculative_config=speculative_config(5, ngrams="checkpoints/ngrams"))

or ``vllm serve MODEL --speculative-config '{"method": "custom_class", "model":
"redraft.vllm.Proposer", "num_speculative_tokens": 5}'`` with the settings in
``REDRAFT_VLLM_CONFIG`` (see :mod:`redraft.vllm.settings`, docs/vllm.md).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Proposer": "redraft.vllm.proposer",
    "ProposerSettings": "redraft.vllm.settings",
    "speculative_config": "redraft.vllm.settings",
    "read_settings": "redraft.vllm.settings",
    "ENV_VAR": "redraft.vllm.settings",
    "export_target": "redraft.vllm.export",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'redraft.vllm' has no attribute {name!r}")

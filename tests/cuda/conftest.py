"""Fixtures of the CUDA tests: a tiny random target on the GPU (4 layers, so the HSDDW early-exit
hierarchy has two levels), real n-gram tables built on the GPU by redraft-build-ngrams, and a
random ReDrafter artifact. Every test here is marked `cuda` and skipped where torch sees no CUDA
device (tests/conftest.py); dev/gpu/gpu-run.sh runs them on the GPU machine (stage a)."""

import pytest
from cuda_helpers import DEVICE, write_chats


@pytest.fixture(scope="session")
def cuda_target_dir(tmp_path_factory):
    from redraft.testing import make_tiny_target_dir

    return make_tiny_target_dir(tmp_path_factory.mktemp("cuda-target"), num_layers=4)


@pytest.fixture(scope="session")
def cuda_target(cuda_target_dir):
    from redraft.models import load_target

    return load_target(str(cuda_target_dir), dtype="float32", device=DEVICE)


@pytest.fixture(scope="session")
def chats_file(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("cuda-chats") / "chats.jsonl")


@pytest.fixture(scope="session")
def cuda_tables_dir(cuda_target_dir, chats_file, tmp_path_factory):
    """Every n-gram kind, built by redraft-build-ngrams on the GPU."""
    from redraft.ngrams.cli import main as build_ngrams

    out = tmp_path_factory.mktemp("cuda-ngrams")
    rc = build_ngrams(
        [
            "--target",
            str(cuda_target_dir),
            "--device",
            DEVICE,
            "--output-dir",
            str(out),
            "--data",
            f"sharegpt:{chats_file}",
            "-k",
            "8",
            "-w",
            "4",
            "--min-count",
            "1",
            "--num-proc",
            "1",
            "--overwrite",
            "--quiet",
        ]
    )
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def cuda_head_dir(cuda_target, tmp_path_factory):
    """A random ReDrafter artifact for the tiny target (its drafts are mostly wrong: exactness
    must hold whatever a drafter proposes)."""
    import torch

    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("cuda-head")
    ReDrafter(ReDrafterConfig.for_target(cuda_target, num_layers=1, num_steps=3)).save_pretrained(
        str(out)
    )
    return out

import os
import stat

import pytest
import torch

from redraft.errors import ConfigError
from redraft.utils import (
    atomic_path,
    atomic_write_text,
    resolve_device,
    resolve_dtype,
    split_revision,
)


def test_resolve_dtype_names_and_defaults():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.float32) is torch.float32
    assert resolve_dtype(None, "cpu") is torch.float32
    with pytest.raises(ConfigError, match="unknown dtype 'int3'.*bfloat16"):
        resolve_dtype("int3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_resolve_device_refuses_cuda_without_cuda():
    with pytest.raises(ConfigError, match="'cuda'.*--device cpu"):
        resolve_device("cuda")
    assert resolve_device(None).type == "cpu"
    with pytest.raises(ConfigError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")


def test_split_revision_first_at_and_existing_paths(tmp_path):
    assert split_revision("org/name@v1.0") == ("org/name", "v1.0")
    assert split_revision("org/name@") == ("org/name", None)
    assert split_revision("org/name") == ("org/name", None)
    odd = tmp_path / "a@b"
    odd.mkdir()
    assert split_revision(str(odd)) == (str(odd), None)


def test_atomic_write_replaces_whole_file_with_shared_mode(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask
    assert [f.name for f in tmp_path.iterdir()] == ["x.txt"]


def test_atomic_path_keeps_old_file_and_leaves_no_temp_on_error(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert p.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["x.txt"]


def test_cache_kwargs_uses_the_name_the_forward_takes():
    import inspect

    from transformers import LlamaConfig, LlamaModel

    from redraft.utils import cache_kwargs

    class Old:  # a forward from before transformers renamed the argument
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass

    cache = object()
    assert cache_kwargs(Old(), cache) == {"past_key_values": cache}
    model = LlamaModel(
        LlamaConfig(
            vocab_size=16,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    want = (
        "cache"
        if "cache" in inspect.signature(LlamaModel.forward).parameters
        else "past_key_values"
    )
    assert list(cache_kwargs(model, cache)) == [want]

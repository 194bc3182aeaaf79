"""Fixtures for the data tests: small source files written by the tests, tiny tokenizers."""

import pytest
from data_helpers import CHATS, write_json


@pytest.fixture
def chats_file(tmp_path):
    return write_json(tmp_path / "chats.json", CHATS)


@pytest.fixture(scope="session")
def chatml_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


@pytest.fixture(scope="session")
def llama2_tokenizer(llama2_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama2_target_dir))

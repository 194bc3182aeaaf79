"""Data: sources (ShareGPT, UltraChat, The Stack, local files) → records → token ids + loss masks.

The trainer and the n-gram builder read data only through this package::

    from redraft.data import build_token_dataset, iter_token_arrays, iter_records
    ds = build_token_dataset("default-chat", target.tokenizer, max_length=2048)   # id, input_ids, loss_mask
    for ids in iter_token_arrays("default-code", target.tokenizer): ...           # int32 arrays

See :mod:`redraft.data.sources` for the data spec grammar and docs/data.md for the guide.
"""

from redraft.data.prompts import heldout_prompts, humaneval_prompts, load_prompts
from redraft.data.records import SKIP_REASONS, DataStats, Record, is_heldout
from redraft.data.sources import default_chat_path, default_code_dir, iter_records, parse_spec
from redraft.data.tokens import ChatRenderer, build_token_dataset, iter_token_arrays

__all__ = [
    "SKIP_REASONS",
    "ChatRenderer",
    "DataStats",
    "Record",
    "build_token_dataset",
    "default_chat_path",
    "default_code_dir",
    "heldout_prompts",
    "humaneval_prompts",
    "is_heldout",
    "iter_records",
    "iter_token_arrays",
    "load_prompts",
    "parse_spec",
]

"""What identifies the target a run trains against: its id, tokenizer and weights.

The tokenizer fingerprint (``redraft.models.tokenizer_fingerprint``) says which ids mean which
strings; it does not tell two models with one tokenizer apart (a base model and its fine-tune,
or another size of one family). A head trained on one model's hidden states is wrong on
another's, so a run also records :func:`weights_fingerprint`, and ``--resume`` and
``--features`` refuse a target whose fingerprints differ.
"""

from __future__ import annotations

import hashlib

import torch

# elements hashed at the start, middle and end of every parameter tensor
SLICE = 16


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """``"sha256:<16 hex>"`` over every parameter's name and shape and 3 x 16 of its values.

    Cheap (a few KiB read, whatever the model's size) yet sensitive to any change that touches
    a tensor's first, middle or last elements: another checkpoint, a merged LoRA (it changes
    every element of the matrices it adapts), a resized vocabulary. Values are rounded to
    bfloat16 first, so one checkpoint loaded in float32 (CPU) or bfloat16 (GPU) gives one
    fingerprint.
    """
    h = hashlib.sha256()
    picks = []
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        n = flat.numel()
        mid = max(0, n // 2 - SLICE // 2)
        picks += [flat[:SLICE], flat[mid : mid + SLICE], flat[max(0, n - SLICE) :]]
        h.update(f"{name}:{tuple(p.shape)}\n".encode())
    if picks:  # one device-to-host copy
        values = torch.cat([x.to(torch.bfloat16) for x in picks]).view(torch.int16).cpu().numpy()
        h.update(values.tobytes())
    return "sha256:" + h.hexdigest()[:16]


def target_record(target) -> dict:
    """The target as a run records it (run_config.yaml ``target_record``, features.json):
    ``target_model`` (id), ``tokenizer_fingerprint``, ``weights_fingerprint``, sizes."""
    return {**target.artifact_metadata(), "weights_fingerprint": weights_fingerprint(target.model)}


def record_mismatch(saved: dict, current: dict) -> list[str]:
    """Keys of a target record that differ (only keys both records hold are compared)."""
    keys = (
        "tokenizer_fingerprint",
        "weights_fingerprint",
        "target_vocab_size",
        "target_hidden_size",
    )
    return [k for k in keys if k in saved and k in current and saved[k] != current[k]]


def describe(record: dict) -> str:
    """``'org/model' (weights sha256:..., tokenizer sha256:...)`` for error messages."""
    return (
        f"{record.get('target_model')!r} (weights {record.get('weights_fingerprint')}, "
        f"tokenizer {record.get('tokenizer_fingerprint')})"
    )

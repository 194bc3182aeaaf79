"""One record type for every source, the checks that turn raw JSON into records, and the split.

A :class:`Record` is either a conversation (``kind="chat"``: system/user/assistant messages) or a
plain document (``kind="doc"``: source code, prose). Every source format (ShareGPT, UltraChat,
The Stack, a directory of files) is converted to records by the ``*_record`` functions below;
a raw record that cannot be used is not an exception but a *skip*, counted by reason in
:class:`DataStats` so that a large file with a few bad records still goes through.

The train/held-out split is a hash of the record id (:func:`is_heldout`): it does not depend on
the order, the other records or the machine, so one conversation never lands on both sides.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

# Role names seen in the wild → the three roles chat templates understand.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

# Why a raw record was skipped (the keys of DataStats.skipped). Listed here so that docs, tests and
# summaries agree on one spelling.
SKIP_REASONS = {
    "not_an_object": "the record is not a JSON object",
    "invalid_json": "a line of a JSONL file is not valid JSON",
    "missing_field": "a required field is missing (conversations/data/messages/content, or a turn's role/text)",
    "non_string_turn": "a turn's text is not a string",
    "empty_turn": "a turn's text is empty or only whitespace",
    "unknown_role": "a turn's role is not system/user/assistant or a known alias",
    "misplaced_system": "a system turn that is not the first turn",
    "same_role_twice": "two turns of the same role in a row",
    "no_assistant_turn": "no assistant turn (after dropping a leading one)",
    "empty_document": "a document with no text",
    "not_utf8": "a file that is not UTF-8 text",
    "filtered_out": "the record does not match the source's lang/ext filter",
    "template_error": "the chat template raised an error on this conversation",
    "template_not_prefix": "rendering a prefix of the conversation is not a prefix of the full rendering",
    "no_loss_tokens": "no assistant token left after truncation",
}


@dataclass
class Record:
    """A conversation or a document, whatever file or hub dataset it came from.

    Attributes:
        id: unique within its source; the split hashes it (:func:`is_heldout`).
        kind: ``"chat"`` (``messages`` set) or ``"doc"`` (``text`` set).
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``; at most one
            system turn, first; then user and assistant alternate, starting with user; at least
            one assistant turn.
        text: the document's text.
        source: the source spec the record came from (e.g. ``"default-chat"``).
    """

    id: str
    kind: str
    messages: list[dict] | None = None
    text: str | None = None
    source: str = ""


@dataclass
class DataStats:
    """Counts of records kept and skipped (by reason, see ``SKIP_REASONS``) while reading.

    Pass one to :func:`redraft.data.iter_records` (``stats=``) to see what was dropped; the CLIs
    print :meth:`summary` at the end.
    """

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    notes: Counter = field(
        default_factory=Counter
    )  # kept records that were altered, e.g. a dropped leading turn

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line: ``kept 17,000 records; skipped 671: same_role_twice 400, empty_turn 271``."""
        text = f"kept {self.kept:,} records"
        if self.skipped:
            parts = ", ".join(f"{k} {v:,}" for k, v in self.skipped.most_common())
            text += f"; skipped {self.total_skipped:,}: {parts}"
        if self.notes:
            text += "; " + ", ".join(f"{k} {v:,}" for k, v in self.notes.most_common())
        return text

    def to_dict(self) -> dict:
        return {"kept": self.kept, "skipped": dict(self.skipped), "notes": dict(self.notes)}

    def update(self, other: DataStats | dict) -> None:
        d = other.to_dict() if isinstance(other, DataStats) else other
        self.kept += d.get("kept", 0)
        self.skipped.update(d.get("skipped", {}))
        self.notes.update(d.get("notes", {}))


class Skip(Exception):
    """Raised by the converters below; carries the reason counted in DataStats."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# the split


def heldout_score(record_id: str) -> float:
    """A uniform number in [0, 1) from the SHA-256 of the id (stable across runs and machines)."""
    digest = hashlib.sha256(record_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(record_id: str, heldout_fraction: float = 0.02) -> bool:
    """Whether a record belongs to the held-out split: ``heldout_score(id) < heldout_fraction``.

    Deterministic in the id alone, so the split never changes when records are added, removed or
    reordered, and a larger fraction's held-out set contains a smaller fraction's.
    """
    return heldout_score(record_id) < heldout_fraction


def content_id(prefix: str, payload) -> str:
    """A stable id for a record that has none: ``prefix:`` + 16 hex digits of its content hash."""
    blob = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, sort_keys=True, ensure_ascii=False)
    )
    return f"{prefix}:{hashlib.sha1(blob.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------
# raw JSON → Record


def check_messages(messages: list[dict], stats: DataStats | None = None) -> list[dict]:
    """Validate and normalise ``[{"role", "content"}]`` (roles already mapped); raise :class:`Skip`.

    A leading assistant turn (ShareGPT splits long chats mid-conversation, so many parts start
    with the model) is dropped rather than the whole record: it has no prompt to answer.
    """
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            raise Skip("misplaced_system")
    start = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while start + dropped < len(messages) and messages[start + dropped]["role"] == "assistant":
        dropped += 1
    if dropped:
        messages = messages[:start] + messages[start + dropped :]
        if stats is not None:
            stats.notes["dropped_leading_assistant"] += 1
    if not any(m["role"] == "assistant" for m in messages):
        raise Skip("no_assistant_turn")
    for a, b in zip(messages, messages[1:]):
        if a["role"] == b["role"]:
            raise Skip("same_role_twice")
    return messages


def _turn(role, content) -> dict:
    if role is None or content is None:
        raise Skip("missing_field")
    if not isinstance(content, str):
        raise Skip("non_string_turn")
    if not content.strip():
        raise Skip("empty_turn")
    mapped = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
    if mapped is None:
        raise Skip("unknown_role")
    return {"role": mapped, "content": content}


def _chat_turns(turns) -> list[dict]:
    """``[{"from"|"role": ..., "value"|"content": ...}]`` → normalised messages (any field spelling)."""
    if not isinstance(turns, list) or not turns:
        raise Skip("missing_field")
    out = []
    for t in turns:
        if not isinstance(t, dict):
            raise Skip("missing_field")
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content", t.get("text")))
        out.append(_turn(role, content))
    return out


def _record_id(obj: dict, prefix: str, payload) -> str:
    for key in ("id", "prompt_id", "conversation_id", "hexsha"):
        value = obj.get(key)
        if isinstance(value, (str, int)) and str(value):
            return str(value)
    return content_id(prefix, payload)


def sharegpt_record(obj, source: str = "", stats: DataStats | None = None) -> Record:
    """``{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`` → Record."""
    if not isinstance(obj, dict):
        raise Skip("not_an_object")
    turns = obj.get("conversations", obj.get("items", obj.get("messages")))
    messages = check_messages(_chat_turns(turns), stats)
    return Record(
        id=_record_id(obj, "sharegpt", turns), kind="chat", messages=messages, source=source
    )


def ultrachat_record(obj, source: str = "", stats: DataStats | None = None) -> Record:
    """``stingning/ultrachat`` (``{"id", "data": [user, assistant, ...]}``) or
    ``HuggingFaceH4/ultrachat_200k`` (``{"prompt_id", "messages": [{"role", "content"}]}``) → Record."""
    if not isinstance(obj, dict):
        raise Skip("not_an_object")
    if "data" in obj:
        data = obj["data"]
        if not isinstance(data, list) or not data:
            raise Skip("missing_field")
        turns = [_turn("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(data)]
        payload = data
    else:
        payload = obj.get("messages")
        turns = _chat_turns(payload)
    messages = check_messages(turns, stats)
    return Record(
        id=_record_id(obj, "ultrachat", payload), kind="chat", messages=messages, source=source
    )


def stack_record(
    obj,
    source: str = "",
    lang: str | None = None,
    ext: str | None = None,
    stats: DataStats | None = None,
) -> Record:
    """``{"content", "lang"?, "ext"?}`` (The Stack, the-stack-dedup) → document Record.

    ``lang``/``ext`` filter case-insensitively on the record's own ``lang``/``ext`` fields (or the
    extension of ``path``/``max_stars_repo_path`` when the record has no ``ext``).
    """
    if not isinstance(obj, dict):
        raise Skip("not_an_object")
    text = obj.get("content", obj.get("text"))
    if text is None:
        raise Skip("missing_field")
    if not isinstance(text, str):
        raise Skip("non_string_turn")
    if lang is not None:
        rec_lang = obj.get("lang", obj.get("language"))
        if rec_lang is not None and str(rec_lang).lower() != lang.lower():
            raise Skip("filtered_out")
    if ext is not None:
        rec_ext = obj.get("ext")
        if rec_ext is None:
            path = next(
                (
                    p
                    for p in (obj.get("path"), obj.get("max_stars_repo_path"))
                    if isinstance(p, str) and p
                ),
                "",
            )
            rec_ext = path.rsplit(".", 1)[-1] if "." in path else None
        if rec_ext is not None and str(rec_ext).lower().lstrip(".") != ext.lower().lstrip("."):
            raise Skip("filtered_out")
    if not text.strip():
        raise Skip("empty_document")
    rid = _record_id(obj, "stack", text)
    if rid.startswith("stack:") and isinstance(obj.get("max_stars_repo_path"), str):
        rid = f"{obj.get('max_stars_repo_name', '')}/{obj['max_stars_repo_path']}"
    return Record(id=rid, kind="doc", text=text, source=source)


def auto_record(obj, source: str = "", stats: DataStats | None = None) -> Record:
    """Pick the converter from the fields present (ShareGPT, UltraChat or a document)."""
    if not isinstance(obj, dict):
        raise Skip("not_an_object")
    if "conversations" in obj or "items" in obj:
        return sharegpt_record(obj, source, stats)
    if "data" in obj or "messages" in obj:
        return ultrachat_record(obj, source, stats)
    if "content" in obj or "text" in obj:
        return stack_record(obj, source, stats=stats)
    raise Skip("missing_field")


def record_to_sharegpt(record: Record) -> dict:
    """A chat Record as a ShareGPT JSON object (what ``redraft-distill-data`` writes)."""
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {
        "id": record.id,
        "conversations": [
            {"from": names[m["role"]], "value": m["content"]} for m in record.messages
        ],
    }

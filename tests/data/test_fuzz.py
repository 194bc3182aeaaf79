"""Property-based tests: the data-spec parser and the file readers fed random text, random bytes
and random JSON. Every call succeeds or raises a RedraftError with a message; never another
exception, never a hang (bounded examples, a deadline per example; the file runs in seconds).
"""

import atexit
import gzip
import itertools
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from redraft.data.records import (
    SKIP_REASONS,
    DataStats,
    Skip,
    auto_record,
    sharegpt_record,
    stack_record,
    ultrachat_record,
)
from redraft.data.sources import KINDS, OPTIONS, iter_records, parse_spec
from redraft.errors import RedraftError

FUZZ = settings(
    max_examples=120,
    deadline=2000,
    database=None,  # no .hypothesis/ in the repo
    suppress_health_check=[HealthCheck.too_slow],
)
SUFFIXES = [".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet", ".txt", ""]
READERS = ["sharegpt", "ultrachat", "stack", "auto"]  # auto: a bare path, format per record
_DIR = Path(tempfile.mkdtemp(prefix="redraft-fuzz-"))  # one folder, a fresh file per example
atexit.register(shutil.rmtree, _DIR, True)
_names = itertools.count()


def _outcome(fn):
    """``fn()``'s result, or the RedraftError it raised (which must carry a message)."""
    try:
        return fn()
    except RedraftError as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return exc


def _file(data: bytes, suffix: str) -> Path:
    path = _DIR / f"f{next(_names)}{suffix}"
    path.write_bytes(data)
    return path


def _read(reader: str, path: Path):
    stats = DataStats()
    spec = str(path) if reader == "auto" else f"{reader}:{path}"
    return _outcome(lambda: (list(iter_records(spec, stats=stats)), stats))


def _check_records(result):
    """Records that come out are valid: chats alternate and hold an assistant turn."""
    if isinstance(result, RedraftError):
        return
    records, stats = result
    assert stats.kept == len(records)
    for r in records:
        assert isinstance(r.id, str) and r.id
        if r.kind == "chat":
            roles = [m["role"] for m in r.messages]
            assert "assistant" in roles and all(a != b for a, b in zip(roles, roles[1:]))
            assert all(isinstance(m["content"], str) and m["content"].strip() for m in r.messages)
        else:
            assert r.kind == "doc" and isinstance(r.text, str) and r.text.strip()


# ------------------------------------------------------------------------------ spec parser


def _check_spec(result):
    if isinstance(result, RedraftError):
        return
    assert result, "a spec that parses has at least one component"
    for c in result:
        assert c.kind in KINDS and set(c.options) <= OPTIONS
        assert math.isfinite(c.weight) and c.weight > 0


def test_a_spec_no_path_can_have_is_a_clear_error():
    for text in ("~\x00", "~a\x00b", "x\x00"):  # expanduser raised ValueError on the first two
        _check_spec(_outcome(lambda: parse_spec(text)))


@FUZZ
@given(st.text(max_size=80))
def test_spec_parser_on_random_text(text):
    _check_spec(_outcome(lambda: parse_spec(text)))


_weights = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "-1", "1e999", "nan", "inf", "0.7", "", "x"]),
)
_kinds = st.one_of(st.sampled_from(KINDS), st.text(max_size=8))
_opts = st.lists(
    st.tuples(
        st.one_of(st.sampled_from(sorted(OPTIONS)), st.text(max_size=5)), st.text(max_size=5)
    ),
    max_size=3,
)


@st.composite
def _component(draw):
    w, kind, arg, opts = (
        draw(_weights),
        draw(_kinds),
        draw(st.one_of(st.none(), st.text(max_size=12))),
        draw(_opts),
    )
    text = (f"{w}*" if w is not None else "") + kind + (f":{arg}" if arg is not None else "")
    if opts:
        text += "?" + "&".join(f"{k}={v}" for k, v in opts)
    return text


@FUZZ
@given(st.lists(_component(), min_size=1, max_size=3))
def test_spec_parser_on_specs_built_from_the_grammar(parts):
    _check_spec(_outcome(lambda: parse_spec(",".join(parts))))


@pytest.mark.parametrize(
    "spec",
    [
        "nan*default-chat",
        "inf*default-chat",
        "1e999*default-code",
        "default-chat:nan",
        "-0.0*default-chat",
    ],
)
def test_weights_must_be_finite_and_positive(spec):
    with pytest.raises(RedraftError, match="[Ww]eight"):
        parse_spec(spec)


# ------------------------------------------------------------------------------ readers


@FUZZ
@given(st.binary(max_size=3000), st.sampled_from(SUFFIXES), st.sampled_from(READERS), st.booleans())
def test_readers_on_random_bytes(data, suffix, reader, compress):
    if suffix.endswith(".gz") and compress:  # valid gzip around random content, or a bad gzip
        data = gzip.compress(data)
    _check_records(_read(reader, _file(data, suffix)))


@FUZZ
@given(
    st.sampled_from([b"[", b"{", b'[{"conversations": ', b'{"id": 1}\n']),
    st.binary(max_size=3000),
    st.sampled_from(SUFFIXES[:2]),
    st.sampled_from(READERS),
)
def test_readers_on_random_bytes_after_a_json_start(head, tail, suffix, reader):
    _check_records(_read(reader, _file(head + tail, suffix)))


_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
)
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_role = st.one_of(
    st.sampled_from(["human", "gpt", "user", "assistant", "system", "bard", "tool"]), _json
)
_turn = st.one_of(
    st.fixed_dictionaries({"from": _role, "value": _json}),
    st.fixed_dictionaries({"role": _role, "content": _json}),
    st.fixed_dictionaries({"from": _role, "value": st.text(max_size=20)}),
    _json,
)
_record = st.one_of(
    st.fixed_dictionaries(
        {"id": _json, "conversations": st.one_of(st.lists(_turn, max_size=5), _json)}
    ),
    st.fixed_dictionaries(
        {"data": st.one_of(st.lists(st.one_of(st.text(max_size=10), _json), max_size=5), _json)}
    ),
    st.fixed_dictionaries({"messages": st.one_of(st.lists(_turn, max_size=5), _json)}),
    st.fixed_dictionaries(
        {"content": st.one_of(st.text(min_size=1, max_size=10), _json)},
        optional={
            "lang": _json,
            "ext": _json,
            "path": _json,
            "id": _json,
            "max_stars_repo_path": _json,
            "max_stars_repo_name": _json,
        },
    ),
    _json,
)


@FUZZ
@given(
    st.lists(_record, max_size=6),
    st.sampled_from(["list", "jsonl", "jsonl.gz"]),
    st.sampled_from(READERS),
    st.sampled_from(["", "?lang=python", "?ext=py", "?lang=python&ext=.py"]),
)
def test_readers_on_random_json_records(records, layout, reader, options):
    if layout == "list":
        data, suffix = json.dumps(records).encode(), ".json"
    else:
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        data, suffix = (
            (gzip.compress(data), ".jsonl.gz") if layout.endswith("gz") else (data, ".jsonl")
        )
    path = _file(data, suffix)
    if reader == "stack":
        stats = DataStats()
        result = _outcome(
            lambda: (list(iter_records(f"stack:{path}{options}", stats=stats)), stats)
        )
    else:
        result = _read(reader, path)
    _check_records(result)


@settings(FUZZ, max_examples=400)
@given(
    _record,
    st.sampled_from(["sharegpt", "ultrachat", "stack", "auto"]),
    st.one_of(st.none(), st.text(max_size=4)),
    st.one_of(st.none(), st.text(max_size=4)),
)
def test_record_converters_return_a_record_or_a_counted_skip(obj, kind, lang, ext):
    """What the readers do per JSON object: a valid Record, or a Skip whose reason is listed."""
    convert = {
        "sharegpt": sharegpt_record,
        "ultrachat": ultrachat_record,
        "auto": auto_record,
        "stack": lambda o, src, stats: stack_record(o, src, lang=lang, ext=ext, stats=stats),
    }[kind]
    stats = DataStats()
    try:
        record = convert(obj, "fuzz", stats)
    except Skip as skip:
        assert skip.reason in SKIP_REASONS
        return
    stats.kept += 1
    _check_records(([record], stats))


_stack_record = st.fixed_dictionaries(
    {"content": st.one_of(st.text(max_size=10), _json)},
    optional={
        k: st.one_of(_scalar, _json)
        for k in (
            "lang",
            "language",
            "ext",
            "path",
            "id",
            "hexsha",
            "max_stars_repo_path",
            "max_stars_repo_name",
        )
    },
)


@settings(FUZZ, max_examples=300)
@given(
    _stack_record,
    st.one_of(st.none(), st.text(max_size=4)),
    st.one_of(st.none(), st.text(max_size=4)),
)
def test_code_records_with_any_field_types_are_kept_or_skipped(obj, lang, ext):
    try:
        record = stack_record(obj, "fuzz", lang=lang, ext=ext)
    except Skip as skip:
        assert skip.reason in SKIP_REASONS
        return
    _check_records(([record], DataStats(kept=1)))


_chat = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=6),
        "conversations": st.lists(
            st.fixed_dictionaries(
                {
                    "from": st.sampled_from(["human", "gpt"]),
                    "value": st.text(min_size=1, max_size=30),
                }
            ),
            min_size=1,
            max_size=4,
        ),
    }
)


@FUZZ
@given(st.lists(_chat, min_size=1, max_size=8), st.data())
def test_a_json_list_cut_anywhere_keeps_a_prefix_of_its_records(chats, data):
    whole = json.dumps(chats).encode()
    full = _read("sharegpt", _file(whole, ".json"))
    assume(not isinstance(full, RedraftError))
    cut = data.draw(st.integers(0, len(whole)))
    part = _read("sharegpt", _file(whole[:cut], ".json"))
    _check_records(part)
    if not isinstance(part, RedraftError):
        got = [(r.id, r.messages) for r in part[0]]
        assert got == [(r.id, r.messages) for r in full[0]][: len(got)]


@pytest.mark.parametrize(
    "text", ["[" * 100_000, '{"a": ' * 100_000, "[" + "[" * 50_000 + "]" * 50_000 + "]"]
)
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_nesting_deeper_than_the_json_parser_allows_is_a_data_error(text, suffix):
    result = _read("sharegpt", _file(text.encode(), suffix))
    assert isinstance(result, RedraftError) and "nest" in str(result)

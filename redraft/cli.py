"""What every console script shares: exit codes and one-line errors.

    def main(argv=None) -> int:
        args = build_parser().parse_args(argv)       # a bad flag: one line, exit 2 (utils.ArgumentParser)
        return run_cli("redraft-x", lambda: work(args), interrupted="the files written so far are kept")

:func:`run_cli` runs the work and maps what it raises to the exit status every redraft command
uses: a :class:`~redraft.errors.RedraftError` (bad input or environment, whose message names
the file, value or setting at fault) is ``prog: error: <message on one line>`` on stderr and
status 2; Ctrl-C is ``prog: interrupted[; what was kept]`` and status 130. Anything else is a
bug and keeps its traceback. :class:`ModelSettings` declares the model flags (target, drafters,
n-gram tables, dtype, device, threads) once for every command that loads a target.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from redraft.errors import RedraftError
from redraft.settings import Range, Settings, setting
from redraft.utils import command_name

EXIT_ERROR = 2  # what argparse uses for a bad command line, and every redraft error
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports after Ctrl-C


def one_line(exc: BaseException) -> str:
    """The error's message with every run of whitespace (newlines too) made one space."""
    return " ".join(str(exc).split())


def print_error(prog: str, exc: BaseException) -> int:
    """``prog: error: <message>`` on stderr; returns :data:`EXIT_ERROR`."""
    print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
    return EXIT_ERROR


def run_cli(
    prog: str,
    work: Callable[[], int | None],
    *,
    interrupted: str = "",
    errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``work()`` and return its exit status (None counts as 0).

    A RedraftError (or one of ``errors``) prints one line and returns 2; a KeyboardInterrupt
    prints ``prog: interrupted`` plus ``interrupted`` (what was kept, what to do) and returns 130.
    ``prog`` is said as the user typed it (``redraft bench`` for ``redraft-bench``:
    :func:`redraft.utils.command_name`).
    """
    prog = command_name(prog)
    try:
        status = work()
    except (RedraftError, *errors) as exc:
        return print_error(prog, exc)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted" + (f"; {interrupted}" if interrupted else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0 if status is None else int(status)


# ------------------------------------------------------------------------------ shared flags


@dataclass
class ModelSettings(Settings):
    """The model flags every command that loads a target shares (``redraft-bench``,
    ``redraft-serve``, ``redraft-build-ngrams``, ``redraft-distill-data``): declared once here;
    a command takes the subset it needs (``add_arguments(only=...)``), and a settings class
    that inherits these fields may redeclare one with its own default (the bench's float32)."""

    KIND = "model setting"

    target: str = setting(
        "default",
        "Target model: 'default' (the embedded SmolLM2), a hub id[@rev], a local "
        "HF/PEFT directory, a .gguf file or dummy:<shape>.",
    )
    drafters: list[str] = setting(
        default_factory=list,
        help="ReDrafter artifact directory or hub id (repeat for several).",
        flag="--drafter",
        metavar="DIR",
        repeat=True,
    )
    ngrams: list[str] = setting(
        default_factory=list,
        help="N-gram table directory or hub id (repeat for several).",
        metavar="DIR",
        repeat=True,
    )
    dtype: str | None = setting(
        None, "Target dtype: float32, bfloat16 or float16; none = float32 on CPU, bfloat16 on CUDA."
    )
    device: str | None = setting(
        None, "Torch device: cpu, cuda or cuda:N; none = CUDA when available."
    )
    threads: int | None = setting(
        None,
        "Torch CPU threads; none = torch's choice (on a CPU busy with other work "
        "1 thread can be several times faster).",
        range=Range(1),
    )

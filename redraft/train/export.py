"""``redraft-export``: write a trained ReDrafter head in another project's layout.

    redraft-export HEAD_DIR OUT_DIR --format apple

``apple`` is apple/ml-recurrent-drafter's layout (``DrafterConfig``/``Drafter``, PyTorch and
MLX), which TensorRT-LLM's ReDrafter converter (``examples/redrafter/convert_checkpoint.py``)
reads. The conversion itself (an exact permutation of the ``[state, context]`` halves) lives in
:mod:`redraft.models.apple`, because ``load_drafter`` reads the same layout back. The way back
needs no command: ``load_drafter`` and ``redraft-train --init-from`` read Apple's layout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from redraft.cli import run_cli
from redraft.errors import ConfigError
from redraft.utils import ArgumentParser

FORMATS = ("apple",)
DTYPES = ("keep", "float32", "bfloat16", "float16")
PROG = "redraft-export"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a trained ReDrafter head (a redraft-train artifact) in another project's layout: "
        "'apple' = apple/ml-recurrent-drafter's DrafterConfig/Drafter, which TensorRT-LLM's "
        "ReDrafter converter reads. Prints the next commands for TensorRT-LLM.",
    )
    p.add_argument(
        "head",
        metavar="HEAD_DIR",
        help="the drafter artifact: a directory with config.json + model.safetensors, or a hub REPO_ID[@rev]",
    )
    p.add_argument(
        "out_dir", metavar="OUT_DIR", help="directory to write (created; must be new or empty)"
    )
    p.add_argument("--format", choices=FORMATS, default="apple", help="the layout to write")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="keep",
        help="dtype of the written weights ('keep': as stored in HEAD_DIR)",
    )
    p.add_argument(
        "--overwrite",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="replace the files of an OUT_DIR that is not empty",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check HEAD_DIR's weights against the sha256 recorded when they were written",
    )
    return p


def check_output(head: str, out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """The output directory, checked before any work: not a file, not the input, new or empty
    (or ``overwrite``), and its parent writable."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"OUT_DIR {out} is a file; pass a directory to write the exported head into.",
            param="out_dir",
        )
    src = Path(head).expanduser()
    if src.exists() and out.exists() and src.resolve() == out.resolve():
        raise ConfigError(
            f"OUT_DIR {out} is HEAD_DIR itself; write the export into another directory.",
            param="out_dir",
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"OUT_DIR {out} exists and is not empty; pass --overwrite to replace its files, or choose "
            f"another directory.",
            param="out_dir",
        )
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise ConfigError(
            f"cannot create OUT_DIR {out}: {parent} is not writable.", param="out_dir"
        )
    return out


def export_head(
    head,
    out_dir,
    fmt: str = "apple",
    dtype: str = "keep",
    overwrite: bool = False,
    verify: bool = True,
) -> Path:
    """Export the drafter artifact ``head`` into ``out_dir`` in layout ``fmt``; returns ``out_dir``.

    Raises:
        ConfigError: a bad argument, or a head the layout cannot express (says what to change).
        ArtifactError: ``head`` is missing or not an exact drafter artifact.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {list(FORMATS)}.", param="format")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {list(DTYPES)}.", param="dtype")
    out = check_output(head, out_dir, overwrite)
    from redraft.models import apple
    from redraft.models.drafter_io import read_drafter
    from redraft.utils import resolve_dtype

    model = read_drafter(head, verify=verify)
    apple.check_exportable(model.config)
    return apple.write_apple(
        model,
        out,
        dtype=None if dtype == "keep" else resolve_dtype(dtype),
        readme=model_card(model.config, head),
    )


def model_card(config, head) -> str:
    """A short README.md for the exported directory: what it is and where it came from."""
    return (
        f"# ReDrafter draft head (Apple ml-recurrent-drafter layout)\n\n"
        f"Exported by `redraft-export` from `{head}`: a ReDrafter head (Zhang et al., 2024) for "
        f"`{config.target_model}`, hidden size {config.hidden_size}, {config.num_layers} residual blocks, "
        f"rnn={str(config.rnn).lower()}, trained to draft {config.num_steps} tokens.\n\n"
        f"`config.json` and `model.safetensors` follow apple/ml-recurrent-drafter's `DrafterConfig`/`Drafter` "
        f"(the input of TensorRT-LLM's `examples/redrafter/convert_checkpoint.py`); the `redraft` entry of "
        f"`config.json` lets `redraft.models.load_drafter` read it back exactly.\n"
    )


def next_commands(out: Path, config) -> str:
    """The TensorRT-LLM commands that follow an export (text to print).

    TensorRT-LLM's ReDrafter converter (``examples/redrafter/convert_checkpoint.py``) takes the
    target as an already converted TensorRT-LLM checkpoint (``--base_model_checkpoint_dir``), not
    as a Hugging Face directory, and accepts Llama (``LlamaForCausalLM``) and Qwen
    (``QWenForCausalLM``, ``Qwen2ForCausalLM``) targets: the first command converts the target
    with its family's own converter, the second adds the head.
    """
    o = shlex.quote(str(out))
    base, ckpt, engine = (
        shlex.quote(f"{out}-{s}") for s in ("tllm-base-ckpt", "tllm-ckpt", "trt-engine")
    )
    target = shlex.quote(config.target_model) if config.target_model else "TARGET_HF_DIR"
    n = config.num_steps
    return "\n".join(
        [
            f"{PROG}: wrote {out} (apple/ml-recurrent-drafter layout: config.json, model.safetensors)",
            "next, for TensorRT-LLM (its ReDrafter converter reads Llama, Qwen and Qwen2 targets):",
            "  # 1. the target as a TensorRT-LLM checkpoint, from examples/models/core/llama",
            "  #    (examples/models/core/qwen for a Qwen or Qwen2 target):",
            f"  python convert_checkpoint.py --model_dir {target} --output_dir {base} --dtype bfloat16",
            "  # 2. the head on top of it, from examples/redrafter:",
            f"  python convert_checkpoint.py --base_model_checkpoint_dir {base} --drafter_model_dir {o} \\",
            f"      --output_dir {ckpt} --dtype bfloat16 --redrafter_num_beams 5 --redrafter_draft_len_per_beam {n}",
            f"      (--redrafter_draft_len_per_beam <= {n}, the head's training horizon num_steps)",
            f"  trtllm-build --checkpoint_dir {ckpt} --output_dir {engine} --gemm_plugin bfloat16 \\",
            "      --speculative_decoding_mode explicit_draft_tokens --max_batch_size 4",
            "note: TensorRT-LLM's own recurrence (Drafter.rnn_embed) may differ from Apple's; see the Export "
            "section of docs/train.md before serving an rnn=true head there.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def work() -> None:
        check_output(args.head, args.out_dir, args.overwrite)  # before loading torch or any weights
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr carries one line on error, nothing else
        out = export_head(
            args.head,
            args.out_dir,
            fmt=args.format,
            dtype=args.dtype,
            overwrite=args.overwrite,
            verify=args.verify,
        )
        from redraft.models.apple import config_from_apple
        from redraft.models.artifact import read_config_json
        from redraft.models.redrafter import ReDrafterConfig

        print(next_commands(out, config_from_apple(read_config_json(out), out, ReDrafterConfig)))

    return run_cli(
        PROG, work, interrupted=f"{args.out_dir} was not written (or keeps its previous files)."
    )


if __name__ == "__main__":
    sys.exit(main())

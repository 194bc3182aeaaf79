"""A trained drafter artifact as safetensors shards small enough for the GPU tool, and back.

    python dev/gpu/gpu_head.py split RUN_DIR SHARD_DIR [--max-mib 15] [--dtype bfloat16]
    python dev/gpu/gpu_head.py join SHARD_FILES_OR_DIRS... --out ARTIFACT_DIR

The command runner returns files of at most 16 MiB; the default head (full SmolLM2 vocabulary) has
a 49152 x 1152 output layer, 113 MB even in bfloat16, so tensors are cut along their first
dimension. ``split`` writes ``head-00001-of-0000N.safetensors`` ...: each one a plain safetensors
file of whole tensors or row slices, named ``<tensor>@<row start>``; its metadata holds the
artifact's ``config.json`` and ``metrics.json``, the ``head_id`` (a hash of both and of the
shard table) and the shard table (tensor -> full shape, dtype). ``join`` checks that every shard
of one head is there, puts the rows back together and writes a drafter artifact
(``config.json``, ``model.safetensors``, ``metrics.json``) that ``load_drafter`` reads; its
``config.json`` records the joined weights' own ``weights_sha256``.
Weights are stored in ``--dtype`` (bfloat16 by default: the decoder casts the head to the
target's dtype anyway; pass float32 for an exact copy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

MIB = 1 << 20
HEADER_SLACK = 64 * 1024  # safetensors header with our metadata stays far below this
SHA_KEY = (
    "weights_sha256"  # config.json: {weights file: sha256}, as redraft.models.artifact.SHA_KEY
)


def split(
    run_dir: Path, out_dir: Path, max_mib: float = 15.0, dtype: str = "bfloat16"
) -> list[Path]:
    """Write the shards of the artifact in ``run_dir`` into ``out_dir``; returns their paths."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(run_dir / "model.safetensors"))
    config = (run_dir / "config.json").read_text()
    metrics = (
        (run_dir / "metrics.json").read_text() if (run_dir / "metrics.json").is_file() else "{}"
    )
    cast = getattr(torch, dtype)
    limit = int(max_mib * MIB) - min(HEADER_SLACK, int(max_mib * MIB) // 4)
    pieces = []  # (key, tensor): whole tensors or row slices, each at most `limit` bytes
    table = {}
    for name in sorted(state):
        t = state[name]
        t = t.to(cast) if t.is_floating_point() else t
        table[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        row_bytes = t[0].numel() * t.element_size() if t.dim() else t.element_size()
        rows = max(1, limit // max(row_bytes, 1)) if t.dim() else 1
        if t.dim() == 0 or t.shape[0] <= rows:
            pieces.append((f"{name}@0", t.contiguous()))
        else:
            for a in range(0, t.shape[0], rows):
                pieces.append((f"{name}@{a}", t[a : a + rows].contiguous()))
    shards, cur, size = [], {}, 0
    for key, t in pieces:  # first fit in order: rows of one tensor stay in order
        b = t.numel() * t.element_size()
        if cur and size + b > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[key] = t
        size += b
    if cur:
        shards.append(cur)
    head_id = hashlib.sha256(
        (config + metrics + json.dumps(table, sort_keys=True)).encode()
    ).hexdigest()[:16]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, sh in enumerate(shards, 1):
        p = out_dir / f"head-{i:05d}-of-{len(shards):05d}.safetensors"
        meta = {
            "format": "pt",
            "redraft_head_id": head_id,
            "shard": str(i),
            "shards": str(len(shards)),
            "config": config,
            "metrics": metrics,
            "table": json.dumps(table),
        }
        save_file(sh, str(p), metadata=meta)
        if p.stat().st_size > max_mib * MIB:
            raise ValueError(
                f"{p} is {p.stat().st_size / MIB:.2f} MiB, above {max_mib}; lower --max-mib."
            )
        paths.append(p)
    return paths


def join(files: list[Path], out_dir: Path) -> Path:
    """Rebuild the artifact from shard files (all of one head); returns ``out_dir``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    heads: dict[str, dict[int, Path]] = {}
    metas = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            m = sf.metadata() or {}
        if "redraft_head_id" not in m:
            raise ValueError(f"{f} is not a head shard written by `gpu_head.py split`.")
        heads.setdefault(m["redraft_head_id"], {})[int(m["shard"])] = f
        metas[m["redraft_head_id"]] = m
    if len(heads) != 1:
        raise ValueError(
            f"the files hold shards of {len(heads)} different heads ({sorted(heads)}); pass one head's."
        )
    ((hid, got),) = heads.items()
    meta = metas[hid]
    n = int(meta["shards"])
    missing = sorted(set(range(1, n + 1)) - set(got))
    if missing:
        raise ValueError(
            f"head {hid}: shards {missing} of {n} are missing "
            f"(head-{missing[0]:05d}-of-{n:05d}.safetensors ...)."
        )
    table = json.loads(meta["table"])
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for i in range(1, n + 1):
        with safe_open(str(got[i]), "pt") as sf:
            for key in sf.keys():
                name, start = key.rsplit("@", 1)
                parts.setdefault(name, []).append((int(start), sf.get_tensor(key)))
    state = {}
    for name, spec in table.items():
        chunks = [t for _, t in sorted(parts.get(name, []), key=lambda x: x[0])]
        if not chunks:
            raise ValueError(f"head {hid}: no rows of {name} in the shards.")
        t = (
            chunks[0]
            if len(chunks) == 1 and list(chunks[0].shape) == spec["shape"]
            else torch.cat(chunks)
        )
        if list(t.shape) != spec["shape"]:
            raise ValueError(
                f"head {hid}: {name} has shape {list(t.shape)} after joining, expected {spec['shape']}."
            )
        state[name] = t
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    # the shards hold the weights in --dtype (bf16 by default), so the joined file is not the
    # one whose sha256 the trained head's config.json recorded: record the joined file's own,
    # which load_drafter checks
    config = json.loads(meta["config"])
    config[SHA_KEY] = {weights.name: sha256_file(weights)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "metrics.json").write_text(meta["metrics"])
    return out_dir


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu_head.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "split", help="artifact -> shards", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    s.add_argument("run_dir", help="drafter artifact (config.json + model.safetensors)")
    s.add_argument("out_dir", help="folder for the shards")
    s.add_argument("--max-mib", type=float, default=15.0, help="largest shard file")
    s.add_argument("--dtype", default="bfloat16", help="dtype of the stored floating-point weights")
    j = sub.add_parser(
        "join", help="shards -> artifact", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    j.add_argument("shards", nargs="+", help="shard files, or folders holding them")
    j.add_argument("--out", required=True, help="artifact folder to write")
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            paths = split(Path(args.run_dir), Path(args.out_dir), args.max_mib, args.dtype)
            print(
                f"{len(paths)} shards in {args.out_dir}: "
                + ", ".join(f"{x.name} ({x.stat().st_size / MIB:.1f} MiB)" for x in paths)
            )
        else:
            files = [
                f
                for s in args.shards
                for f in (
                    sorted(Path(s).glob("head-*.safetensors")) if Path(s).is_dir() else [Path(s)]
                )
            ]
            out = join(files, Path(args.out))
            print(f"joined {len(files)} shards into {out}")
    except (OSError, ValueError) as exc:
        print(f"gpu_head.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

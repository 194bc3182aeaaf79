"""The model card of a published artifact (``README.md``), built with huggingface_hub's
``ModelCard`` / ``ModelCardData`` from the template shipped as ``redraft/hub/card.md``.

It reads exactly what the stages wrote: for a drafter ``config.json``, ``run_config.yaml`` and
``metrics.json`` (redraft-train), for n-gram tables ``ngrams.json`` (redraft-build-ngrams), and
optionally ``bench.json`` (``redraft-bench --out``). Metadata: ``base_model`` (the target),
``base_model_relation``, ``tags``, ``datasets``, and ``eval_results`` (held-out tau_est and
per-position accuracy). :func:`write_model_card` is the one card writer (the trainer calls it
for its run directory; ``redraft-push`` uploads the card it generates).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from redraft.errors import ArtifactError
from redraft.hub.resolve import (
    BENCH_FILE,
    CARD_FILE,
    KIND_DRAFTER,
    METRICS_FILE,
    NGRAMS_FILE,
    RUN_CONFIG_FILE,
    looks_like_repo_id,
    read_json,
    require_kind,
    safetensors_header,
)
from redraft.utils import atomic_write_text, split_revision

CARD_TEMPLATE = (
    "card.md"  # Jinja, shipped with the package (huggingface_hub.ModelCard.from_template)
)
# Data specs (redraft.data grammar) that name a Hub dataset, and the embedded default's source.
DEFAULT_DATASETS = {"default-chat": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
HUB_DATA_KINDS = ("sharegpt", "ultrachat", "stack")

# Per-position lists of the trainer's metrics.json (redraft.train.losses.EvalAccumulator).
POSITION_METRICS = {
    "eval_top1": "top-1 (data)",
    "eval_top5": "top-5 (data)",
    "eval_top1_target": "top-1 (target greedy)",
    "eval_top5_target": "top-5 (target greedy)",
    "eval_chain_acc": "chain acceptance",
}
# config.json keys that say nothing about the head (PretrainedConfig boilerplate, target fields).
_CONFIG_NOISE = {
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "model_type",
    "auto_map",
    "tie_word_embeddings",
    "tokenizer_fingerprint",
    "target_model",
    "return_dict",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
}


def _fmt(value) -> str:
    if value is None or isinstance(value, bool):
        return "-" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> str:
    return "\n".join(
        [
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
            *("| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows),
        ]
    )


def _hub_repo(value) -> str | None:
    """``value`` without ``@revision`` if it reads as an ``org/name`` Hub id and is no local path."""
    if not isinstance(value, str) or os.path.isabs(value) or os.path.exists(value):
        return None
    repo = split_revision(value)[0]
    return repo if "/" in repo and looks_like_repo_id(repo) else None


def dataset_ids(specs) -> list[str]:
    """Hub dataset ids named by :mod:`redraft.data` specs (``[WEIGHT*]KIND[:ARG][?OPTIONS]`` joined
    by ``,``; a string, a list, or dicts with a ``spec`` key), for the card's ``datasets``.

    ``sharegpt:`` / ``ultrachat:`` / ``stack:`` with a Hub id give that id, ``default-chat`` the
    ShareGPT dataset it ships; local files, ``code-dir:`` and ``default-code`` are left out.
    """
    out: list[str] = []
    for item in specs if isinstance(specs, (list, tuple)) else [specs] if specs else []:
        for comp in str(item.get("spec", "") if isinstance(item, dict) else item).split(","):
            comp = comp.split("?", 1)[0].strip()
            weight, star, rest = comp.partition("*")
            if star and weight.strip().replace(".", "", 1).isdigit():  # "0.7*default-chat"
                comp = rest.strip()
            kind, _, arg = comp.partition(":")
            ds = DEFAULT_DATASETS.get(kind) or (_hub_repo(arg) if kind in HUB_DATA_KINDS else None)
            if ds and ds not in out:
                out.append(ds)
    return out


def _metrics_section(m: dict) -> str:
    """Per-position table, tau_est and the run's scalars, from the trainer's metrics.json."""
    cols = {k: v for k, v in POSITION_METRICS.items() if isinstance(m.get(k), list)}
    rows = [
        [i + 1, *(m[k][i] if i < len(m[k]) else None for k in cols)]
        for i in range(max((len(m[k]) for k in cols), default=0))
    ]
    parts = (
        [
            "Per draft position (1 = the first token after the target's own; 'data' is the held-out "
            "data's next token, 'target greedy' the target's own choice):\n\n"
            + _table(["position", *cols.values()], rows)
        ]
        if rows
        else []
    )
    if "eval_tau_est" in m:
        parts.append(
            f"**Estimated acceptance length tau_est = {_fmt(m['eval_tau_est'])}** tokens per target "
            f"call (`1 + sum_k chain_acc_k`: each position's chain accuracy taken as its acceptance rate)."
        )
    scalars = [
        [k, v] for k, v in m.items() if k != "eval_tau_est" and isinstance(v, (int, float, str))
    ]
    return "\n\n".join(parts + ([_table(["metric", "value"], scalars)] if scalars else []))


def _bench_section(root: Path) -> str | None:
    """The table of ``bench.json`` as ``redraft-bench --out`` writes it (results -> data -> method)."""
    bench = read_json(root / BENCH_FILE) if (root / BENCH_FILE).is_file() else {}
    rows = [
        [
            ds,
            name,
            r.get("tokens_per_call"),
            r.get("tokens_per_s"),
            r.get("speedup_vs_ar"),
            r.get("identical_to_ar"),
        ]
        for ds, res in (bench.get("results") or {}).items()
        for name, r in res.items()
    ]
    return (
        (
            f"`redraft-bench` on {bench.get('device', 'an unrecorded device')} (`{BENCH_FILE}`), every method in "
            f"the same process as plain greedy decoding of the same target:\n\n"
            + _table(
                [
                    "data",
                    "method",
                    "tokens / call",
                    "tokens / s",
                    "speedup vs greedy",
                    "identical to greedy",
                ],
                rows,
            )
        )
        if rows
        else None
    )


def _eval_results(m: dict, data, datasets: list[str]) -> list[EvalResult]:
    """Held-out tau_est and per-position top-1 accuracy as model-index entries."""
    common = dict(
        task_type="text-generation",
        task_name="Speculative decoding (draft acceptance)",
        dataset_type=datasets[0] if datasets else "local",
        dataset_name=f"held-out split of {data or 'the training data'}",
    )
    out = (
        [
            EvalResult(
                **common,
                metric_type="tau_est",
                metric_value=m["eval_tau_est"],
                metric_name="estimated tokens per target call",
            )
        ]
        if "eval_tau_est" in m
        else []
    )
    return out + [
        EvalResult(
            **common,
            metric_type="accuracy",
            metric_value=acc,
            metric_config=f"position-{i}",
            metric_name=f"top-1 accuracy, draft position {i}",
        )
        for i, acc in enumerate(m.get("eval_top1") or [], 1)
    ]


def generate_model_card(
    artifact_dir: str | os.PathLike,
    *,
    repo_id: str | None = None,
    license: str = "apache-2.0",
    base_model: str | None = None,
) -> str:
    """The Hub model card (``README.md`` text) of a drafter or n-gram artifact.

    Reads the manifest (``config.json`` / ``ngrams.json``), for a drafter what the trainer wrote
    beside it (``run_config.yaml``: data, recipe; ``metrics.json``: held-out accuracy per position,
    ``eval_tau_est``), and ``bench.json`` if present. ``repo_id`` names the card and the usage
    snippet; ``base_model`` overrides the recorded target. The front matter
    (``huggingface_hub.ModelCardData``): ``library_name``, ``base_model`` with
    ``base_model_relation`` (target is a Hub id), ``tags``, ``license``, ``datasets`` (Hub ids
    only), ``model-index`` (held-out tau_est and per-position top-1 accuracy).
    """
    root = Path(artifact_dir)
    kind = require_kind(root)
    drafter = kind == KIND_DRAFTER
    meta = read_json(root / ("config.json" if drafter else NGRAMS_FILE))
    run, metrics = _run_files(root) if drafter else ({}, {})
    target = str(base_model or meta.get("target_model") or "") or None
    base, name = _hub_repo(target), repo_id or root.resolve().name
    data = run.get("data") if drafter else (meta.get("trigram") or {}).get("data")
    datasets = dataset_ids(data)
    evals = _eval_results(metrics, data, datasets)
    kinds = set(meta.get("kinds") or ())
    tags = [
        "redraft",
        "speculative-decoding",
        *(
            ["redrafter", "draft-model"]
            if drafter
            else [
                "n-gram",
                *(["n-grammys"] if kinds & {"unigram", "bigram", "extended"} else []),
                *(["aded"] if "trigram" in kinds else []),
            ]
        ),
    ]
    # A head or a table set only runs together with its target: the Hub's "adapter" relation.
    card_data = ModelCardData(
        library_name="redraft",
        license=license,
        base_model=base,
        base_model_relation="adapter" if base else None,
        tags=tags,
        datasets=datasets or None,
        model_name=name if evals else None,
        eval_results=evals or None,
    )
    link = (
        f"[`{base}`](https://huggingface.co/{base})"
        if base
        else f"`{target or 'an unrecorded target'}`"
    )
    return str(
        ModelCard.from_template(
            card_data,
            template_str=(files(__package__) / CARD_TEMPLATE).read_text(),
            name=name,
            kind=kind,
            target=target or "TARGET",
            target_link=link,
            repo=repo_id or str(root),
            sections=_sections(root, kind, meta, run, metrics, target, data, datasets),
        )
    )


def _run_files(root: Path) -> tuple[dict, dict]:
    """(run_config.yaml, metrics.json) of a training run, each {} when absent."""
    try:
        run = (
            yaml.safe_load((root / RUN_CONFIG_FILE).read_text())
            if (root / RUN_CONFIG_FILE).is_file()
            else {}
        )
    except yaml.YAMLError as exc:
        raise ArtifactError(
            f"{root / RUN_CONFIG_FILE} is not valid YAML ({exc}); fix or delete it."
        ) from exc
    return run or {}, read_json(root / METRICS_FILE) if (root / METRICS_FILE).is_file() else {}


def _sections(root, kind, meta, run, metrics, target, data, datasets) -> list[tuple[str, str]]:
    """The card's (heading, markdown) sections between its summary and its usage."""
    drafter = kind == KIND_DRAFTER
    out = [_target_section(meta, target)]
    out.append(_architecture_section(meta) if drafter else _tables_section(root, meta))
    out.append(_data_section(data, datasets, drafter))
    recipe = run if drafter else meta.get("build_args")
    if recipe:
        out.append(_recipe_section(recipe, drafter))
    if metrics:
        out.append(("Held-out metrics", _metrics_section(metrics)))
    if bench := _bench_section(root):
        out.append(("Benchmark", bench))
    return out


def _target_section(meta: dict, target) -> tuple[str, str]:
    """The target the artifact was made for, and its tokenizer fingerprint."""
    return (
        "Target model",
        _table(
            ["field", "value"],
            [["model", target or "unknown"]]
            + [
                [k, meta[k]]
                for k in ("target_vocab_size", "target_hidden_size", "tokenizer_fingerprint")
                if k in meta
            ],
        )
        + "\n\nredraft refuses to load this artifact with a target whose tokenizer fingerprint differs.",
    )


def _architecture_section(meta: dict) -> tuple[str, str]:
    """A drafter's settings."""
    return (
        "Architecture",
        _table(
            ["setting", "value"],
            [
                [k, v]
                for k, v in meta.items()
                if k not in _CONFIG_NOISE
                and not k.startswith(("_", "target_"))
                and isinstance(v, (int, float, str, bool))
            ],
        ),
    )


def _tables_section(root: Path, meta: dict) -> tuple[str, str]:
    """N-gram tables' settings and the tensors of their files."""
    settings = [
        [k, v]
        for k, v in meta.items()
        if isinstance(v, (int, float, str, bool, list))
        and k != "tokenizer_fingerprint"
        and not k.startswith("target_")
    ]
    tensors = [
        [info["file"], t, "x".join(map(str, shape)), dtype]
        for info in (meta.get("files") or {}).values()
        if (root / info["file"]).is_file()
        for t, (shape, dtype) in safetensors_header(root / info["file"]).items()
    ]
    return (
        "Tables",
        _table(["setting", "value"], settings)
        + "\n\n"
        + _table(["file", "tensor", "shape", "dtype"], tensors),
    )


def _data_section(data, datasets: list[str], drafter: bool) -> tuple[str, str]:
    """The data the artifact was made from, with links to its Hub datasets."""
    links = ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in datasets)
    return (
        "Training data" if drafter else "Data",
        f"`{data}`" + (f"\n\nHub datasets: {links}" if links else "")
        if data
        else "Not recorded with this artifact."
        if drafter
        else "Model-derived tables use no data: they come from the target's weights alone.",
    )


def _recipe_section(recipe: dict, drafter: bool) -> tuple[str, str]:
    """The resolved training configuration (a drafter) or the build arguments (tables)."""
    where = (
        f"The resolved training configuration (`{RUN_CONFIG_FILE}`)"
        if drafter
        else "Build arguments"
    )
    return (
        "Recipe",
        f"{where}:\n\n```yaml\n{yaml.safe_dump(recipe, sort_keys=False).strip()}\n```",
    )


def write_model_card(artifact_dir: str | os.PathLike, **kwargs) -> Path:
    """Write :func:`generate_model_card` (keyword arguments go to it) to ``artifact_dir/README.md``
    atomically and return its path; the trainer calls it when it finishes (redraft-push generates
    the card of any artifact at upload)."""
    path = Path(artifact_dir) / CARD_FILE
    atomic_write_text(path, generate_model_card(artifact_dir, **kwargs))
    return path

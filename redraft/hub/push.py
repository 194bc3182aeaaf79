"""Publish a finished redraft artifact to the Hugging Face Hub: the finished-artifact check, the
push (``huggingface_hub.HfApi.create_commit``, which retries transient errors itself, so this
module adds no retries) and ``redraft-push``.

What it adds to the Hub's client is what the Hub cannot know: which files make a finished
artifact (:mod:`redraft.hub.resolve`'s manifests) and a card built from what the trainer and the
n-gram builder wrote (:mod:`redraft.hub.card`). Its check of a drafter loads it with
:mod:`redraft.models`, so this module sits in the ``hub`` stage; the other two are shared.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import (
    HFValidationError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects, validate_repo_id

from redraft.cli import run_cli
from redraft.errors import ArtifactError
from redraft.hub.card import generate_model_card
from redraft.hub.resolve import (
    CARD_FILE,
    KIND_DRAFTER,
    KIND_NGRAMS,
    METRICS_FILE,
    NGRAMS_FILE,
    RUN_CONFIG_FILE,
    first_line,
    hub_offline,
    manifest,
    read_json,
    require_kind,
    safetensors_header,
)
from redraft.utils import ArgumentParser, HelpFormatter, atomic_write_text, split_revision

# metrics.json "status" of a run that ended normally: every step done, or --max-time-minutes reached.
FINISHED_STATUSES = ("completed", "time_budget")
# Weights of an earlier push that this one does not upload again are deleted in the same commit.
STALE_WEIGHTS = ["*.safetensors", "*.safetensors.index.json"]


def check_finished(artifact_dir: str | os.PathLike, *, allow_unfinished: bool = False) -> str:
    """The kind of the finished artifact in ``artifact_dir``, else ArtifactError saying what to do.

    Finished: no ``*.tmp*`` entry in the directory (a save is running); every file the manifest
    names present (a drafter: ``config.json`` + ``model.safetensors`` or an index and every
    shard; tables: every file ``ngrams.json`` lists, at the size it records); every safetensors
    file complete; and a training run (``run_config.yaml`` or ``metrics.json`` present) ended
    normally (status in :data:`FINISHED_STATUSES`), unless ``allow_unfinished``.
    """
    root = Path(artifact_dir)
    if not root.is_dir():
        raise ArtifactError(f"Artifact directory {root} does not exist or is not a directory.")
    partial = sorted(p.name for p in root.iterdir() if ".tmp" in p.name)
    if partial:
        raise ArtifactError(
            f"{root} holds partial files ({', '.join(partial[:5])}): a save is still running "
            f"or was interrupted. Wait for it to finish (or resume the run) and push again; "
            f"delete them if you are sure they are leftovers."
        )
    kind = require_kind(root)
    required = manifest(root, kind)[0]
    missing = [f for f in required if not (root / f).is_file()]
    if missing:
        fix = (
            "the drafter was not saved completely. Wait for training to finish or re-run its final save"
            if kind == KIND_DRAFTER
            else f"the build did not finish. Re-run redraft-build-ngrams into {root}"
        )
        raise ArtifactError(f"{root} has {required[0]} but no {', '.join(missing)}: {fix}.")
    for f in (f for f in required if f.endswith(".safetensors")):
        safetensors_header(root / f)
    for info in read_json(root / NGRAMS_FILE)["files"].values() if kind == KIND_NGRAMS else ():
        if info.get("bytes") not in (None, (root / info["file"]).stat().st_size):
            raise ArtifactError(
                f"{root / info['file']} is not the size {NGRAMS_FILE} records ({info['bytes']} "
                f"bytes): it changed after the build. Re-run redraft-build-ngrams into {root}."
            )
    if kind == KIND_DRAFTER:
        # the weights hold exactly the tensors the config says, and the recorded sha256 (headers
        # only, no weights loaded): a broken head is not published. Imported here (torch and
        # transformers load only when a drafter is pushed, not for `redraft-push --help`).
        from redraft.models.redrafter import check_artifact

        check_artifact(root)
        if not allow_unfinished:
            _check_run_ended(root)
    return kind


def _check_run_ended(root: Path) -> None:
    """A training run in ``root`` (run_config.yaml or metrics.json) must have ended normally."""
    if (root / METRICS_FILE).is_file():
        m = read_json(root / METRICS_FILE)
        if m.get("status") in FINISHED_STATUSES:
            return
        what = (
            f"its {METRICS_FILE} has status {m.get('status')!r} at step {m.get('global_step')} of "
            f"{m.get('total_steps')}"
        )
    elif (root / RUN_CONFIG_FILE).is_file():
        what = f"it has {RUN_CONFIG_FILE} but no {METRICS_FILE}"
    else:
        return  # a head saved with save_pretrained, not by a training run
    raise ArtifactError(
        f"{root} holds an unfinished training run ({what}). Resume it with `redraft-train "
        f"--output-dir {root} --resume` and push when it finishes, or pass --allow-unfinished "
        f"to publish these weights anyway."
    )


def upload_files(artifact_dir: str | os.PathLike, include=()) -> list[str]:
    """Relative paths :func:`push_artifact` uploads: the files the manifest names, the optional run
    files that exist (metrics, run config, bench, card), and files matching a glob of ``include``."""
    root = Path(artifact_dir)
    required, optional = manifest(root, require_kind(root))
    files = required + [f for f in optional if (root / f).is_file()]
    every = (
        sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        if include
        else []
    )
    return files + [
        f for f in filter_repo_objects(every, allow_patterns=list(include)) if f not in files
    ]


# --- Upload ------------------------------------------------------------------------------------


def push_artifact(
    artifact_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    license: str = "apache-2.0",
    keep_card: bool = False,
    allow_unfinished: bool = False,
    include=(),
) -> str:
    """Publish a finished artifact to the Hub in one commit; return the repo URL
    (``.../tree/<revision>`` for a branch other than main).

    In order: :func:`check_finished` (``allow_unfinished`` publishes a run that did not end
    normally) before any Hub call; a fresh card (``keep_card``: the directory's README.md as it
    is); the repo (``private``) and branch ``revision`` created if missing; one
    ``HfApi.create_commit`` of :func:`upload_files` (``include``: extra globs such as
    ``"tensorboard/**"``) and the card as bytes, deleting weights of an earlier push that this
    one does not replace. huggingface_hub retries transient errors. ``token``: default HF_TOKEN
    or ``hf auth login``. The directory is written only after the commit, and only its card.
    Raises ArtifactError if the artifact is not finished or a step failed (naming the step).
    """
    root = Path(artifact_dir)
    repo_id, revision = _repo_and_revision(repo_id, revision)
    kind = check_finished(root, allow_unfinished=allow_unfinished)
    files = upload_files(root, include)
    if keep_card and CARD_FILE not in files:
        raise ArtifactError(f"--keep-card was given but {root / CARD_FILE} does not exist.")
    card = None if keep_card else generate_model_card(root, repo_id=repo_id, license=license)
    # Table files must still be what the build recorded; op.upload_info.sha256 hashes a file on first
    # use and keeps the digest for the upload.
    ops = [
        CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(root / f))
        for f in files
        if keep_card or f != CARD_FILE
    ]
    _check_recorded_digests(root, kind, ops)
    if card is not None:
        ops.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card.encode()))
    if hub_offline():
        raise ArtifactError(
            f"Cannot push {root} to {repo_id!r}: HF_HUB_OFFLINE is set, which blocks every "
            f"Hub request. Unset it (HF_HUB_OFFLINE=0) to push."
        )
    url = _commit(root, repo_id, revision, ops, files, kind, private, token, commit_message)
    if card is not None:
        atomic_write_text(root / CARD_FILE, card)
    return str(url).rstrip("/") + (f"/tree/{revision}" if revision not in (None, "main") else "")


def _repo_and_revision(repo_id, revision: str | None) -> tuple[str, str | None]:
    """The repo id checked and the revision (given, or after ``@`` in the repo id; not both)."""
    repo_id, at = split_revision(str(repo_id))
    if revision and at and revision != at:
        raise ArtifactError(f"Two revisions given: {at!r} in the repo id and {revision!r}.")
    revision = revision or at
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ArtifactError(f"{repo_id!r} is not a Hub repo id ({exc}); use 'org/name'.") from exc
    return repo_id, revision


def _check_recorded_digests(root: Path, kind: str, ops: list) -> None:
    """Raise if a table file no longer has the sha256 its build recorded in ngrams.json."""
    recorded = (
        {v["file"]: v.get("sha256") for v in read_json(root / NGRAMS_FILE)["files"].values()}
        if kind == KIND_NGRAMS
        else {}
    )
    for op in ops:
        if (
            recorded.get(op.path_in_repo)
            and recorded[op.path_in_repo] != op.upload_info.sha256.hex()
        ):
            raise ArtifactError(
                f"{root / op.path_in_repo} does not match its sha256 in {NGRAMS_FILE}: it "
                f"changed after the build. Re-run redraft-build-ngrams into {root}."
            )


def _commit(root, repo_id, revision, ops, files, kind, private, token, commit_message):
    """The repo and branch created if missing, then one commit of ``ops`` that also deletes the
    stale weights of an earlier push; the repo URL. A failure names its step."""
    api, step = HfApi(token=token), "repo creation"
    try:
        url = api.create_repo(
            repo_id, private=private or None, exist_ok=True
        )  # None: the org's default
        if revision not in (None, "main"):
            step = f"branch creation ({revision!r})"
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        step = "upload"
        stale = filter_repo_objects(
            api.list_repo_files(repo_id, revision=revision), allow_patterns=STALE_WEIGHTS
        )
        api.create_commit(
            repo_id,
            ops + [CommitOperationDelete(f) for f in stale if f not in files],
            commit_message=commit_message or f"Upload redraft {kind} artifact",
            revision=revision,
        )
    except Exception as exc:  # any failure of the Hub client: say which step, why and what to do
        raise _push_error(step, repo_id, exc, root) from exc
    return url


def _push_error(step: str, repo_id: str, exc: BaseException, root: Path) -> ArtifactError:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, OfflineModeIsEnabled):
        how = "HF_HUB_OFFLINE is set, which blocks every Hub request: unset it (HF_HUB_OFFLINE=0) to push"
    elif status in (401, 403) or isinstance(exc, LocalTokenNotFoundError):
        how = (
            f"authentication failed: log in with `hf auth login`, set HF_TOKEN, or pass --token with a "
            f"token that has write access to {repo_id.split('/')[0]}"
        )
    elif status == 404 or isinstance(exc, RepositoryNotFoundError):
        how = f"the repo or namespace was not found: check {repo_id!r} and that you may write to it"
    elif (
        status in (408, 429)
        or (status or 0) >= 500
        or isinstance(exc, (ConnectionError, TimeoutError))
        or type(exc).__module__.startswith(("httpx", "httpcore"))
    ):
        how = (
            "the Hub did not answer (huggingface_hub retries transient upload errors before it gives up): "
            "check the network (HF_ENDPOINT) and push again; files the Hub already has are not sent twice"
        )
    else:
        how = "the Hub refused it"
    return ArtifactError(
        f"Pushing {root} to {repo_id!r} failed at {step}: {how}. ({first_line(exc)}) "
        f"Local files were not changed."
    )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-push",
        formatter_class=HelpFormatter,
        description="Publish a finished redraft artifact (a ReDrafter head or n-gram tables) to the Hugging "
        "Face Hub in one commit: the files its manifest names and a generated model card; resume "
        "state, logs and shard counts only if --include asks.",
    )
    p.add_argument(
        "artifact_dir",
        metavar="DIR",
        help="the artifact directory (config.json + "
        "model.safetensors, or ngrams.json + the tables it lists)",
    )
    p.add_argument(
        "repo_id", metavar="REPO_ID", help="'org/name' or 'org/name@branch' (created if missing)"
    )
    p.add_argument(
        "--private",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="create the repo private (an existing repo keeps its visibility)",
    )
    p.add_argument(
        "--revision", help="branch to push to, created from main if missing; default: main"
    )
    p.add_argument(
        "--token", help="Hub token with write access; default: HF_TOKEN or `hf auth login`"
    )
    p.add_argument("--commit-message", help="default: 'Upload redraft <kind> artifact'")
    p.add_argument(
        "--license",
        default="apache-2.0",
        help="license id for the card's metadata (use the target's license if it is stricter)",
    )
    p.add_argument(
        "--keep-card",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="upload DIR/README.md as it is instead of generating the card",
    )
    p.add_argument(
        "--allow-unfinished",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="publish a training run that did not end normally (metrics.json status "
        "'interrupted', or no metrics.json)",
    )
    p.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="also upload the files matching this glob relative to DIR, e.g. 'tensorboard/**' "
        "(repeatable)",
    )
    p.add_argument(
        "--print-card", action="store_true", help="print the generated card and exit (no Hub call)"
    )
    return p


def push_main(argv: list[str] | None = None) -> int:
    """``redraft-push DIR REPO_ID``: publish a finished drafter or n-gram artifact to the Hub."""
    args = build_parser().parse_args(argv)

    def work() -> None:
        if args.print_card:
            print(
                generate_model_card(
                    args.artifact_dir, repo_id=split_revision(args.repo_id)[0], license=args.license
                ),
                end="",
            )
            return
        url = push_artifact(
            args.artifact_dir,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            token=args.token,
            commit_message=args.commit_message,
            license=args.license,
            keep_card=args.keep_card,
            allow_unfinished=args.allow_unfinished,
            include=args.include or (),
        )
        print(f"Pushed {args.artifact_dir} to {url}")

    return run_cli("redraft-push", work, interrupted="a commit is all or nothing, so run it again")

"""redraft.hub: resolving REPO_ID[@rev] through a fake Hub cache, model cards, and pushes.

The real Hub is not reachable from CI: snapshots are laid out by hand in a temporary
HF_HUB_CACHE, and uploads go to a recording fake of ``HfApi``.
"""

import json
import os
from pathlib import Path

import httpx2
import pytest
import torch
import yaml
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from safetensors.torch import save_file

from redraft import hub
from redraft.errors import ArtifactError
from redraft.utils import split_revision

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------------------------------
# Fixtures: artifacts and a fake Hub cache
# ---------------------------------------------------------------------------------------------


def make_drafter(path: Path, *, metrics=True, recipe=True, bench=True, state=True) -> Path:
    """A small but real drafter artifact: ReDrafter.save_pretrained + the trainer's extras."""
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    config = ReDrafterConfig(hidden_size=16, vocab_size=64, num_layers=2, num_steps=3,
                             target_model=TARGET, tokenizer_fingerprint="fp-1234",
                             target_vocab_size=64, target_hidden_size=16)
    ReDrafter(config).save_pretrained(path)
    if metrics:
        (path / "metrics.json").write_text(json.dumps({
            "train_tokens_per_s": 1234.5,
            "eval_top1": [0.61, 0.42, 0.27],
            "eval_top5": [0.88, 0.70, 0.55],
            "eval_tau_est": 2.07,
        }))
    if recipe:
        (path / "resolved_config.yaml").write_text(yaml.safe_dump({
            "target": TARGET, "data": ["default-chat", "ultrachat:HuggingFaceH4/ultrachat_200k",
                                        "code-dir:/usr/lib/python3?glob=*.py"],
            "lr": 0.001, "epochs": 2, "zero_stage": 1,
        }))
    if bench:
        (path / "bench.json").write_text(json.dumps({
            "device": "cpu", "dtype": "float32",
            "methods": [
                {"method": "greedy", "tokens_per_call": 1.0, "tokens_per_s": 15.2,
                 "speedup_vs_ar": 1.0, "identical_to_ar": True},
                {"method": "redrafter", "tokens_per_call": 2.6, "tokens_per_s": 29.9,
                 "speedup_vs_ar": 1.97, "identical_to_ar": True},
            ]}))
    if state:
        (path / "training_state").mkdir()
        (path / "training_state" / "optimizer.pt").write_bytes(b"x" * 100)
        (path / "training_state" / "rng.pt.tmp").write_bytes(b"partial")
    return path


def make_ngrams(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({"ids": torch.zeros(64, 4, dtype=torch.int32),
               "probs": torch.zeros(64, 4, dtype=torch.float16)}, str(path / "bigram.safetensors"))
    (path / "ngrams.json").write_text(json.dumps({
        "kinds": ["bigram", "trigram"], "k": 4, "t": 12, "target_model": TARGET,
        "tokenizer_fingerprint": "fp-1234", "files": {"bigram": "bigram.safetensors"},
        "corpus_tokens": 1000, "build_args": {"data": "sharegpt:anon8231489123/ShareGPT_Vicuna_unfiltered"},
    }))
    return path


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    head, _, _ = card[4:].partition("\n---\n")
    return yaml.safe_load(head)


def snapshot_dir(cache: Path, repo_id: str, sha: str, refs: dict[str, str] | None = None) -> Path:
    """Lay out ``models--org--name/snapshots/<sha>/`` and ``refs/<name>`` like huggingface_hub."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snap = storage / "snapshots" / sha
    snap.mkdir(parents=True)
    (storage / "refs").mkdir(exist_ok=True)
    for ref, commit in (refs or {}).items():
        (storage / "refs" / ref).write_text(commit)
    return snap


def publish_to_cache(cache: Path, repo_id: str, sha: str, files: dict[str, bytes],
                     refs: dict[str, str]) -> Path:
    """What ``hf download`` leaves behind: content-addressed blobs, and a snapshot of symlinks."""
    import hashlib

    snap = snapshot_dir(cache, repo_id, sha, refs)
    blobs = snap.parents[1] / "blobs"
    blobs.mkdir(exist_ok=True)
    for rel, data in files.items():
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).symlink_to(os.path.relpath(blob, (snap / rel).parent))
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hub cache in tmp and offline mode, both in the env and in the import-time constants."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


# ---------------------------------------------------------------------------------------------
# resolve_artifact
# ---------------------------------------------------------------------------------------------


def test_local_directory_is_returned_as_is(tmp_path):
    art = make_drafter(tmp_path / "run", metrics=False, recipe=False, bench=False, state=False)
    assert hub.resolve_artifact(str(art)) == art
    assert hub.resolve_artifact(art, kind="drafter") == art


def test_snapshot_round_trip_main_and_revisions(offline_cache):
    sha_main, sha_v1 = "a" * 40, "b" * 40
    main = snapshot_dir(offline_cache, "org/head", sha_main, refs={"main": sha_main})
    make_drafter(main, state=False)
    v1 = snapshot_dir(offline_cache, "org/head", sha_v1, refs={"v1": sha_v1})
    make_ngrams(v1)

    got = hub.resolve_artifact("org/head", kind="drafter")
    assert got == main
    # The resolved snapshot loads like any local drafter directory.
    from redraft.models.redrafter import ReDrafter

    assert ReDrafter.from_pretrained(got).config.target_model == TARGET
    assert hub.resolve_artifact("org/head@v1", kind="ngrams") == v1       # a branch / tag ref
    assert hub.resolve_artifact(f"org/head@{sha_v1}") == v1                # a commit sha


def test_push_then_load_round_trip_through_hub_cache(tmp_path, offline_cache, no_sleep):
    """Push to a fake Hub, lay the uploaded files out as `hf download` would, load them back."""
    from redraft.models.redrafter import ReDrafter

    art = make_drafter(tmp_path / "run")
    api = FakeApi()
    hub.push_artifact(art, "org/head", revision="v1", api=api)
    sha = "e" * 40
    snap = publish_to_cache(offline_cache, "org/head", sha, api.uploaded, refs={"v1": sha})

    got = hub.resolve_artifact("org/head@v1", kind="drafter")
    assert got == snap and (got / "model.safetensors").is_symlink()
    assert not (got / "training_state").exists()
    loaded, original = ReDrafter.from_pretrained(got), ReDrafter.from_pretrained(art)
    for (name, a), (_, b) in zip(sorted(loaded.state_dict().items()),
                                 sorted(original.state_dict().items())):
        assert torch.equal(a, b), name
    assert front_matter((got / "README.md").read_text())["base_model"] == TARGET
    # A snapshot is itself a finished artifact: it can be re-pushed elsewhere as is.
    api2 = FakeApi()
    hub.push_artifact(got, "other/head", keep_card=True, api=api2)
    assert api2.uploaded == api.uploaded
    with pytest.raises(ArtifactError, match="not in the local Hugging Face cache"):
        hub.resolve_artifact("org/head")  # only v1 was downloaded; main is not cached


def test_snapshot_of_wrong_kind_is_rejected(offline_cache):
    sha = "c" * 40
    make_ngrams(snapshot_dir(offline_cache, "org/tables", sha, refs={"main": sha}))
    with pytest.raises(ArtifactError, match=r"'org/tables'.*not a drafter.*holds ngrams"):
        hub.resolve_artifact("org/tables", kind="drafter")


def test_env_set_after_import_is_honoured(offline_cache, monkeypatch):
    # huggingface_hub read HF_HUB_CACHE at import time; a later env change must still count.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", "/nonexistent/hf-cache")
    sha = "d" * 40
    snap = snapshot_dir(offline_cache, "org/late", sha, refs={"main": sha})
    make_ngrams(snap)
    assert hub.resolve_artifact("org/late") == snap


def test_offline_miss_names_repo_and_fixes(offline_cache):
    with pytest.raises(ArtifactError) as info:
        hub.resolve_artifact("org/missing@v2")
    msg = str(info.value)
    assert "'org/missing@v2'" in msg and str(offline_cache) in msg
    assert "HF_HUB_OFFLINE" in msg and "local artifact directory" in msg
    assert "hf download org/missing --revision v2" in msg


def test_missing_path_says_it_does_not_exist(tmp_path):
    for spec in (str(tmp_path / "nope"), "./nope", tmp_path / "nope"):
        with pytest.raises(ArtifactError, match="does not exist"):
            hub.resolve_artifact(spec)
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ArtifactError, match="is a file"):
        hub.resolve_artifact(file)


def test_relative_path_that_reads_as_repo_id_mentions_both(offline_cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactError, match=r"no local directory .*checkpoints/run1"):
        hub.resolve_artifact("checkpoints/run1")


@pytest.mark.parametrize("spec,repo,is_repo", [
    ("org/name", "org/name", True), ("org/name@v1", "org/name", True), ("gpt2", "gpt2", True),
    ("./org/name", None, False), ("/abs/dir", None, False), ("a/b/c", None, False),
    ("~/x", None, False), ("org/../x", None, False),
])
def test_repo_id_detection(spec, repo, is_repo):
    assert hub.looks_like_repo_id(spec) is is_repo
    if is_repo:
        assert split_revision(spec)[0] == repo


# ---------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------


def test_drafter_card_metadata_and_sections(tmp_path):
    art = make_drafter(tmp_path / "run")
    card = hub.generate_model_card(art, repo_id="org/head", license="mit")
    meta = front_matter(card)
    assert meta["library_name"] == "redraft"
    assert meta["base_model"] == TARGET
    assert meta["license"] == "mit"
    assert {"speculative-decoding", "redrafter"} <= set(meta["tags"]) and "n-gram" not in meta["tags"]
    # Hub datasets only: the embedded default maps to ShareGPT, a local code dir is left out.
    assert meta["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered",
                                "HuggingFaceH4/ultrachat_200k"]
    for section in ("## Target model", "## Architecture", "## Training data", "## Recipe",
                    "## Held-out metrics", "## Benchmark", "## Usage"):
        assert section in card, section
    # Per-position accuracy rows carry the values of metrics.json, in order.
    assert "| 1 | 0.61 | 0.88 |" in card and "| 3 | 0.27 | 0.55 |" in card
    assert "tau_est = 2.07" in card
    assert "| redrafter | 2.6 | 29.9 | 1.97 | true |" in card
    assert "fp-1234" in card and "num_layers | 2" in card
    assert "zero_stage: 1" in card  # the resolved recipe is embedded
    assert 'resolve_artifact("org/head", kind="drafter")' in card


def test_card_without_optional_files_and_local_target(tmp_path):
    art = make_drafter(tmp_path / "run", metrics=False, recipe=False, bench=False, state=False)
    cfg = json.loads((art / "config.json").read_text())
    cfg["target_model"] = str(tmp_path / "my-local-target")  # not a Hub id
    (art / "config.json").write_text(json.dumps(cfg))
    card = hub.generate_model_card(art)
    meta = front_matter(card)
    assert "base_model" not in meta and "datasets" not in meta
    assert "## Held-out metrics" not in card and "## Benchmark" not in card
    assert "## Recipe" not in card
    assert str(tmp_path / "my-local-target") in card


def test_ngram_card_lists_tables(tmp_path):
    art = make_ngrams(tmp_path / "tables")
    card = hub.generate_model_card(art, repo_id="org/tables")
    meta = front_matter(card)
    assert meta["base_model"] == TARGET
    assert {"n-gram", "n-grammys", "aded"} <= set(meta["tags"]) and "redrafter" not in meta["tags"]
    assert meta["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    assert "| bigram.safetensors | ids | 64x4 | I32 |" in card
    assert "| bigram.safetensors | probs | 64x4 | F16 |" in card
    assert 'resolve_artifact("org/tables", kind="ngrams")' in card


@pytest.mark.parametrize("spec,expected", [
    ("default-chat", ["anon8231489123/ShareGPT_Vicuna_unfiltered"]),
    ("0.7*default-chat,0.3*default-code", ["anon8231489123/ShareGPT_Vicuna_unfiltered"]),
    ("default-chat:0.7,stack:bigcode/the-stack-dedup?lang=python",
     ["anon8231489123/ShareGPT_Vicuna_unfiltered", "bigcode/the-stack-dedup"]),
    ("ultrachat:HuggingFaceH4/ultrachat_200k?split=train_sft", ["HuggingFaceH4/ultrachat_200k"]),
    ("sharegpt:/data/sharegpt.jsonl,code-dir:org/src,/data/chats.jsonl", []),
    (["sharegpt:a/b", {"spec": "stack:c/d"}, "sharegpt:a/b@main"], ["a/b", "c/d"]),
])
def test_dataset_ids_from_data_specs(spec, expected):
    assert hub.dataset_ids(spec) == expected


def test_card_reads_nested_metrics(tmp_path):
    art = make_drafter(tmp_path / "run", metrics=False, recipe=False, bench=False, state=False)
    (art / "metrics.json").write_text(json.dumps(
        {"eval": {"top1": [0.5, 0.25], "tau_est": 1.6}, "step": 40}))
    card = hub.generate_model_card(art)
    assert "| position | eval.top1 |" in card and "| 2 | 0.25 |" in card
    assert "tau_est = 1.6" in card and "| step | 40 |" in card


def test_card_for_non_artifact_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ArtifactError, match="neither config.json"):
        hub.generate_model_card(tmp_path)


# ---------------------------------------------------------------------------------------------
# push_artifact
# ---------------------------------------------------------------------------------------------


class FakeApi:
    """Records HfApi calls; ``fail`` maps a method name to exceptions raised on successive calls."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = {k: list(v) for k, v in (fail or {}).items()}
        self.uploaded = {}

    def _maybe_fail(self, name):
        if self.fail.get(name):
            raise self.fail[name].pop(0)

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        self._maybe_fail("create_repo")
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))
        self._maybe_fail("create_branch")

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw["repo_id"], kw))
        self._maybe_fail("upload_folder")
        root = Path(kw["folder_path"])  # snapshot what the folder holds at upload time
        self.uploaded = {p.relative_to(root).as_posix(): p.read_bytes()
                         for p in root.rglob("*") if p.is_file()}


def http_error(status: int) -> HfHubHTTPError:
    request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
    return HfHubHTTPError(f"{status} error", response=httpx2.Response(status, request=request))


def tree_state(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def no_sleep(monkeypatch):
    sleeps = []
    monkeypatch.setattr(hub, "_sleep", sleeps.append)
    return sleeps


@pytest.fixture
def sys_tmp(tmp_path, monkeypatch):
    """The system temp dir (where pushes stage their upload), redirected to see what is left."""
    import tempfile

    path = tmp_path / "sys-tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def test_push_uploads_artifact_with_card(tmp_path, no_sleep, sys_tmp):
    art = make_drafter(tmp_path / "run")
    api = FakeApi()
    url = hub.push_artifact(art, "org/head", private=True, revision="v1",
                            commit_message="first head", api=api)
    assert url == "https://huggingface.co/org/head/tree/v1"
    names = [c[0] for c in api.calls]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    assert api.calls[0][2]["private"] is True and api.calls[0][2]["exist_ok"] is True
    assert api.calls[1][2]["branch"] == "v1" and api.calls[1][2]["exist_ok"] is True
    up = api.calls[2][2]
    assert up["repo_id"] == "org/head" and up["revision"] == "v1"
    assert up["commit_message"] == "first head"
    assert "training_state/**" in up["ignore_patterns"]
    assert "*.safetensors" in up["delete_patterns"]  # stale shards of an earlier push go
    # Everything but resume-only state, plus the fresh card; the weights are byte-identical.
    assert set(api.uploaded) == {"config.json", "model.safetensors", "metrics.json",
                                 "resolved_config.yaml", "bench.json", "README.md",
                                 "redraft_head.py"}  # auto_map's shim (ReDrafter.save_pretrained)
    assert api.uploaded["model.safetensors"] == (art / "model.safetensors").read_bytes()
    assert front_matter(api.uploaded["README.md"].decode())["base_model"] == TARGET
    # After success the local card is the published one, and the staging folder is gone.
    assert (art / "README.md").read_bytes() == api.uploaded["README.md"]
    assert list(sys_tmp.iterdir()) == []
    assert no_sleep == []


def test_push_main_revision_from_repo_spec_and_defaults(tmp_path, no_sleep):
    art = make_ngrams(tmp_path / "tables")
    api = FakeApi()
    url = hub.push_artifact(art, "org/tables", api=api)
    assert url == "https://huggingface.co/org/tables"
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]
    assert api.calls[0][2]["private"] is False
    assert api.calls[1][2]["revision"] is None
    assert api.calls[1][2]["commit_message"] == "Upload redraft ngrams artifact"
    assert set(api.uploaded) == {"ngrams.json", "bigram.safetensors", "README.md"}

    api = FakeApi()
    hub.push_artifact(art, "org/tables@dev", api=api)
    assert api.calls[1][2]["branch"] == "dev" and api.calls[2][2]["revision"] == "dev"


def test_push_retries_transient_errors(tmp_path, no_sleep):
    art = make_drafter(tmp_path / "run", state=False)
    api = FakeApi(fail={"create_repo": [http_error(503)],
                        "upload_folder": [http_error(429), httpx2.ConnectError("reset")]})
    hub.push_artifact(art, "org/head", api=api)
    names = [c[0] for c in api.calls]
    assert names == ["create_repo", "create_repo", "upload_folder", "upload_folder", "upload_folder"]
    assert no_sleep == [hub.RETRY_DELAYS[0], hub.RETRY_DELAYS[0], hub.RETRY_DELAYS[1]]
    assert "model.safetensors" in api.uploaded


def test_push_honours_retry_after(tmp_path, no_sleep):
    art = make_drafter(tmp_path / "run", state=False)
    request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
    busy = HfHubHTTPError("429", response=httpx2.Response(429, request=request,
                                                           headers={"Retry-After": "30"}))
    hub.push_artifact(art, "org/head", api=FakeApi(fail={"create_repo": [busy]}))
    assert no_sleep == [30.0]


def test_push_gives_up_after_retries(tmp_path, no_sleep):
    art = make_drafter(tmp_path / "run", state=False)
    api = FakeApi(fail={"upload_folder": [http_error(502)] * (len(hub.RETRY_DELAYS) + 1)})
    before = tree_state(art)
    with pytest.raises(ArtifactError, match=r"failed at upload: the Hub did not answer after 5"):
        hub.push_artifact(art, "org/head", api=api)
    assert len(no_sleep) == len(hub.RETRY_DELAYS)
    assert tree_state(art) == before


@pytest.mark.parametrize("method,exc,expected", [
    ("create_repo", http_error(401), r"failed at repo creation: authentication failed.*--token"),
    ("create_repo", http_error(403), r"failed at repo creation: authentication failed"),
    ("create_branch", http_error(404), r"failed at branch creation \('v1'\): the repo or namespace"),
    ("upload_folder", http_error(400), r"failed at upload: the Hub refused it"),
    ("upload_folder", OfflineModeIsEnabled("offline"), r"failed at upload: HF_HUB_OFFLINE is set"),
])
def test_push_permanent_error_says_what_failed_and_keeps_files(tmp_path, no_sleep, sys_tmp,
                                                               method, exc, expected):
    art = make_drafter(tmp_path / "run")
    (art / "README.md").write_text("my hand-written notes\n")
    before = tree_state(art)
    api = FakeApi(fail={method: [exc]})
    with pytest.raises(ArtifactError, match=expected) as info:
        hub.push_artifact(art, "org/head", revision="v1", api=api)
    assert "Local files were not changed" in str(info.value)
    assert [c[0] for c in api.calls].count(method) == 1  # not retried
    assert no_sleep == []
    assert tree_state(art) == before
    assert list(sys_tmp.iterdir()) == []  # no staging left behind


def test_push_refuses_unfinished_artifacts(tmp_path, no_sleep):
    api = FakeApi()
    art = make_drafter(tmp_path / "run", state=False)
    (art / "model.safetensors.tmp.123").write_bytes(b"half")
    with pytest.raises(ArtifactError, match=r"partial files \(model.safetensors.tmp.123\)"):
        hub.push_artifact(art, "org/head", api=api)
    (art / "model.safetensors.tmp.123").unlink()

    weights = (art / "model.safetensors").read_bytes()
    (art / "model.safetensors").write_bytes(weights[:-10])  # cut off mid-tensor
    with pytest.raises(ArtifactError, match="model.safetensors is truncated"):
        hub.push_artifact(art, "org/head", api=api)
    (art / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="no model.safetensors"):
        hub.push_artifact(art, "org/head", api=api)

    tables = make_ngrams(tmp_path / "tables")
    (tables / "bigram.safetensors").unlink()
    with pytest.raises(ArtifactError, match="ngrams.json but no"):
        hub.push_artifact(tables, "org/tables", api=api)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArtifactError, match="not a finished redraft artifact"):
        hub.push_artifact(empty, "org/x", api=api)
    assert api.calls == []


def test_push_across_filesystems_links_instead_of_copying(tmp_path, no_sleep, monkeypatch):
    art = make_drafter(tmp_path / "run", state=False)
    api = FakeApi()
    staged = {}
    upload = api.upload_folder

    def record(**kw):
        root = Path(kw["folder_path"])
        staged.update({p.name: p.is_symlink() for p in root.iterdir()})
        upload(**kw)

    api.upload_folder = record

    def no_hard_links(src, dst, *a, **kw):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(hub.os, "link", no_hard_links)
    hub.push_artifact(art, "org/head", api=api)
    assert staged["model.safetensors"] is True and staged["README.md"] is False
    assert api.uploaded["model.safetensors"] == (art / "model.safetensors").read_bytes()


def test_push_keep_card_uploads_existing_readme(tmp_path, no_sleep):
    art = make_drafter(tmp_path / "run", state=False)
    (art / "README.md").write_text("custom card\n")
    api = FakeApi()
    hub.push_artifact(art, "org/head", keep_card=True, api=api)
    assert api.uploaded["README.md"] == b"custom card\n"
    assert (art / "README.md").read_text() == "custom card\n"


def test_push_offline_without_api_is_clear(tmp_path, offline_cache):
    art = make_drafter(tmp_path / "run", state=False)
    with pytest.raises(ArtifactError, match="HF_HUB_OFFLINE is set"):
        hub.push_artifact(art, "org/head")


def test_push_main_cli(tmp_path, monkeypatch, capsys, no_sleep):
    art = make_drafter(tmp_path / "run", state=False)
    api = FakeApi()
    real = hub.push_artifact
    monkeypatch.setattr(hub, "push_artifact", lambda *a, **kw: real(*a, api=api, **kw))
    rc = hub.push_main([str(art), "org/head", "--private", "--revision", "r2",
                        "--commit-message", "msg", "--license", "mit"])
    assert rc == 0
    assert "https://huggingface.co/org/head/tree/r2" in capsys.readouterr().out
    assert api.calls[0][2]["private"] is True and api.calls[2][2]["commit_message"] == "msg"
    assert front_matter(api.uploaded["README.md"].decode())["license"] == "mit"

    rc = hub.push_main([str(tmp_path / "missing"), "org/head"])
    assert rc == 1
    assert "redraft-push: error:" in capsys.readouterr().err

    rc = hub.push_main([str(art), "org/head", "--print-card"])
    assert rc == 0 and capsys.readouterr().out.startswith("---\nlibrary_name: redraft\n")


def test_write_model_card_is_atomic_and_refreshes(tmp_path):
    art = make_drafter(tmp_path / "run", state=False)
    path = hub.write_model_card(art, repo_id="org/head")
    assert path == art / "README.md"
    assert path.read_text() == hub.generate_model_card(art, repo_id="org/head")
    assert [p.name for p in art.iterdir() if ".tmp" in p.name] == []


def test_transient_classification():
    assert hub.is_transient(http_error(500)) and hub.is_transient(http_error(429))
    assert hub.is_transient(httpx2.ReadTimeout("slow")) and hub.is_transient(ConnectionResetError())
    assert not hub.is_transient(http_error(401)) and not hub.is_transient(http_error(404))
    assert not hub.is_transient(OfflineModeIsEnabled("offline"))
    assert not hub.is_transient(ValueError("bad"))


def test_hub_module_imports_no_other_stage():
    import ast

    tree = ast.parse(Path(hub.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("redraft")} == {"redraft.errors", "redraft.utils"}


def test_console_script_points_at_push_main():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "redraft-push"]
    assert ep.load() is hub.push_main

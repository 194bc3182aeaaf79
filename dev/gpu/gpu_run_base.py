"""The offline GPU runner's settings and data: paths and limits, the stages and the time limit
of each step, the GPU and dry-run profiles, and the bundle parts staged in the work folder
(``dev/gpu/gpu_run.py`` is the runner; standard library only)."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "dev" / "gpu"
WORK = Path("/tmp/redraft-gpu")
MIB = 1 << 20
EXIT_MISSING = 3  # a stage could not run: parts missing (the message names them)
# what the command runner brings back from $OUT
OUT_MAX_FILES, OUT_MAX_FILE, OUT_MAX_TOTAL = 8, 16 * MIB, 64 * MIB
LOG_KEEP = (
    2 * MIB
)  # a longer log keeps its first 256 KiB and its end (4 head shards + logs fit one run)
ALL = ("wheels", "gguf", "sharegpt")
STAGES = {  # name: (title, assets it needs)
    "quick": (
        "the headline figures in one call: dummy:llama-8b cost curve, host overhead, short bf16 decode table",
        ALL,
    ),
    "a": ("CUDA tests (pytest -m 'cuda and not slow')", ("wheels",)),
    "b": ("default target on CUDA: slow CUDA tests, n-gram tables, bf16 decode table", ALL),
    "b32": ("default target on CUDA: fp32 decode table", ALL),
    "c": (
        "dummy:llama-1b / dummy:llama-8b: cost curves, host overhead, predicted speedups",
        ("wheels",),
    ),
    "d": ("redraft-train under the deepspeed launcher, 1 GPU: tokens/s", ALL),
    "e": (
        "the default head, paper recipe (2 epochs or as many steps as fit; resumable): tau_est",
        ALL,
    ),
    "e2": ("bf16 decode table with the trained head in the mix", ALL),
    "fetch": ("publish the files still waiting to go back", ()),
}
ORDER = ("a", "c", "b", "b32", "d", "e", "e2")
IMPORTS = (
    "torch",
    "transformers",
    "deepspeed",
    "datasets",
    "gguf",
    "fastapi",
    "uvicorn",
    "redraft",
)
# (hf-greedy and hsddw left out: on a GPU they decoded at 20 and 5 tok/s, so a
# 20 + 20 prompt table with them does not fit a 10-minute call)
BENCH_METHODS = "greedy,hf-prompt-lookup,context,ngrammys,aded,mix"
QUICK_METHODS = "greedy,hf-prompt-lookup,ngrammys,mix"
NGRAM_METHODS = {"bigram", "extended", "ngrammys", "aded", "mix+aded"}  # need the n-gram tables
# GPU run: each step's own limit in seconds (the dry run sets none: the CPU is slower, the
# mechanism is tested on its own). Estimates for one H100 are in dev/gpu/README.md; these leave ~2x.
STEP_LIMITS = {
    "b/pytest": 180,
    "ngrams": 180,
    "cost-curves": 180,
    "overhead": 120,
    "predict": 30,
    # quick, measured on a GPU: cost curves 16.2 s, overhead 19.6 s
    # (before its redrafter row), profile 39.2 s, engine profile 27.7 s, n-grams 25.1 s (the
    # decode table 79.6 s); the engine profile's JSON is written after each part, so a cut run
    # keeps what it measured
    "quick/cost-curves": 45,
    "quick/overhead": 60,
    "quick/profile": 60,
    "quick/engine-profile": 90,
    "quick/ngrams": 60,
    "train-default": 200,
    "train-default-4x4": 200,
    "train-dummy": 240,
    # stage e: the target's own replies made first (the engine, bf16, batch 64; resumable, so a
    # step stopped at its limit keeps every reply written), then training on them
    "e/distill-heldout": 90,
    "e/distill-train": 200,
    # stage e: the target's features of the distilled records and of the KD-only records
    # (a forward pass per token: seconds on a GPU for ~2M tokens)
    "e/cache-main": 90,
    "e/cache-kd": 90,
    "head-shards": 60,
    "head-join": 60,
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
    # nothing: the recipe's global batch of 16 runs as one micro batch of 16 on a GPU
    # (gpu_micro_batch_size: 1.75x the tokens/s of 4 x 4, docs/design/0007-gpu-step-shapes.md)
    train_overrides: tuple = ()
    dummy_recipe: str = "llama3-8b-8xh100"
    dummy_overrides: tuple = ("--data", "default-chat", "--train-limit", "2000")
    # stage d measures these; "default-4x4": the same global batch of 16 as 4 micro batches of 4
    # (the former one-GPU shape: 49.9k tokens/s against 16 x 1's 87.5k)
    speed_targets: tuple = ("default", "default-4x4", "dummy")
    m4x4_overrides: tuple = ("--micro-batch-size", "4", "--grad-accum", "4")
    speed_steps: int = 60
    dummy_speed_steps: int = 20
    full_steps: int | None = None  # None: the recipe's epochs, bounded by time
    # stage e, when bounded by time: as many epochs as the time allows, the warm-up and cosine
    # over that time. One run's head saw its 1,586 conversations twice (the recipe's 2
    # epochs) in 62 s and stopped with budget left (tau_est 1.51); on the CPU the same kind of
    # small self-distilled set gained from up to ~12 epochs (docs/design/0006-demo-recipe.md).
    head_time_overrides: tuple = ("--epochs", "12", "--schedule-by-time")
    # stage e: plain default-chat records whose cached features the head learns by KD only
    # (redraft-cache-features, then --kd-features; 0: train online on the distilled replies
    # alone). None: on the CPU such records added ~0.05 tau_est beside 100 distilled
    # conversations and nothing beside ~840 or more (docs/design/0006-demo-recipe.md), and one
    # stage e distills thousands.
    head_kd_records: int = 0
    # stage e's training only. Draft step i's loss weighted 0.6^i, as in the demo recipes: on the
    # CPU +0.04 held-out tau_est over plain weights on the same 2,048 replies
    # (docs/design/0006-demo-recipe.md)
    head_overrides: tuple = ("--set", "step_decay=0.6")
    # stage e's self-distilled data, made as steps of their own (time-bounded) instead of inside
    # redraft-train (whose time budget counts training only): on a 135M target distilling is ~10x
    # slower per token than training, so the time goes to the replies
    distill_args: tuple = ("--max-new-tokens", "512", "--max-turns", "1", "--batch-size", "64")
    distill_limit: int = 50000  # conversations asked for; the step's time limit ends it sooner
    distill_heldout: int = 100
    num_proc: int = 16
    budget_s: float = 540.0  # one stage
    run_budget_s: float = 570.0  # the whole invocation: the command runner kills a command at 600 s
    # each step's own time limit, "<stage>/<step>" or "<step>" (seconds; a step not named here
    # may take what its stage has left): a step that hangs cannot eat the steps after it
    step_s: dict = field(default_factory=lambda: dict(STEP_LIMITS))
    # stage quick: the headline figures in one call (cost curve, host overhead, a short bf16 table)
    quick_dummy: str = "dummy:llama-8b"
    quick_prompts: int = 10
    quick_methods: str = QUICK_METHODS
    # stage quick's engine profile (dev/gpu/engine_profile.py): the verify grid and engine run
    engine_profile_args: tuple = ()

    def step_limit(self, stage: str, step: str) -> float | None:
        return self.step_s.get(f"{stage}/{step}", self.step_s.get(step))

    @classmethod
    def dry(cls, work: Path) -> Profile:
        return cls(
            device="cpu",
            target=str(work / "tiny-target"),
            dummies=("dummy:tiny",),
            train_dummy="dummy:tiny",
            prompts=2,
            max_new_tokens=8,
            bench_methods="greedy,context,ngrammys,mix",
            head_methods="greedy,redrafter,mix",
            pytest_paths=("tests/cuda",),
            cost_context=16,
            # (48 new tokens: a speculating row that accepts 2 tokens a step must not finish
            # within the 8 warm-up and 4 timed steps, or the timed batch shrinks)
            engine_profile_args=tuple(
                "--batches 1,4 --capacities 64,128 --context 16 --batch 4 --prompt-tokens 8 "
                "--max-new-tokens 48 --steps 4 --grow-to 40".split()
            ),
            overhead_tokens=8,
            overhead_batches="1",
            recipe="tiny",
            train_overrides=("--data", "default-chat"),
            dummy_recipe="tiny",
            dummy_overrides=("--data", "default-chat", "--train-limit", "64", "--max-length", "64"),
            speed_targets=("dummy",),
            speed_steps=2,
            dummy_speed_steps=2,
            full_steps=4,
            head_kd_records=8,
            head_overrides=("--loss", "ce+kd"),  # --kd-features needs a KD term
            distill_args=("--max-new-tokens", "8", "--max-turns", "1", "--batch-size", "4"),
            distill_limit=8,
            distill_heldout=4,
            num_proc=1,
            budget_s=1200.0,
            run_budget_s=7200.0,
            step_s={},
            quick_dummy="dummy:tiny",
            quick_prompts=2,
        )


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
            raise RunnerError(
                f"{part_dir} holds no readable MANIFEST.json; it is not a part of a bundle made by "
                f"`make gpu-bundle`."
            )
        if self.manifest and self.manifest["bundle_id"] != m["bundle_id"]:
            self.log.append(
                f"dropping the parts of bundle {self.manifest['bundle_id']} staged earlier: "
                f"{part_dir} belongs to bundle {m['bundle_id']}"
            )
            shutil.rmtree(self.dir.parent / "prefix", ignore_errors=True)
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        mine = {k: v for k, v in m["files"].items() if part_dir.name == f"part{v['part']}"}
        if not mine:
            raise RunnerError(
                f"{part_dir}: its manifest lists no file of a folder named {part_dir.name}; keep the "
                f"folder names part1, part2, ... that make gpu-bundle wrote."
            )
        for name, meta in sorted(mine.items()):
            src, dst = part_dir / name, self.dir / name
            if (
                dst.is_file()
                and dst.stat().st_size == meta["size"]
                and (self.dir / f".{name}.ok").is_file()
            ):
                continue
            if not src.is_file():
                raise RunnerError(
                    f"{src} is missing from the carried part; rebuild the bundle with `make gpu-bundle`."
                )
            got = sha256(src)
            if got != meta["sha256"]:
                raise RunnerError(
                    f"{src} is corrupted (sha256 {got[:12]}..., the manifest says "
                    f"{meta['sha256'][:12]}...); rebuild the bundle with `make gpu-bundle` and carry "
                    f"{part_dir.name} again."
                )
            shutil.copyfile(src, dst)
            (self.dir / f".{name}.ok").touch()
        (self.dir / "MANIFEST.json").write_text(json.dumps(m, indent=1))
        self.manifest = m
        self.log.append(
            f"staged {part_dir.name} of bundle {m['bundle_id']}: {', '.join(sorted(mine))}"
        )

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
        have = [
            i
            for i in range(1, n + 1)
            if not any(not self.has(f) for f, v in self.manifest["files"].items() if v["part"] == i)
        ]
        return f"bundle {self.manifest['bundle_id']}: parts staged {have} of 1..{n}"


# ---------------------------------------------------------------------------------- a stage's record


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

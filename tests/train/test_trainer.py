"""The training loop on the tiny target: learning, resume, artifacts, multi-process equivalence."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from redraft.errors import ConfigError
from redraft.models.drafter_io import load_drafter
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.config import make_config
from redraft.train.trainer import DistEnv, evaluate, train

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, name="run", **over):
    base = {"output_dir": str(tmp_path / name), "report_to": "none"}
    base.update({k: str(v) for k, v in over.items()})
    return make_config("tiny", base)


def _run(cfg, tiny_target, tiny_data, **kw):
    return train(
        cfg, target=tiny_target, train_dataset=tiny_data[0], eval_dataset=tiny_data[1], **kw
    )


def _weights(run_dir):
    return load_file(str(Path(run_dir) / "model.safetensors"))


def test_tiny_run_lowers_heldout_loss_and_writes_the_artifact(tmp_path, tiny_target, tiny_data):
    cfg = _cfg(tmp_path, max_steps=40, lr=0.01)
    torch.manual_seed(cfg.seed)  # the same init the trainer draws
    untrained = ReDrafter(
        ReDrafterConfig.for_target(tiny_target, num_layers=cfg.num_layers, num_steps=cfg.num_steps)
    ).attach_target(tiny_target)
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    before = evaluate(untrained, untrained, tiny_target, tiny_data[1], cfg, env, "fp32")

    m = _run(cfg, tiny_target, tiny_data)
    assert m["status"] == "completed" and m["global_step"] == 40
    assert m["eval_loss"] < 0.8 * before["eval_loss"]
    assert sum(m["eval_top1"]) > sum(before["eval_top1"]) + 0.3
    assert m["train_tokens_per_s"] > 0 and len(m["eval_top1"]) == cfg.num_steps
    assert m["eval_tau_est"] == pytest.approx(1 + sum(m["eval_chain_acc"]))

    out = Path(cfg.output_dir)
    for f in ("config.json", "model.safetensors", "README.md", "metrics.json", "run_config.yaml"):
        assert (out / f).is_file(), f
    assert json.loads((out / "metrics.json").read_text())["eval_top1"] == m["eval_top1"]
    drafter = load_drafter(out, tiny_target)
    assert drafter.config.tokenizer_fingerprint == tiny_target.fingerprint
    again = evaluate(drafter, drafter, tiny_target, tiny_data[1], cfg, env, "fp32")
    assert again["eval_top1"] == pytest.approx(m["eval_top1"])


def test_existing_run_needs_resume_or_overwrite(tmp_path, tiny_target, tiny_data):
    cfg = _cfg(tmp_path, max_steps=2)
    _run(cfg, tiny_target, tiny_data)
    with pytest.raises(ConfigError, match="--resume.*--overwrite"):
        _run(cfg, tiny_target, tiny_data)
    assert _run(cfg, tiny_target, tiny_data, overwrite=True)["global_step"] == 2


def test_resume_after_sigterm_gives_the_same_weights(tmp_path, tiny_target, tiny_data):
    over = dict(max_steps=8, lr=0.01, grad_accum=2)
    straight = _run(_cfg(tmp_path, "straight", **over), tiny_target, tiny_data)

    cfg = _cfg(tmp_path, "killed", **over)

    def kill_at_3(state):
        if state["global_step"] == 3:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # the real handler: finish the step, checkpoint, stop

    first = _run(cfg, tiny_target, tiny_data, on_step=kill_at_3)
    assert first["status"] == "interrupted" and first["global_step"] == 3
    assert (Path(cfg.output_dir) / "training_state" / "step-3" / "redraft_state.json").is_file()
    with pytest.raises(ConfigError, match="lr"):  # resuming with other settings is refused
        _run(_cfg(tmp_path, "killed", **{**over, "lr": 0.02}), tiny_target, tiny_data, resume=True)
    resumed = _run(cfg, tiny_target, tiny_data, resume=True)
    assert resumed["status"] == "completed" and resumed["global_step"] == 8

    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert resumed["eval_top1"] == pytest.approx(straight["eval_top1"])


def test_reduced_vocab_and_kd_loss_train_and_round_trip(tmp_path, tiny_target, tiny_data):
    cfg = _cfg(tmp_path, max_steps=4, draft_vocab_size=64, loss="ce+kd")
    m = _run(cfg, tiny_target, tiny_data)
    assert m["status"] == "completed"
    d = load_drafter(cfg.output_dir, tiny_target)
    assert d.config.draft_vocab_size == 64 and d.lm_head.weight.shape[0] == 64
    # the reduced vocabulary is the assistant tokens of the data: every one is covered here
    import pyarrow.compute as pc

    tbl = tiny_data[0].with_format("arrow")
    ids = pc.list_flatten(tbl["input_ids"]).to_numpy()[
        pc.list_flatten(tbl["loss_mask"]).to_numpy() == 1
    ]
    assert set(ids.tolist()) <= set(d.draft_to_target.tolist())


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stages_save_a_loadable_head(tmp_path, tiny_target, tiny_data, stage):
    cfg = _cfg(tmp_path, max_steps=2, zero_stage=stage)
    m = _run(cfg, tiny_target, tiny_data)
    assert m["status"] == "completed"
    d = load_drafter(cfg.output_dir, tiny_target)
    assert all(p.numel() > 0 for p in d.parameters())  # gathered, not ZeRO-3 partitions


@pytest.mark.parametrize("stage", [2])
def test_two_processes_under_the_deepspeed_launcher_match_one_with_double_accumulation(
    tmp_path, tiny_target_dir, chat_file, stage
):
    common = [
        "--recipe",
        "tiny",
        "--target",
        str(tiny_target_dir),
        "--data",
        f"sharegpt:{chat_file}",
        "--num-proc",
        "1",
        "--max-steps",
        "4",
        "--lr",
        "0.01",
        "--zero-stage",
        str(stage),
        "--report-to",
        "none",
        "--data-cache-dir",
        str(tmp_path / "cache"),
    ]
    # in-process runs of this session set RANK/MASTER_PORT...: the children must not inherit them
    dist_vars = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    bin_dir = Path(sys.executable).parent
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "redraft.train.cli",
            *common,
            "--grad-accum",
            "4",
            "--output-dir",
            str(tmp_path / "one"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            str(bin_dir / "deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            str(29600 + os.getpid() % 300),
            "--module",
            "redraft.train.cli",
            *common,
            "--grad-accum",
            "2",
            "--output-dir",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m1["world_size"] == 1 and m2["world_size"] == 2
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert m1["global_step"] == m2["global_step"] == 4
    torch.manual_seed(0)  # the trainer's init (seed 0): training moved away from it
    init = ReDrafter(
        ReDrafterConfig(**json.loads((tmp_path / "one" / "config.json").read_text()))
    ).state_dict()
    assert (a["lm_head.weight"] - init["lm_head.weight"]).abs().max() > 1e-3
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_default_target_trains_in_amp_bf16(tmp_path, default_target):
    """The real pipeline: default target, default ShareGPT, bf16 autocast on CPU, a few steps."""
    cfg = make_config(
        "default",
        {
            "output_dir": str(tmp_path / "run"),
            "report_to": "none",
            "max_length": "256",
            "self_distill": "false",  # the data as it is: distilling is tested on the tiny target
            "train_limit": "16",
            "eval_limit": "4",
            "max_steps": "3",
            "grad_accum": "2",
            "draft_vocab_size": "4096",
            "init_head": "target",
            "num_proc": "1",
            "data_cache_dir": str(tmp_path / "cache"),
        },
    )
    m = train(cfg, target=default_target)
    assert m["status"] == "completed" and m["precision"] == "amp-bf16"
    assert len(m["eval_top1"]) == 5 and all(0 <= a <= 1 for a in m["eval_top1"])
    assert m["eval_positions"] > 50
    d = load_drafter(tmp_path / "run", default_target)
    assert d.config.hidden_size == 576 and d.config.draft_vocab_size == 4096


def test_eval_only_reproduces_the_final_metrics(tmp_path, tiny_target, tiny_data, capsys):
    from redraft.train.trainer import evaluate_artifact

    cfg = _cfg(tmp_path, max_steps=3, lr=0.01)
    m = _run(cfg, tiny_target, tiny_data)
    again = evaluate_artifact(
        cfg, path=cfg.output_dir, target=tiny_target, eval_dataset=tiny_data[1]
    )
    assert again["eval_top1"] == pytest.approx(m["eval_top1"])
    assert again["eval_tau_est"] == pytest.approx(m["eval_tau_est"])
    with pytest.raises(ConfigError, match="init-from"):
        evaluate_artifact(cfg, target=tiny_target, eval_dataset=tiny_data[1])


def test_warm_start_makes_the_head_the_targets_lm_head_on_x(tiny_target):
    from redraft.train.trainer import warm_start_from_target

    d = ReDrafter(ReDrafterConfig.for_target(tiny_target, draft_vocab_size=16)).attach_target(
        tiny_target
    )
    d.set_draft_vocab(torch.arange(100, 116))
    warm_start_from_target(d, tiny_target)
    x = torch.randn(3, d.config.hidden_size)
    expect = tiny_target.output_head(x)[:, 100:116]
    torch.testing.assert_close(d(x, torch.tensor([[1, 2], [3, 4], [5, 6]]))[:, 1], expect)


def test_resume_with_another_target_is_refused_and_rewrites_nothing(
    tmp_path, tiny_target, tiny_data, other_target
):
    from redraft.train.fingerprint import weights_fingerprint

    cfg = _cfg(tmp_path, max_steps=2)
    _run(cfg, tiny_target, tiny_data)
    out = Path(cfg.output_dir)
    saved = {
        f: (out / f).read_bytes() for f in ("config.json", "run_config.yaml", "model.safetensors")
    }
    # the same tokenizer (fingerprint), other weights: the tokenizer check alone would accept it
    assert other_target.fingerprint == tiny_target.fingerprint
    with pytest.raises(ConfigError, match="--resume: the run .* was trained on target") as exc:
        _run(cfg, other_target, tiny_data, resume=True)
    assert exc.value.param == "target"
    assert weights_fingerprint(tiny_target.model) in str(exc.value)
    assert weights_fingerprint(other_target.model) in str(exc.value)
    assert {f: (out / f).read_bytes() for f in saved} == saved
    # what the run recorded: the target's id and both fingerprints, in the run config and the artifact
    import yaml

    rec = yaml.safe_load((out / "run_config.yaml").read_text())["target_record"]
    assert rec["weights_fingerprint"] == weights_fingerprint(tiny_target.model)
    assert (
        rec["tokenizer_fingerprint"] == tiny_target.fingerprint
        and rec["target_model"] == tiny_target.model_id
    )
    art = json.loads((out / "config.json").read_text())
    assert art["target_weights_fingerprint"] == rec["weights_fingerprint"]
    assert art["target_model"] == tiny_target.model_id
    # the saved run config is still a usable recipe (its record is not a setting)
    from redraft.train.config import load_recipe

    assert load_recipe(str(out / "run_config.yaml"))["max_steps"] == 2
    # the same target again resumes (a finished run: nothing left to train)
    assert _run(cfg, tiny_target, tiny_data, resume=True)["global_step"] == 2


def test_weights_fingerprint_sees_weights_not_dtype():
    from redraft.testing import make_tiny_model
    from redraft.train.fingerprint import weights_fingerprint

    m = make_tiny_model(64, hidden_size=16, num_layers=1)
    fp = weights_fingerprint(m)
    assert (
        weights_fingerprint(make_tiny_model(64, hidden_size=16, num_layers=1)) == fp
    )  # deterministic
    assert (
        weights_fingerprint(m.to(torch.bfloat16)) == fp
    )  # one checkpoint on CPU (fp32) or GPU (bf16)
    m = m.float()
    with torch.no_grad():
        w = m.model.layers[0].mlp.down_proj.weight  # not the embedding or the LM head
        w.view(-1)[w.numel() // 2] += 0.5  # a middle element of a middle layer
    assert weights_fingerprint(m) != fp
    assert weights_fingerprint(make_tiny_model(64, hidden_size=16, num_layers=1, seed=1)) != fp


class _Killed(BaseException):
    """Stands for SIGKILL: no except/finally code of the writer runs."""


def _artifact(tmp_path, tiny_target, seed):
    torch.manual_seed(seed)
    cfg = ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=3)
    return cfg, ReDrafter(cfg).state_dict()


def test_a_kill_anywhere_in_the_artifact_write_leaves_one_whole_artifact(
    tmp_path, tiny_target, monkeypatch
):
    from redraft.errors import ArtifactError
    from redraft.train import checkpoint as ckpt

    config, old_w = _artifact(tmp_path, tiny_target, 0)
    _, new_w = _artifact(tmp_path, tiny_target, 1)
    real_replace = os.replace
    kill_points = 0
    while True:
        out = tmp_path / f"run{kill_points}"
        out.mkdir()
        (out / "training_state").mkdir()
        (out / "training_state" / "keep.txt").write_text("resume state")
        ckpt.write_artifact(out, config, old_w, {"global_step": 1, "status": "completed"})
        calls = []

        def replace_or_die(a, b):
            if len(calls) == kill_points:
                raise _Killed
            calls.append(b)
            real_replace(a, b)

        monkeypatch.setattr(ckpt.os, "replace", replace_or_die)
        try:
            ckpt.write_artifact(out, config, new_w, {"global_step": 2, "status": "completed"})
            finished = True
        except _Killed:
            finished = False
        monkeypatch.setattr(ckpt.os, "replace", real_replace)
        # whatever the directory holds now is one artifact: old or new throughout, or none at all
        if (out / "config.json").exists():
            step = json.loads((out / "metrics.json").read_text())["global_step"]
            w = load_file(str(out / "model.safetensors"))
            assert torch.equal(
                w["lm_head.weight"], (old_w if step == 1 else new_w)["lm_head.weight"]
            )
            assert load_drafter(out, tiny_target) is not None
        else:
            with pytest.raises(ArtifactError):
                load_drafter(out, tiny_target)
        assert (out / "training_state" / "keep.txt").read_text() == "resume state"
        if finished:
            assert not (out / ckpt.STAGE_DIR).exists()
            break
        # the next start completes the swap of a whole stage, or discards a stage killed while it
        # was being written (save_pretrained's own atomic writes are kill points too); either way
        # the directory then holds one whole artifact (prepare_output_dir on --resume calls this)
        staged = (out / ckpt.STAGE_DIR / ckpt.STAGE_DONE).exists()
        assert ckpt.recover_artifact(out) == ("completed" if staged else "discarded")
        step = json.loads((out / "metrics.json").read_text())["global_step"]
        assert step == (2 if staged else 1)
        assert torch.equal(
            load_file(str(out / "model.safetensors"))["lm_head.weight"],
            (new_w if staged else old_w)["lm_head.weight"],
        )
        assert (
            "ReDrafter" in (out / "README.md").read_text()
        )  # the card, from redraft.hub, of the new files
        assert not (out / ckpt.STAGE_DIR).exists()
        kill_points += 1
    assert kill_points >= 3  # weights, metrics and config.json were each a kill point


def test_a_partial_stage_is_discarded_and_the_old_artifact_kept(tmp_path, tiny_target):
    from redraft.train import checkpoint as ckpt

    config, w = _artifact(tmp_path, tiny_target, 0)
    out = tmp_path / "run"
    ckpt.write_artifact(out.parent / "run", config, w, {"global_step": 1})
    before = (out / "model.safetensors").read_bytes()
    stage = out / ckpt.STAGE_DIR
    stage.mkdir()
    (stage / "model.safetensors").write_bytes(b"half a file")  # killed while staging: no .complete
    assert ckpt.recover_artifact(out) == "discarded"
    assert not stage.exists() and (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("loss", ["ce", "ce+kd"])
def test_the_fused_loss_trains_the_same_head_as_the_dense_reference(
    tmp_path, tiny_target, tiny_data, loss
):
    runs = {}
    for impl in ("dense", "fused"):
        cfg = _cfg(
            tmp_path,
            name=f"{impl}-{loss}",
            max_steps=6,
            lr=0.01,
            loss=loss,
            loss_impl=impl,
            draft_vocab_size=48,
        )
        runs[impl] = _run(cfg, tiny_target, tiny_data)
        runs[impl + "_w"] = _weights(cfg.resolved_output_dir())
    for key, w in runs["dense_w"].items():
        torch.testing.assert_close(runs["fused_w"][key], w, rtol=1e-4, atol=1e-5, msg=key)
    assert runs["fused"]["eval_loss"] == pytest.approx(runs["dense"]["eval_loss"], rel=1e-4)
    assert not torch.equal(
        runs["dense_w"]["lm_head.weight"], torch.zeros_like(runs["dense_w"]["lm_head.weight"])
    )


def test_zero3_refuses_the_fused_loss_and_auto_falls_back_to_dense(tmp_path):
    from redraft.train.step import resolve_loss_impl

    cpu = torch.device("cpu")
    assert resolve_loss_impl(_cfg(tmp_path), cpu) == "fused"
    assert resolve_loss_impl(_cfg(tmp_path, zero_stage=3), cpu) == "dense"
    with pytest.raises(ConfigError, match="ZeRO-3"):
        resolve_loss_impl(_cfg(tmp_path, zero_stage=3, loss_impl="fused"), cpu)
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_loss_impl(_cfg(tmp_path, loss_impl="liger"), cpu)


def test_evaluation_in_chunks_of_positions_equals_one_pass(
    tmp_path, tiny_target, tiny_data, monkeypatch
):
    from redraft.train import step

    cfg = _cfg(tmp_path, max_steps=2, lr=0.01)
    _run(cfg, tiny_target, tiny_data)
    head = load_drafter(cfg.output_dir, tiny_target, dtype=torch.float32)
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    whole = evaluate(head, head, tiny_target, tiny_data[1], cfg, env, "fp32")
    monkeypatch.setattr(step, "EVAL_LOGITS", 1)  # one position per chunk
    chunked = evaluate(head, head, tiny_target, tiny_data[1], cfg, env, "fp32")
    assert chunked["eval_positions"] == whole["eval_positions"] > 0
    for key in ("eval_loss", "eval_top1", "eval_top5", "eval_tau_est"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-6), key


def test_one_cpu_process_steps_like_plain_adamw_without_the_allreduce(tiny_target):
    """On one CPU process without ZeRO the engine runs torch's fused AdamW and skips DeepSpeed's
    gradient "all-reduce" with itself (flatten, reduce, copy back: fixed costs of every step);
    a step still moves the weights exactly as plain one-tensor-at-a-time AdamW with the same
    clipping does."""
    from redraft.train.distributed import setup_distributed
    from redraft.train.trainer import build_engine

    cfg = make_config(
        "tiny",
        {
            "precision": "fp32",
            "grad_clip": 0.05,
            "lr": 0.01,
            "grad_accum": 1,
            "micro_batch_size": 1,
        },
    )
    setup_distributed(cfg)
    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=2))
    ref = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=2))
    ref.load_state_dict(model.state_dict())
    model.attach_target(tiny_target)
    ref.attach_target(tiny_target)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _ = build_engine(cfg, model, total_steps=10, precision="fp32")
    assert engine.optimizer.defaults["fused"] is True
    assert engine.enable_backward_allreduce is False
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=cfg.lr,
        betas=tuple(cfg.adam_betas),
        weight_decay=cfg.weight_decay,
        foreach=False,
    )
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(6, tiny_target.hidden_size, generator=g)
    toks = torch.randint(0, tiny_target.vocab_size, (6, 2), generator=g)
    for _ in range(3):
        for group in opt.param_groups:  # the engine's warm-up/cosine schedule
            group["lr"] = engine.optimizer.param_groups[0]["lr"]
        engine.backward(engine(ctx, toks).float().pow(2).mean())
        engine.step()
        ref(ctx, toks).float().pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert len(moved) >= 4
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

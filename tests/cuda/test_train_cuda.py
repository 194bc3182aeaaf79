"""The trainer on one GPU under DeepSpeed: ZeRO 0 and 2 in bf16 run, and a run stopped by SIGTERM
and resumed ends with the same weights as one that was never stopped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_helpers import DEVICE
from safetensors.torch import load_file

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_bf16_step_runs_and_resumes_exactly(
    tmp_path, cuda_target_dir, chats_file, zero_stage
):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        }
    }
    env.update(
        DS_ACCELERATOR=DEVICE, PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    )
    job = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("train_job.py")),
            "--target",
            str(cuda_target_dir),
            "--data",
            chats_file,
            "--out",
            str(tmp_path),
            "--zero-stage",
            str(zero_stage),
            "--precision",
            "bf16",
            "--device",
            DEVICE,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    runs = json.loads(job.stdout.strip().splitlines()[-1])
    straight, first, resumed = runs["straight"], runs["first"], runs["resumed"]
    assert straight["status"] == "completed" and straight["global_step"] == 6
    assert (
        straight["device"].startswith(DEVICE)
        and straight["precision"] == "bf16"
        and straight["world_size"] == 1
    )
    assert straight["train_tokens_per_s"] > 0
    assert first["status"] == "interrupted" and first["global_step"] == 3
    assert resumed["status"] == "completed" and resumed["global_step"] == 6
    a, b = (
        load_file(str(tmp_path / "straight" / "model.safetensors")),
        load_file(str(tmp_path / "killed" / "model.safetensors")),
    )
    for k in a:
        # a resume that lost the optimizer state, the schedule or the data position is off by
        # about one learning-rate step (1e-2); bf16 rounding of identical arithmetic is not
        torch.testing.assert_close(a[k], b[k], rtol=2**-8, atol=1e-5, msg=lambda m: f"{k}: {m}")
    torch.manual_seed(0)
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    init = ReDrafter(
        ReDrafterConfig(**json.loads((tmp_path / "straight" / "config.json").read_text()))
    ).state_dict()
    moved = float((a["lm_head.weight"].float() - init["lm_head.weight"].float()).abs().max())
    assert moved > 1e-3  # training moved the weights: the comparison above is not of two inits
    assert resumed["eval_top1"] == pytest.approx(straight["eval_top1"], abs=0.02)


@pytest.mark.parametrize("kd_positions", ["assistant", "all"])
def test_a_micro_steps_loss_never_waits_for_the_gpu(cuda_target, kd_positions):
    """batch_loss on a batch moved to the GPU (its CPU copy picks the windows): no operation in it
    synchronises the host with the device (torch's sync debug mode raises on one), and the loss
    is the one of the same batch on the CPU path of window picking."""
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig
    from redraft.train.batches import Batch
    from redraft.train.config import make_config
    from redraft.train.step import batch_loss, target_hidden

    torch.manual_seed(0)
    V = cuda_target.vocab_size
    model = ReDrafter(ReDrafterConfig.for_target(cuda_target, num_layers=1, num_steps=3))
    model = model.attach_target(cuda_target).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (2, 24), generator=g)
    mask = torch.zeros(2, 24, dtype=torch.long)
    mask[0, 12:20], mask[1, 8:14] = 1, 1
    lengths = torch.tensor([24, 17])
    ids[1, 17:] = 0
    cpu = Batch(ids, mask, tokens=41, loss_tokens=int(mask[:, 2:].sum()), lengths=lengths)
    hidden = target_hidden(cuda_target, ids.to(DEVICE), "fp32").cpu()  # cached features
    cpu.hidden = hidden
    cfg = make_config(
        "tiny",
        {"num_steps": 3, "loss": "ce", "kd_positions": kd_positions, "draft_vocab_size": None},
    )
    gpu = cpu.to(DEVICE)
    assert gpu.host is cpu and gpu.ids.device.type == "cuda"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = batch_loss(model, model, None, gpu, cfg, "fp32")[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = batch_loss(model, model, None, Batch(**{**vars(gpu), "host": None}), cfg, "fp32")[0]
    assert torch.allclose(loss, ref)

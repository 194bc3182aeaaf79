"""One 1-GPU DeepSpeed run of the trainer three ways, for tests/cuda/test_train_cuda.py (a separate
process: DeepSpeed picks its accelerator and process group once per process).

    python tests/cuda/train_job.py --target DIR --data FILE --out DIR --zero-stage 2 --precision bf16

Trains ``straight`` for 6 steps; trains ``killed`` with a SIGTERM at step 3 (the trainer's own
handler finishes the step and checkpoints), then resumes it to step 6. Prints one JSON line with
the three runs' metrics.
"""

import argparse
import json
import os
import signal
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--zero-stage", type=int, required=True)
    p.add_argument("--precision", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from redraft.train.config import make_config
    from redraft.train.trainer import train

    def cfg(name):
        return make_config(
            "tiny",
            {
                "target": args.target,
                "data": f"sharegpt:{args.data}",
                "output_dir": f"{args.out}/{name}",
                "device": args.device,
                "zero_stage": str(args.zero_stage),
                "precision": args.precision,
                "max_steps": "6",
                "lr": "0.01",
                "grad_accum": "2",
                "tensorboard": "false",
                "num_proc": "1",
                "data_cache_dir": f"{args.out}/cache",
            },
        )

    def kill_at_3(state):
        if state["global_step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    runs = {
        "straight": train(cfg("straight")),
        "first": train(cfg("killed"), on_step=kill_at_3),
        "resumed": train(cfg("killed"), resume=True),
    }
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

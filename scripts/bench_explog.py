"""What experiment logging (fewclip.utils.explog) adds to a run: the same toy CoOp run (toy-clip, toy-shapes, 4 shots,
10 epochs of one step, every step logged) without logging, with TensorBoard, with W&B offline and with both,
in one process (backbone, dataset and features loaded once, wandb imported once, as in a sweep's worker),
in interleaved rounds; the minimum over the rounds of each setting.

    OMP_NUM_THREADS=1 python scripts/bench_explog.py            # 3 rounds
    OMP_NUM_THREADS=1 python scripts/bench_explog.py rounds=5

``run_train`` is the whole run (training, test scoring, writing the run directory, opening and closing the
loggers); ``train_time_s`` is metrics.json's, the training loop alone (the per-step logging calls included).
W&B runs offline here whatever the environment says (no upload is timed).
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from fewclip.runs.run import RunResources, load_train_config, run_train

SETTINGS = ("none", "tensorboard", "wandb", "[tensorboard,wandb]")
ARGS = ["adapter=coop", "data=toy-shapes", "shots=4", "train.epochs=10", "adapter.n_ctx=4", "data.max_test=200",
        "log.every_n_steps=1", "log.wandb.mode=offline"]


def main(argv):
    opts = dict(a.split("=", 1) for a in argv)
    rounds = int(opts.get("rounds", 3))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import wandb  # noqa: F401  (optional extra; imported once before timing, as a sweep's worker does)

    resources = RunResources()
    times = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for s in SETTINGS:
                cfg = load_train_config([*ARGS, f"log={s}"])
                backbone, plan = resources(cfg)
                out = Path(tmp) / f"{r}-{SETTINGS.index(s)}"
                t0 = time.perf_counter()
                m = run_train(cfg, out, backbone=backbone, plan=plan)
                times[s].append((time.perf_counter() - t0, m["train_time_s"], m["steps"]))
    print(f"{'log':<22} {'run_train s':>11} {'train_time_s':>12} steps")
    for s, v in times.items():
        print(f"{s:<22} {min(x[0] for x in v):>11.2f} {min(x[1] for x in v):>12.3f} {v[0][2]:>5}")


if __name__ == "__main__":
    main(sys.argv[1:])

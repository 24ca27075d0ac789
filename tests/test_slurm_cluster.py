"""A sweep through `launcher=slurm` on a real single-node SLURM (tests/slurm_cluster.py: munged, slurmctld and
slurmd with accounting storage off), one array task cancelled with scancel mid-run, and the sweep resumed; each
warning of submitit's printed once. Skipped, with one line saying why, where SLURM cannot start."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fewclip.runs import records
from fewclip.utils import locks
from helpers.slurm import Unavailable, start

SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, coop, slow]
  shots: [1]
  seeds: [1]
  args: [train.epochs=4, data.max_test=16, backbone.device=cpu]
  variants:
    coop: [adapter=coop, adapter.n_ctx=2]
    slow: [adapter=coop, adapter.n_ctx=2, train.epochs=3000]
"""
RUNS = ["toy-clip/toy-shapes/zeroshot", "toy-clip/toy-shapes/coop/1shot/seed1", "toy-clip/toy-shapes/slow/1shot/seed1"]
VICTIM = RUNS[2]

# A real cluster takes about 40 s; tests/test_launch.py covers the same launcher through submitit's local
# executor in the default run.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = start(tmp_path_factory.mktemp("slurm"))
    except Unavailable as e:
        pytest.skip(f"no single-node SLURM here: {e}")
    yield c
    c.stop()


def task_of(pid: int) -> str:
    """The SLURM array task (``JOB_TASK``) a process runs in, from its environment."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
    return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"


class Canceller(threading.Thread):
    """`scancel`s the array task that runs ``victim`` once the run has started and before it finishes."""

    def __init__(self, cluster, victim: Path):
        super().__init__(daemon=True)
        self.cluster, self.victim, self.cancelled, self.stop = cluster, victim, None, threading.Event()

    def run(self):
        while not self.stop.is_set():
            info = locks.read_lock(self.victim / locks.LOCK_FILE)
            started = (self.victim / "config.yaml").exists() and not (self.victim / "metrics.json").exists()
            if info is not None and started:
                try:
                    task = task_of(info.pid)
                except (OSError, KeyError):
                    time.sleep(0.05)
                    continue
                self.cluster.run("scancel", task)
                self.cancelled = task
                return
            time.sleep(0.05)


def sweep(cluster, spec: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fewclip.cli.main", "sweep", str(spec), f"out={out}", "launcher=slurm",
           "launcher.gpus_per_task=0", "launcher.cpus_per_task=1", "launcher.mem_gb=1", "launcher.time_min=10",
           "report=false"]
    return subprocess.run(cmd, env={**cluster.env, "FEWCLIP_DEBUG": "0"}, capture_output=True, text=True, timeout=300)


def test_a_sweep_on_slurm_with_a_task_cancelled_mid_run_resumes(cluster, tmp_path):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "out"
    canceller = Canceller(cluster, out / VICTIM)
    canceller.start()
    first = sweep(cluster, spec, out)
    canceller.stop.set()
    text = first.stdout + first.stderr
    assert canceller.cancelled is not None, text[-3000:]
    assert first.returncode == 1, text[-3000:]  # the cancelled run failed, the others finished
    assert "3 runs, 0 already done, 2 ran, 1 failed" in first.stdout, text[-3000:]
    assert f"SLURM task {canceller.cancelled} ended without finishing it" in first.stdout
    for r in RUNS[:2]:
        assert records.run_state(out / r).finished
    assert not records.run_state(out / VICTIM).finished
    # accounting storage is off: submitit's sacct warning comes at every poll, and is printed once
    assert text.count("Bypassing sacct error") == 1, text[-3000:]
    assert text.count("sacct does not answer on this cluster") == 1

    second = sweep(cluster, spec, out)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-3000:]
    assert "3 runs, 2 already done, 1 ran" in second.stdout
    assert text.count("Bypassing sacct error") <= 1
    assert all(records.run_state(out / r).finished for r in RUNS)
    m = json.loads((out / VICTIM / "metrics.json").read_text())
    assert m["train_time_s"] > 0 and records.RECORD_KEY in m
    # every run ran in a SLURM array task: two results of the first sweep's tasks, one of the second's
    assert len(list((out / ".submitit").glob("*_result.pkl"))) == 3

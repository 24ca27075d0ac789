"""Sweeps beyond one process: local worker processes, a Ray cluster, SLURM job arrays through submitit; the
feature store they share; failed runs that do not stop a sweep.

Every launcher runs the same run function into the same out directory, so whichever executes a sweep, and
however it is interrupted, the report's accuracy tables equal those of the same sweep run in one process
(`reference`). A request's features are the same bits whoever encodes it (fewclip.features.store), which is what
makes that exact."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fewclip.cli.main import main
from fewclip.runs import records
from fewclip.runs.launch.ray_tasks import NICENESS_ENV, worker_niceness
from fewclip.utils import locks

SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, coop, linear_probe]
  shots: [1, 2]
  seeds: [1]
  args: [train.epochs=4, train.augment_views=2, data.max_test=16, backbone.device=cpu]
  variants:
    coop: [adapter=coop, adapter.n_ctx=2]
"""
RUNS = ["toy-clip/toy-shapes/zeroshot"] + [f"toy-clip/toy-shapes/{m}/{k}shot/seed1"
                                           for m in ("coop", "linear_probe") for k in (1, 2)]
VICTIM = "toy-clip/toy-shapes/coop/2shot/seed1"


def accuracy_part(out: Path) -> str:
    """report.md without its cost sections (measured times and memory differ between any two sweeps)."""
    kept, skipping = [], False
    for line in (out / "report.md").read_text().replace(str(out), "OUT").splitlines():
        if line.startswith("#"):
            skipping = line.startswith("### Cost")
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def same_numbers(out: Path, ref: Path) -> None:
    assert (out / "report.csv").read_bytes() == (ref / "report.csv").read_bytes()
    assert accuracy_part(out) == accuracy_part(ref)
    for r in RUNS:  # run by run: the same numbers and the same identity
        a, b = (json.loads((d / r / "metrics.json").read_text()) for d in (out, ref))
        assert (a["top1"], a["per_class"], a.get("loss_curve")) == (b["top1"], b["per_class"], b.get("loss_curve")), r
        assert a[records.RECORD_KEY]["identity"] == b[records.RECORD_KEY]["identity"]


def finished(out: Path):
    return {r for r in RUNS if records.run_state(out / r).finished}


def sweep_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("sweep: ") and " runs, " in line)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "sweep.yaml"
    path.write_text(SWEEP)
    return path


@pytest.fixture(scope="module")
def reference(spec, tmp_path_factory):
    """The sweep run in one process, one run after another, with a feature store of its own."""
    root = tmp_path_factory.mktemp("reference")
    out = root / "out"
    assert main(["sweep", str(spec), f"out={out}", f"feature_store={root / 'store'}"]) == 0
    assert finished(out) == set(RUNS)
    return out


class Killer(threading.Thread):
    """Kills (SIGKILL) the process that holds the run directory ``victim``'s lock once the run has started
    (its config.yaml is written) and before it finishes: a worker killed mid-run."""

    def __init__(self, victim: Path):
        super().__init__(daemon=True)
        self.victim, self.killed, self.stop = victim, None, threading.Event()

    def run(self):
        while not self.stop.is_set():
            info = locks.read_lock(self.victim / locks.LOCK_FILE)
            if (info is not None and info.pid != os.getpid() and (self.victim / "config.yaml").exists()
                    and not (self.victim / "metrics.json").exists()):
                try:
                    os.kill(info.pid, signal.SIGKILL)
                    self.killed = info.pid
                except ProcessLookupError:
                    continue
                return
            time.sleep(0.005)


# ---------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_cluster():
    import ray  # in the test extra: CI runs this

    with worker_niceness(0):  # as run_ray starts a local cluster
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_a_local_ray_cluster_s_workers_are_not_niced(ray_cluster, monkeypatch):
    """Ray's default worker niceness (15) starves the runs beside any other job; fewclip's local cluster uses 0,
    and the setting is the environment's only during ray.init."""
    def niceness():
        return os.nice(0)

    assert ray_cluster.get(ray_cluster.remote(niceness).remote()) == 0
    monkeypatch.setenv(NICENESS_ENV, "7")
    with worker_niceness(3):
        assert os.environ[NICENESS_ENV] == "3"
    assert os.environ[NICENESS_ENV] == "7"
    monkeypatch.delenv(NICENESS_ENV)
    with worker_niceness(0):
        pass
    assert NICENESS_ENV not in os.environ


def test_ray_sweep_with_a_worker_killed_mid_run(ray_cluster, spec, reference, tmp_path, capsys):
    out = tmp_path / "out"
    killer = Killer(out / VICTIM)
    killer.start()
    code = main(["sweep", str(spec), f"out={out}", "launcher=ray"])
    killer.stop.set()
    stdout, log = capsys.readouterr()
    assert killer.killed is not None, "the run was not caught mid-run"
    assert code == 1, log[-3000:]  # a run failed: exit code 1, the others finished
    assert "4 ran, 1 failed" in sweep_line(stdout)
    assert f"{VICTIM}: its Ray task ended without a result" in stdout and f"log: {out / VICTIM / 'run.log'}" in stdout
    assert finished(out) == set(RUNS) - {VICTIM}
    assert (out / VICTIM / locks.LOCK_FILE).exists()  # the killed worker's lock is left behind ...

    assert main(["sweep", str(spec), f"out={out}", "launcher=ray"]) == 0  # ... and taken over
    assert sweep_line(capsys.readouterr().out).startswith("sweep: 5 runs, 4 already done, 1 ran")
    assert finished(out) == set(RUNS) and not (out / VICTIM / locks.LOCK_FILE).exists()
    same_numbers(out, reference)
    # every Ray task ran in a Ray worker process, not in this one; the victim in another than the killed one
    writers = {r: json.loads((out / r / "metrics.json").read_text())[records.RECORD_KEY]["writer"]["pid"] for r in RUNS}
    assert os.getpid() not in writers.values() and writers[VICTIM] != killer.killed


# ---------------------------------------------------------------- SLURM through submitit


def test_slurm_launcher_on_submitits_local_executor(spec, reference, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}", "launcher=slurm", "launcher.cluster=local",
                 "launcher.runs_per_task=3", "launcher.time_min=20"]) == 0
    stdout, log = capsys.readouterr()
    assert sweep_line(stdout).startswith("sweep: 5 runs, 0 already done, 5 ran")
    assert "submitted 2 array task(s)" in log
    assert len(list((out / ".submitit").glob("*_result.pkl"))) == 2  # two tasks, three runs and two
    same_numbers(out, reference)


SUBMISSION_ARGS = ["launcher=slurm", "launcher.partition=gpu-a100", "launcher.gpus_per_task=2",
                   "launcher.cpus_per_task=8", "launcher.time_min=90", "launcher.mem_gb=48",
                   "launcher.array_parallelism=2", "launcher.runs_per_task=2", "launcher.account=lab",
                   "launcher.setup=[module load cuda/12]", "launcher.sbatch.exclude=node7"]


def test_slurm_dry_run_prints_the_submission_and_submits_nothing(spec, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}", *SUBMISSION_ARGS, "launcher.dry_run=true"]) == 0
    text = capsys.readouterr().out
    folder = (out / ".submitit").resolve()
    for line in ["#!/bin/bash", "#SBATCH --array=0-2%2", "#SBATCH --partition=gpu-a100", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=90", "#SBATCH --mem=48GB", "#SBATCH --account=lab",
                 "#SBATCH --exclude=node7", "#SBATCH --job-name=fewclip", f"#SBATCH --output={folder}/%A_%a_0_log.out",
                 "module load cuda/12"]:
        assert line in text.splitlines(), line
    assert f"-u -m submitit.core._submit {folder}" in text and "5 run(s) in an array of 3 task(s)" in text
    tasks = [line.split(": ", 1)[1].split(", ") for line in text.splitlines() if line.startswith("# task ")]
    assert tasks == [RUNS[:2], RUNS[2:4], RUNS[4:]]  # plan order, two runs per task
    assert not finished(out) and not folder.exists()  # nothing ran, nothing was submitted


def test_the_dry_run_shows_what_submitit_submits(spec, tmp_path, monkeypatch):
    """With stand-ins for srun and sbatch on PATH, submitit's own SlurmExecutor submits the array: the script
    it hands to sbatch is the one the dry run printed."""
    from fewclip.runs.launch import slurm
    from fewclip.runs.launch.worker import run_many
    from fewclip.runs.sweep import load_sweep_config

    bin_dir, captured = tmp_path / "bin", tmp_path / "submitted.sh"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ncp \"$1\" {captured}\necho Submitted batch job 4242\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = load_sweep_config([str(spec), *SUBMISSION_ARGS]).launcher
    out = tmp_path / "out"
    jobs = slurm.executor(cfg, out).map_array(run_many, [[], [], []], [None] * 3)  # what run_slurm submits
    assert [j.job_id for j in jobs] == ["4242_0", "4242_1", "4242_2"]
    assert captured.read_text() == slurm.submission_text(cfg, out, 3)


# ---------------------------------------------------------------- local workers and launchers side by side


@pytest.mark.slow  # each launcher on its own, and two sweeps on one out directory, are in the default run
def test_two_launchers_on_one_out_directory_do_each_run_once(spec, reference, tmp_path):
    """Local worker processes and the SLURM launcher (on submitit's local executor), started together on one
    out directory: every run is done once, by one of them, and the numbers are the reference's."""
    out = tmp_path / "out"
    env = {**os.environ, "FEWCLIP_DEBUG": "0"}
    cmd = [sys.executable, "-m", "fewclip.cli.main", "sweep", str(spec), f"out={out}", "report=false"]
    procs = [subprocess.Popen([*cmd, "launcher.workers=2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env),
             subprocess.Popen([*cmd, "launcher=slurm", "launcher.cluster=local", "launcher.runs_per_task=5"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    ran = [line for text in logs for line in text.splitlines() if "fewclip.runs.launch.progress: [" in line
           and ": top-1 " in line]  # each launcher's line for a run it ran itself
    assert len(ran) == len(RUNS), "\n".join(ran)
    for r in RUNS:
        assert (out / r / "run.log").read_text().count("fewclip.runs.launch.worker: run ") == 1  # one attempt
    assert main(["report", str(out)]) == 0
    same_numbers(out, reference)


def test_local_workers_survive_a_killed_worker(spec, reference, tmp_path, capsys):
    out = tmp_path / "out"
    killer = Killer(out / VICTIM)
    killer.start()
    code = main(["sweep", str(spec), f"out={out}", "launcher.workers=2"])
    killer.stop.set()
    stdout, log = capsys.readouterr()
    assert killer.killed is not None and code == 1, log[-3000:]
    assert f"{VICTIM}: its worker process (pid {killer.killed}) died during the run (exit code -9: killed)" in stdout
    assert finished(out) == set(RUNS) - {VICTIM}
    assert main(["sweep", str(spec), f"out={out}"]) == 0  # the next invocation, in this process, completes it
    assert sweep_line(capsys.readouterr().out).startswith("sweep: 5 runs, 4 already done, 1 ran")
    same_numbers(out, reference)


# ---------------------------------------------------------------- failures


def test_a_failed_run_does_not_stop_the_sweep_and_runs_again_next_time(spec, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["sweep", str(spec), f"out={out}", "sweep.methods=[zeroshot,coop,bad]", "sweep.shots=[1]",
            "sweep.variants.bad=[adapter=coop,adapter.n_ctx=2,train.lr=1e30]"]
    assert main(args) == 1
    stdout, _ = capsys.readouterr()
    bad = out / "toy-clip/toy-shapes/bad/1shot/seed1"
    assert "2 ran, 1 failed" in sweep_line(stdout)
    listed = stdout.split("run(s) failed", 1)[1]
    assert "bad/1shot/seed1: " in listed and "training loss became" in listed and f"log: {bad / 'run.log'}" in listed
    assert "Traceback" in (bad / "run.log").read_text()  # the trace is in the run's log, not on the terminal
    assert "## " in stdout  # the report of the runs that finished is still printed
    assert records.run_state(bad).kind == "missing"
    assert main(args) == 1  # tried again by the next invocation (and it diverges again)
    assert "sweep: 3 runs, 2 already done, 0 ran, 1 failed" in capsys.readouterr().out


def test_a_missing_extra_is_one_line_naming_the_install_command(spec, tmp_path, capsys, monkeypatch):
    for launcher, module, extra in (("ray", "ray", "ray"), ("slurm", "submitit", "slurm")):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
        assert main(["sweep", str(spec), f"out={tmp_path / launcher}", f"launcher={launcher}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f'pip install "fewclip[{extra}]"' in err, err
        assert not finished(tmp_path / launcher)


@pytest.mark.parametrize("arg, key", [("launcher=mpi", "launcher.name"), ("launcher.workers=0", "launcher.workers"),
                                      ("launcher.gpus_per_run=1.5", "launcher.gpus_per_run"),
                                      ("launcher.dry_run=true", "launcher.dry_run")])
def test_launcher_settings_are_checked_before_anything_runs(arg, key, spec, tmp_path, capsys):
    assert main(["sweep", str(spec), f"out={tmp_path}", arg]) == 2
    assert key in capsys.readouterr().err
    assert not finished(tmp_path)


# ---------------------------------------------------------------- resources per run


def test_runs_that_train_the_image_tower_get_whole_gpus(shapes):
    from fewclip.adapters import ADAPTERS, build_adapter
    from fewclip.adapters.ivlp import IVLPConfig
    from fewclip.adapters.lora import LoRAConfig
    from fewclip.adapters.promptsrc import PromptSRCConfig
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.runs.launch import RayConfig, gpus_for

    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    configs = [info.config_cls() for info in ADAPTERS.values()] + [LoRAConfig(towers=t) for t in ("text", "vision")]
    configs += [IVLPConfig(depth_vision=0), PromptSRCConfig(depth_vision=0)]  # text prompts only
    for cfg in configs:  # every adapter says before it is built what the built one does
        cls = ADAPTERS[cfg.name].adapter_cls
        built = build_adapter(cfg, bb, shapes.classnames, shapes.prompts("single"))
        assert cls.will_train_image_tower(cfg) == bool(built.trains_image_tower), cfg
    lc = RayConfig(gpus_per_run=0.25)
    assert gpus_for(lc, trains_image_tower=False) == 0.25 and gpus_for(lc, trains_image_tower=True) == 1.0
    assert gpus_for(RayConfig(gpus_per_run=2), True) == 2.0
    assert gpus_for(RayConfig(), True) == 0.0  # a CPU-only cluster


# ---------------------------------------------------------------- the feature store


def test_a_second_sweep_encodes_no_image_again(spec, reference, tmp_path, capsys, feature_store):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["sweep", str(spec), f"out={first}", "report=false"]) == 0
    assert main(["sweep", str(spec), f"out={second}"]) == 0
    for r in RUNS:
        a, b = (json.loads((d / r / "metrics.json").read_text()) for d in (first, second))
        assert b["images_encoded"] == a["images_encoded"] > 0
        assert b["images_encoded_shared"] == b["images_from_store"] == b["images_encoded"]  # all read from disk
        assert a["images_from_store"] == 0  # the first sweep encoded (or shared in memory) everything
    same_numbers(second, reference)  # which, with a store of its own, encoded everything itself
    capsys.readouterr()
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert f"feature store {feature_store}" in listing and "toy-clip  toy-shapes  (generated)  eval" in listing
    assert "view 1 seed 1" in listing
    assert main(["cache", "clear", "dataset=toy-colours"]) == 0 and "removed 0 feature group(s)" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0 and "removed 0 " not in capsys.readouterr().out
    assert main(["cache"]) == 0 and "0 group(s)" in capsys.readouterr().out


def test_store_addresses_and_requests(tmp_path, shapes, caplog):
    from fewclip.backbones.backbone import BackboneConfig, backbone_config_from_dict, load_backbone
    from fewclip.features.encode import Augment, FeatureCache, View
    from fewclip.features.store import VERSION, FeatureStore

    store = FeatureStore(tmp_path / "store")
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    items = shapes.items("train")[:10]
    got = FeatureCache(store).features(bb, shapes, items, batch_size=4)
    assert (got.encoded, got.from_store) == (10, 0)
    again = FeatureCache(store).features(bb, shapes, items, batch_size=4)  # another process, say
    assert (again.encoded, again.from_store) == (0, 10) and torch.equal(again.features.x, got.features.x)
    assert torch.equal(again.features.y, torch.tensor([it.label for it in items]))
    view = View(Augment.for_run(bb, shapes), seed=1, index=0)
    others = [dict(items=items[:9]), dict(items=items[::-1]), dict(items=items, batch_size=5),
              dict(items=items, view=view), dict(items=items, view=View(view.augment, seed=2, index=0)),
              dict(items=items, view=View(view.augment, seed=1, index=1))]
    for kw in others:  # another request, batch size, view or seed: another address
        kw = {"batch_size": 4, **kw}
        assert FeatureCache(store).features(bb, shapes, **kw).encoded == len(kw["items"]), kw
    windowed = load_backbone(backbone_config_from_dict({"name": "toy-clip", "device": "cpu",
                                                        "local_attention": {"vision": {"window": 2}}}))
    assert FeatureCache(store).features(windowed, shapes, items, batch_size=4).encoded == 10  # a tower variant
    # a damaged file is ignored (and replaced), never read as features
    group = next(p for p in (tmp_path / "store" / f"v{VERSION}").iterdir()
                 if json.loads((p / "address.json").read_text())["transform"]["kind"] == "eval"
                 and json.loads((p / "address.json").read_text())["batch_size"] == 4
                 and json.loads((p / "address.json").read_text())["variant"] == "|preproj")  # the plain tower's
    shard = next(group.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:40])
    fresh = FeatureCache(store).features(bb, shapes, items, batch_size=4)
    assert fresh.encoded == 10 and torch.equal(fresh.features.x, got.features.x)
    assert "damaged" in caplog.text


def test_no_store_when_it_is_off(spec, tmp_path, monkeypatch, feature_store):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}", "report=false", "sweep.methods=[zeroshot]"]) == 0
    assert not any(feature_store.iterdir())
    m = json.loads((out / RUNS[0] / "metrics.json").read_text())
    assert m["images_from_store"] == 0 and m["images_encoded"] == 16


def test_a_claim_survives_the_holder_tidying_its_temporary_file(tmp_path, monkeypatch):
    """The holder of a run's lock clears the run and removes leftover temporary files (records.remove_leftovers),
    among them the file a contender is about to link into place as the lock: the contender is told the run is
    busy (it tries again later), not stopped by an error."""
    holder = locks.RunLock(tmp_path)
    assert holder.try_acquire()
    link = os.link

    def tidied_first(src, dst):
        records.remove_leftovers(tmp_path)  # what clear_run does under the holder's lock
        return link(src, dst)

    monkeypatch.setattr(records.os, "link", tidied_first)
    contender = locks.RunLock(tmp_path)
    assert contender.try_acquire() is False and contender.blocked_by.pid == os.getpid()
    monkeypatch.setattr(records.os, "link", link)
    holder.release()
    assert contender.try_acquire()
    contender.release()

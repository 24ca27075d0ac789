"""Experiment logging (fewclip.utils.explog): TensorBoard's event files and W&B's offline runs read back and checked
against the run's metrics.json; one run per sweep cell, grouped by the sweep; a failing logger never stops a
run; a missing library is a one-line error before any work."""
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_offline import offline_runs

from fewclip.cli.main import main
from fewclip.config.compose import ConfigError
from fewclip.runs.run import load_train_config, run_train
from fewclip.runs.sweep import load_sweep_config
from fewclip.training.engine import cosine_lr
from fewclip.utils.explog import LogConfig, WandbConfig, final_scalars, for_sweep_cell, wandb_mode

# 2 shots x 8 classes in batches of 4: 4 steps per epoch, 3 epochs; validation scored every epoch
TRAIN = ["train", "adapter=coop", "data=toy-shapes", "shots=2", "seed=1", "train.epochs=3", "train.batch_size=4",
         "adapter.n_ctx=4", "data.max_test=40", "train.select=val", "log.every_n_steps=1"]
# what the W&B tests may not reach: no key, and any connection refused at once
NO_NETWORK = {"WANDB_BASE_URL": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
              "HTTP_PROXY": "http://127.0.0.1:9"}


def read(path):
    return json.loads(Path(path).read_text())


def scalars(folder: Path):
    """{tag: [(step, value), ...]} of the event files in ``folder``."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.fixture
def offline(monkeypatch):
    """W&B as on a machine without credentials or network (the mode is left to fewclip's default)."""
    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in NO_NETWORK.items():
        monkeypatch.setenv(k, v)  # also: the ~/.netrc entry of a `wandb login`, if any, is for another server


# ---------------------------------------------------------------- config


def test_log_shorthands_and_checks(tmp_path):
    assert load_train_config(["log=tensorboard"]).log.backends == ["tensorboard"]
    assert load_train_config(["log=[tensorboard,wandb]"]).log.backends == ["tensorboard", "wandb"]
    assert load_train_config(["log=none"]).log.backends == []
    assert load_train_config([]).log.backends == []  # default: no logging
    piece = tmp_path / "log.yaml"
    piece.write_text("log: wandb\n")
    assert load_train_config([str(piece)]).log.backends == ["wandb"]
    piece.write_text("log: [tensorboard, wandb]\n")
    assert load_sweep_config([str(piece)]).log.backends == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="log must name tensorboard, wandb or none, got 'tensorbord'"):
        load_train_config(["log=tensorbord"])
    with pytest.raises(ConfigError, match="log.wandb.mode must be one of online, offline, disabled"):
        load_train_config(["log=wandb", "log.wandb.mode=offlin"])
    with pytest.raises(ConfigError, match="log.every_n_steps must be >= 1"):
        load_train_config(["log.every_n_steps=0"])


def test_wandb_mode_is_offline_without_credentials(tmp_path):
    none = {"NETRC": str(tmp_path / "absent")}
    assert wandb_mode(WandbConfig(), none) == "offline"
    assert wandb_mode(WandbConfig(), {**none, "WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode(WandbConfig(), {**none, "WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode(WandbConfig(), {**none, "WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode(WandbConfig(mode="offline"), {"WANDB_API_KEY": "k", "WANDB_MODE": "online"}) == "offline"
    # `wandb login`'s ~/.netrc entry counts as credentials, for the server W&B is pointed at
    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    rc.chmod(0o600)
    assert wandb_mode(WandbConfig(), {"NETRC": str(rc)}) == "online"
    assert wandb_mode(WandbConfig(), {"NETRC": str(rc), "WANDB_BASE_URL": "http://127.0.0.1:9"}) == "offline"


def test_sweep_cell_names_and_final_scalars(tmp_path):
    path = "toy-clip/toy-shapes/coop/1shot/seed2"
    cell = for_sweep_cell(LogConfig(backends=["wandb"]), LogConfig(), tmp_path / "mysweep", path)
    assert (cell.backends, cell.dir, cell.name, cell.group) == (["wandb"], str(tmp_path / "mysweep"), path, "mysweep")
    own = for_sweep_cell(LogConfig(backends=["wandb"], name="n", group="g", dir="d"), LogConfig(), tmp_path / "s", "c")
    assert (own.dir, own.name, own.group) == ("d", "n/c", "g")  # what the user set stays; cells never share a name
    # log=... in sweep.args (the run's own section) when the sweep names no backend; none: left as it is
    args = for_sweep_cell(LogConfig(), LogConfig(backends=["tensorboard"]), tmp_path / "s", "c")
    assert (args.backends, args.name) == (["tensorboard"], "c")
    assert for_sweep_cell(None, LogConfig(), tmp_path / "s", "c") == LogConfig()
    m = {"top1": 81.5, "per_class": {"a": 80.0}, "loss_curve": [1.0], "ok": True, "peak_cuda_mib": None,
         "train_time_s": 1.5, "evals": {"base": {"top1": 90.0, "per_class": {}}, "new": {"top1": 70.0}}, "hm": 78.75}
    assert final_scalars(m) == {"final/top1": 81.5, "final/train_time_s": 1.5, "final/evals/base/top1": 90.0,
                                "final/evals/new/top1": 70.0, "final/hm": 78.75}


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_event_files_hold_the_curves_and_the_final_metrics(tmp_path):
    out = tmp_path / "run"
    assert main([*TRAIN, "log=tensorboard", f"out={out}"]) == 0
    m = read(out / "metrics.json")
    s = scalars(out / "tensorboard" / "run")
    steps = m["steps"]
    assert steps == 12 and m["epochs"] == 3
    # the loss and learning rate of every step
    assert [st for st, _ in s["train/loss"]] == list(range(1, steps + 1))
    lrs = [cosine_lr(i, steps, 4, 0.002, 1e-5) for i in range(steps)]  # CoOp's schedule: one warm-up epoch
    assert [v for _, v in s["train/lr"]] == pytest.approx(lrs, rel=1e-6)
    # each epoch's mean loss is metrics.json's loss curve, and the mean of that epoch's step losses (equal batches)
    assert [st for st, _ in s["epoch/loss"]] == [4, 8, 12]
    assert [v for _, v in s["epoch/loss"]] == pytest.approx(m["loss_curve"], abs=1e-5)
    step_losses = [v for _, v in s["train/loss"]]
    assert [sum(step_losses[i:i + 4]) / 4 for i in (0, 4, 8)] == pytest.approx(m["loss_curve"], abs=1e-4)
    # validation accuracy per epoch: the selected epoch is the best one
    val = [v for _, v in s["val/top1"]]
    assert len(val) == 3 and max(val) == pytest.approx(m["selected_val_top1"])
    assert val.index(max(val)) + 1 == m["selected_epoch"]
    # the final metrics and cost, equal to metrics.json's
    for key in ("top1", "n_test", "train_time_s", "wall_time_s", "images_encoded", "trainable_parameters"):
        assert s[f"final/{key}"] == [(steps, pytest.approx(m[key], rel=1e-6))], key
    assert not any(t.startswith("final/per_class") for t in s)


def test_logging_is_no_part_of_the_run_identity(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TRAIN, "log=tensorboard", f"out={out}"]) == 0
    before = (out / "metrics.json").stat().st_mtime_ns
    assert main([*TRAIN, f"out={out}"]) == 0  # the same run without logging: finished already, kept
    assert (out / "metrics.json").stat().st_mtime_ns == before


def test_every_n_steps_throttles_the_step_scalars_and_a_rerun_replaces_the_event_files(tmp_path):
    out = tmp_path / "run"
    assert main([*TRAIN, "log=tensorboard", f"out={out}"]) == 0
    assert main([*TRAIN, "log=tensorboard", "log.every_n_steps=5", "overwrite=true", f"out={out}"]) == 0
    assert len(list((out / "tensorboard" / "run").glob("events.out.tfevents.*"))) == 1
    s = scalars(out / "tensorboard" / "run")
    assert [st for st, _ in s["train/loss"]] == [1, 5, 10]
    assert len(s["epoch/loss"]) == 3  # every epoch still


# ---------------------------------------------------------------- W&B


def test_wandb_offline_run_holds_the_curves_and_the_summary(tmp_path, offline):
    out = tmp_path / "run"
    assert main([*TRAIN, "log=wandb", f"out={out}"]) == 0
    m = read(out / "metrics.json")
    (run,) = offline_runs(out / "wandb")  # offline by default: no key
    assert (run.name, run.project, run.exit_code) == ("run", "fewclip", 0)
    assert run.config["adapter"]["name"] == "coop" and run.config["shots"] == 2 and "log" not in run.config
    rows = [r for r in run.history if "train/loss" in r]
    assert [r["_step"] for r in rows] == list(range(1, m["steps"] + 1))
    assert [r["epoch/loss"] for r in run.history if "epoch/loss" in r] == pytest.approx(m["loss_curve"], abs=1e-5)
    assert [r["val/top1"] for r in run.history if "val/top1" in r][m["selected_epoch"] - 1] == m["selected_val_top1"]
    final = {k[len("final/"):]: v for k, v in run.summary.items() if k.startswith("final/")}
    expected = {k[len("final/"):]: v for k, v in final_scalars(m).items()}
    assert final == expected and final["top1"] == m["top1"] and final["train_time_s"] == m["train_time_s"]


def test_sweep_cells_are_runs_grouped_by_the_sweep(tmp_path):
    """Two cells, both backends, in a fresh process with no network and no key: it ends in time (offline
    never waits on a connection), with one TensorBoard folder and one W&B run per cell."""
    spec = tmp_path / "two.yaml"
    spec.write_text("sweep:\n  backbones: [toy-clip]\n  datasets: [toy-shapes]\n  methods: [coop]\n  shots: [1]\n"
                    "  seeds: [1, 2]\n  args: [train.epochs=2, adapter.n_ctx=4, data.max_test=40]\n")
    out = tmp_path / "mysweep"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(NO_NETWORK, OMP_NUM_THREADS="1")
    fewclip = Path(sys.executable).parent / "fewclip"
    done = subprocess.run([str(fewclip), "sweep", str(spec), f"out={out}", "report=false", "log=[tensorboard,wandb]"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    cells = [f"toy-clip/toy-shapes/coop/1shot/seed{s}" for s in (1, 2)]
    metrics = {c: read(out / c / "metrics.json") for c in cells}
    for c in cells:
        s = scalars(out / "tensorboard" / c)
        assert s["final/top1"][0][1] == pytest.approx(metrics[c]["top1"])
        assert len(s["epoch/loss"]) == 2
    runs = {r.name: r for r in offline_runs(out / "wandb")}
    assert sorted(runs) == cells
    for c in cells:
        assert runs[c].group == "mysweep" and runs[c].config["seed"] == metrics[c]["seed"]
        assert runs[c].summary["final/top1"] == metrics[c]["top1"]
        assert runs[c].summary["final/train_time_s"] == metrics[c]["train_time_s"]


# ---------------------------------------------------------------- failures


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "fewclip.utils.explog" and r.levelno >= logging.WARNING]


def test_a_failing_writer_gives_one_warning_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    from torch.utils.tensorboard import SummaryWriter

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    cfg = load_train_config([*TRAIN[1:], "log=tensorboard"])
    with caplog.at_level(logging.WARNING, logger="fewclip"):
        m = run_train(cfg, tmp_path / "run")
    (w,) = _warnings(caplog)
    assert "log=tensorboard: writing failed (OSError" in w.getMessage() and "the run goes on" in w.getMessage()
    assert "\n" not in w.getMessage()
    assert read(tmp_path / "run" / "metrics.json")["top1"] == m["top1"]


def test_a_logger_that_cannot_open_gives_one_warning_and_the_others_log(tmp_path, monkeypatch, caplog, offline):
    import wandb

    def refuse(*args, **kwargs):
        raise RuntimeError("the server said no\nsecond line")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = load_train_config([*TRAIN[1:], "log=[wandb,tensorboard]"])
    with caplog.at_level(logging.WARNING, logger="fewclip"):
        m = run_train(cfg, tmp_path / "run")
    (w,) = _warnings(caplog)
    assert w.getMessage() == ("log=wandb: opening failed (RuntimeError: the server said no); the run goes on "
                              "without it")
    assert scalars(tmp_path / "run" / "tensorboard" / "run")["final/top1"][0][1] == pytest.approx(m["top1"])


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_a_missing_library_is_one_line_before_any_work(backend, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, backend, None)  # import fails as if not installed
    out = tmp_path / "run"
    assert main([*TRAIN, f"log={backend}", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f'log={backend} needs {backend}, which is not installed: pip install "fewclip[{backend}]"')
    assert len(err.splitlines()) == 1
    assert not (out / "config.yaml").exists() and not (out / "metrics.json").exists()
    sweep = tmp_path / "sweep"
    assert main(["sweep", f"out={sweep}", "sweep.methods=[coop]", "sweep.shots=[1]", "sweep.seeds=[1]",
                 f"log={backend}"]) == 2
    assert f'pip install "fewclip[{backend}]"' in capsys.readouterr().err
    assert not (sweep / "sweep.yaml").exists()


def test_wandb_online_without_a_server_gives_one_warning_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    """A key but no reachable server: the wait is bounded by log.wandb.init_timeout_s, then the run goes on."""
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for k, v in NO_NETWORK.items():
        monkeypatch.setenv(k, v)
    cfg = load_train_config([*TRAIN[1:], "log=wandb", "log.wandb.init_timeout_s=2"])
    assert wandb_mode(cfg.log.wandb) == "online"
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fewclip"):
        m = run_train(cfg, tmp_path / "run")
    assert time.monotonic() - t0 < 120
    (w,) = _warnings(caplog)
    assert w.getMessage().startswith("log=wandb: opening failed (") and "the run goes on without it" in w.getMessage()
    assert read(tmp_path / "run" / "metrics.json")["top1"] == m["top1"]

"""Sweeps never report numbers that are not their own: runs whose identity changed run again, damaged or
half-written runs are not counted, a sweep killed at random points ends with the same report as one that
was not, and sweeps sharing an out directory do each run once and never mix two runs in one directory."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fewclip.cli.main import main
from fewclip.report import load_runs
from fewclip.runs import records

SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, coop, linear_probe]
  shots: [1]
  seeds: [1]
  args: [train.epochs=2, train.augment_views=1, data.max_test=16, backbone.device=cpu]
  variants:
    coop: [adapter=coop, adapter.n_ctx=2]
"""
RUNS = ["toy-clip/toy-shapes/zeroshot", "toy-clip/toy-shapes/coop/1shot/seed1",
        "toy-clip/toy-shapes/linear_probe/1shot/seed1"]


def run_dirs(out: Path):
    return {p.parent.relative_to(out).as_posix() for p in out.rglob("metrics.json")}


def leftovers(out: Path):
    """Temporary files, lock files, and anything else that is not a result."""
    return [p for p in out.rglob("*") if p.name.endswith((".tmp", ".broken")) or p.name.startswith(".fewclip")]


def sweep_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("sweep: "))


# ---------------------------------------------------------------- identity


def test_sweep_reruns_what_changed_and_only_that(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}", "report=false"]) == 0
    assert sweep_line(capsys.readouterr().out).startswith("sweep: 3 runs, 0 already done, 3 ran")
    assert run_dirs(out) == set(RUNS) and not leftovers(out)
    first = {r: json.loads((out / r / "metrics.json").read_text()) for r in RUNS}

    # Other args: the two training runs are no longer this sweep's (zero-shot runs have no train.* keys).
    assert main(["sweep", str(spec), f"out={out}", "report=false", "sweep.args=[train.epochs=3, "
                 "train.augment_views=1, data.max_test=16, backbone.device=cpu]"]) == 0
    stdout, log = capsys.readouterr()
    assert sweep_line(stdout).startswith("sweep: 3 runs, 1 already done, 2 ran, 2 of them rerun (identity changed)")
    assert "2 finished run(s) do not match this sweep and run again: config changed (train.epochs: 2 -> 3)" in log
    coop = json.loads((out / RUNS[1] / "metrics.json").read_text())
    assert coop["epochs"] == 3 and "epochs: 3" in (out / RUNS[1] / "config.yaml").read_text()
    assert json.loads((out / RUNS[0] / "metrics.json").read_text()) == first[RUNS[0]]  # kept

    # Back to the first args: rerun again, not the numbers of a sweep with other settings.
    assert main(["sweep", str(spec), f"out={out}", "report=false"]) == 0
    assert "2 of them rerun" in sweep_line(capsys.readouterr().out)
    again = json.loads((out / RUNS[1] / "metrics.json").read_text())
    assert again["epochs"] == 2 and again["top1"] == first[RUNS[1]]["top1"]


@pytest.fixture(scope="module")
def coop_sweep(tmp_path_factory):
    """A finished one-run sweep (CoOp), run once for the module; each test gets its own copy to damage:
    ``coop_sweep(tmp_path) -> (spec, out)``."""
    root = tmp_path_factory.mktemp("coop_sweep")
    spec = root / "s.yaml"
    spec.write_text(SWEEP.replace("zeroshot, coop, linear_probe", "coop"))
    # a feature store of its own: the tests' (conftest's feature_store) are set up after a module's fixtures
    assert main(["sweep", str(spec), f"out={root / 'out'}", "report=false", f"feature_store={root / 'store'}"]) == 0

    def copy(tmp_path: Path):
        shutil.copytree(root / "out", tmp_path / "out")
        return spec, tmp_path / "out"

    return copy


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / "metrics.json").write_text((d / "metrics.json").read_text()[:50]), "damaged"),
    (lambda d: (d / "metrics.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "metrics.json").read_text()).items() if k != records.RECORD_KEY})),
     "no run record"),
    (lambda d: (d / "adapter.safetensors").write_bytes((d / "adapter.safetensors").read_bytes()[:-4] + b"\0\0\0\0"),
     "adapter.safetensors changed"),
    (lambda d: (d / "split.json").unlink(), "split.json is missing"),
], ids=["truncated-metrics", "no-record", "adapter-changed", "split-missing"])
def test_a_damaged_run_is_not_counted_as_finished(damage, reason, coop_sweep, tmp_path, capsys):
    spec, out = coop_sweep(tmp_path)
    run = out / RUNS[1]
    assert records.run_state(run).finished  # the copy is a finished run until damaged
    damage(run)
    assert not records.run_state(run).finished
    # A report shows no run whose files no longer match its record (one without a record: an older fewclip's).
    reported = [r.path.parent for r in load_runs(out)[0]]
    assert reported == ([run] if reason == "no run record" else [])
    assert main(["sweep", str(spec), f"out={out}", "report=false"]) == 0
    stdout, log = capsys.readouterr()
    assert sweep_line(stdout).startswith("sweep: 1 runs, 0 already done, 1 ran")
    assert records.run_state(run).finished and not leftovers(out)
    if reason != "damaged":  # unreadable metrics hold no numbers: nothing to say about replacing them
        assert reason in log


def test_export_refuses_a_run_whose_files_changed(coop_sweep, tmp_path, capsys):
    _, out = coop_sweep(tmp_path)
    run = out / RUNS[1]
    assert records.run_state(run).finished
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("epochs: 2", "epochs: 4"))
    assert main(["export", str(run)]) == 2
    assert "not a valid finished run: config.yaml changed after the run finished" in capsys.readouterr().err
    assert not (run / "prompts.safetensors").exists()


def test_train_into_a_finished_directory(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "adapter=coop", "data=toy-shapes", "shots=1", "train.epochs=1", "train.augment_views=1",
            "adapter.n_ctx=2", "data.max_test=8", "backbone.device=cpu", f"out={out}"]
    assert main(args) == 0
    first = (out / "metrics.json").read_bytes()
    assert main(["export", str(out)]) == 0 and (out / "prompts.safetensors").is_file()
    assert main([*args, "log_level=warning", "data.workers=0"]) == 0  # the same run: kept, not run again
    assert (out / "metrics.json").read_bytes() == first
    assert main([*args, "shots=2"]) == 2  # another run: refused, untouched
    assert "overwrite=true" in capsys.readouterr().err
    assert (out / "metrics.json").read_bytes() == first and (out / "prompts.safetensors").is_file()
    assert main([*args, "shots=2", "overwrite=true"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["shots"] == 2 and "shots: 2" in (out / "config.yaml").read_text()
    assert len(json.loads((out / "split.json").read_text())["train"]) == 16
    assert not (out / "prompts.safetensors").exists()  # exported from the old run: removed with it
    assert records.is_finished(out) and not leftovers(out)


# ---------------------------------------------------------------- kills and concurrency

# One driver process imports fewclip once and forks the sweeps: a kill -9 of a forked child is a real
# kill at a random point, without paying the import for every restart.
DRIVER = textwrap.dedent("""
    import json, os, random, signal, sys, time
    from pathlib import Path
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot
    import torch
    import fewclip.runs.sweep, fewclip.report  # imported once, before any fork; no tensor op runs in this process
    from fewclip.cli.main import main

    def sweep(args, out):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)
                code = main(["sweep", *args, f"out={out}"])
            finally:
                os._exit(code)
        return pid

    def wait(pid):
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    mode, spec, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    result = {}
    if mode == "crash":
        kills, seed = int(sys.argv[4]), int(sys.argv[5])
        t0 = time.monotonic()
        result["reference"] = wait(sweep([spec], out / "reference"))
        duration = time.monotonic() - t0
        rng = random.Random(seed)
        result["kill_after_s"] = []
        for _ in range(kills):
            pid = sweep([spec], out / "killed")
            delay = rng.uniform(0.0, duration)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            result["kill_after_s"].append([round(delay, 2), wait(pid)])
        result["final"] = wait(sweep([spec], out / "killed"))
    else:  # two sweeps at once on one out directory, with the args given for each
        a, b = json.loads(sys.argv[4]), json.loads(sys.argv[5])
        pids = [sweep([spec, *a, "report=false"], out), sweep([spec, *b, "report=false"], out)]
        result["codes"] = [wait(p) for p in pids]
        result["pids"] = pids
    print(json.dumps(result))
""")


def drive(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-c", DRIVER, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "FEWCLIP_DEBUG": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def check_finished(out: Path):
    for r in RUNS:
        state = records.run_state(out / r)
        assert state.finished, (r, state.reason)
    assert not leftovers(out), leftovers(out)


def accuracy_part(report: Path, out: Path) -> str:
    """report.md without its cost sections (``### Cost, ...`` up to the next heading of the same or a higher level)."""
    kept, skipping = [], False
    for line in report.read_text().replace(str(out), "OUT").splitlines():
        if line.startswith("#"):
            skipping = line.startswith("### Cost")
        if not skipping:
            kept.append(line)
    assert not any("Cost" in line for line in kept)
    return "\n".join(kept)


def crash_test(tmp_path, kills, seed):
    spec = tmp_path / "s.yaml"
    spec.write_text(SWEEP)
    result, log = drive("crash", spec, tmp_path, kills, seed)
    assert result["reference"] == 0 and result["final"] == 0, log[-3000:]
    assert all(code == -9 or code == 0 for _, code in result["kill_after_s"])
    ref, killed = tmp_path / "reference", tmp_path / "killed"
    check_finished(ref)
    check_finished(killed)
    assert (killed / "report.csv").read_bytes() == (ref / "report.csv").read_bytes()
    # the accuracy tables agree to the byte; the cost tables (times, memory) are measurements and differ
    assert accuracy_part(killed / "report.md", killed) == accuracy_part(ref / "report.md", ref)
    for r in RUNS:  # the same numbers, run by run, and the same identity
        a, b = (json.loads((d / r / "metrics.json").read_text()) for d in (ref, killed))
        assert (a["top1"], a["per_class"], a.get("loss_curve")) == (b["top1"], b["per_class"], b.get("loss_curve"))
        assert a[records.RECORD_KEY]["identity"] == b[records.RECORD_KEY]["identity"]
    return result


def test_killed_sweep_ends_with_the_uninterrupted_report(tmp_path):
    crash_test(tmp_path, kills=3, seed=11)


@pytest.mark.slow
def test_killed_sweep_many_times(tmp_path):
    crash_test(tmp_path, kills=12, seed=2024)


def test_two_sweeps_with_the_same_config_do_each_run_once(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "out"
    result, log = drive("concurrent", spec, out, "[]", "[]")
    assert result["codes"] == [0, 0], log[-3000:]
    check_finished(out)
    writers = [json.loads((out / r / "metrics.json").read_text())[records.RECORD_KEY]["writer"]["pid"] for r in RUNS]
    assert set(writers) <= set(result["pids"])
    # the line each sweep prints for a run it ran (a run the other one ran is "done by another worker")
    lines = [line for line in log.splitlines() if "fewclip.runs.launch.progress: [" in line and ": top-1 " in line]
    assert len(lines) == len(RUNS), "\n".join(lines)  # every run trained and tested once, by one of the two
    for r in RUNS:  # and its log is that one attempt's
        assert (out / r / "run.log").read_text().count("fewclip.runs.launch.worker: run ") == 1


@pytest.mark.slow  # the same-config case covers the shared lock in the default run
def test_two_sweeps_with_different_configs_never_mix_a_run(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "out"
    args = "[train.epochs={}, train.augment_views=1, data.max_test=16, backbone.device=cpu]"
    result, log = drive("concurrent", spec, out, json.dumps([f"sweep.args={args.format(1)}"]),
                        json.dumps([f"sweep.args={args.format(3)}"]))
    assert result["codes"] == [0, 0], log[-3000:]
    check_finished(out)
    # Each run directory holds one run: the record vouches for its config, split and adapter (checked above),
    # and the metrics are those of the config next to them.
    coop = out / RUNS[1]
    m = json.loads((coop / "metrics.json").read_text())
    assert m["epochs"] in (1, 3) and f"epochs: {m['epochs']}\n" in (coop / "config.yaml").read_text()

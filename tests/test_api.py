"""The Python API (fewclip.api): the same runs as the command line, from keyword arguments."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import fewclip
from fewclip.api import to_args
from fewclip.cli.main import main
from fewclip.runs.records import RunDirError

ROOT = Path(__file__).resolve().parents[1]
DATA = {"name": "toy-shapes", "max_test": 40}


def test_keywords_become_the_command_line_s_keys():
    assert to_args({"shots": 4, "adapter": "coop", "seed": None, "train": {"epochs": 2, "lr": 0.002},
                    "data": {"name": "toy-shapes", "prompts": ["a photo of a {}: nice."]}, "log": ["tensorboard"],
                    "overwrite": True}) == [
        "shots=4", "adapter=coop", "train.epochs=2", "train.lr=0.002", "data.name=toy-shapes",
        'data.prompts=["a photo of a {}: nice."]', 'log=["tensorboard"]', "overwrite=true"]
    cfg = fewclip.api.train_config("coop", data={"name": "toy-shapes", "prompts": ["a photo of a {}: nice."]},
                                   options={"n_ctx": 4}, shots=2)
    assert cfg.data.prompts == ["a photo of a {}: nice."] and cfg.adapter.n_ctx == 4 and cfg.shots == 2


def test_a_run_from_python_is_the_run_the_command_line_makes(tmp_path, capsys):
    run = fewclip.train("tip_adapter", backbone="toy-clip", data=DATA, shots=1, seed=2, out=tmp_path / "py")
    assert main(["train", "adapter=tip_adapter", "backbone=toy-clip", "data=toy-shapes", "data.max_test=40",
                 "shots=1", "seed=2", f"out={tmp_path / 'cli'}"]) == 0
    cli = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert run.top1 == cli["top1"] and run.metrics["per_class"] == cli["per_class"]
    record = [json.loads((tmp_path / d / "metrics.json").read_text())["run_record"]["identity"] for d in ("py", "cli")]
    assert record[0] == record[1]  # the same run: a sweep or a rerun would take either as finished
    loaded = fewclip.load_run(tmp_path / "py")
    assert loaded.metrics == run.metrics and loaded.config["adapter"]["name"] == "tip_adapter"
    assert len(loaded.split.train) == len(loaded.split.classnames)  # one shot per class
    guesses = loaded.predict(__import__("torch").zeros(2, 3, 32, 32), top_k=2)
    assert len(guesses) == 2 and all(len(g) == 2 and g[0][0] in loaded.split.classnames for g in guesses)


def test_zeroshot_sweep_and_listings(tmp_path):
    zs = fewclip.zeroshot(backbone="toy-clip", data=DATA, out=tmp_path / "zs")
    assert zs.metrics["method"] == "zeroshot" and 0 <= zs.top1 <= 100
    result = fewclip.sweep(out=tmp_path / "sweep", feature_store="off",
                           sweep={"datasets": ["toy-shapes"], "methods": ["zeroshot", "tip_adapter"], "shots": [1],
                                  "seeds": [1], "args": ["data.max_test=40"]})
    assert result.counts["planned"] == 2 and result.counts["ran"] == 2 and not result.failures
    assert "tip_adapter" in result.report.markdown and (tmp_path / "sweep" / "report.csv").is_file()
    again = fewclip.sweep(out=tmp_path / "sweep", feature_store="off", report=False,
                          sweep={"datasets": ["toy-shapes"], "methods": ["zeroshot", "tip_adapter"], "shots": [1],
                                 "seeds": [1], "args": ["data.max_test=40"]})
    assert again.counts["ran"] == 0 and again.counts["done_before"] == 2 and again.report is None
    assert "coop" in fewclip.list_adapters() and "toy-shapes" in fewclip.list_datasets()
    assert any(b["name"] == "toy-clip" for b in fewclip.list_backbones())


def test_an_unfinished_folder_is_no_run(tmp_path):
    with pytest.raises(RunDirError, match="no finished run"):
        fewclip.load_run(tmp_path)


def test_import_fewclip_stays_light():
    code = "import sys, fewclip; print('torch' in sys.modules, callable(fewclip.__getattr__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


@pytest.mark.slow
def test_the_python_example_runs(tmp_path):
    """examples/python/first_steps.py, as the manual shows it (docs/api.md) (a fast test above covers each call it makes)."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "first_steps.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CoOp 4-shot top-1" in proc.stdout and "predicted:" in proc.stdout

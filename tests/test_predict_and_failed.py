"""`fewclip predict` over a folder into CSV or JSON, and failed runs' folders marked failed (issue 36, item 8)."""
from __future__ import annotations

import csv
import json

import pytest
from PIL import Image

from fewclip.adapter.exports import load_prompts
from fewclip.cli.main import main
from fewclip.data.base import DataConfig, build_dataset


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    run = root / "coop"
    assert main(["train", "adapter=coop", "data=toy-shapes", "shots=1", "train.epochs=1", "data.max_test=8",
                 f"out={run}"]) == 0
    assert main(["export", str(run), "-o", str(root / "prompts.safetensors")]) == 0
    ds = build_dataset(DataConfig(name="toy-shapes"))
    folder = root / "images"
    for i, item in enumerate(ds.items("test")[:5]):
        sub = folder / ("a" if i % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        ds.load_image(item).save(sub / f"{i}.png")
    (folder / "a" / "readme.txt").write_text("not an image: not listed")
    return root / "prompts.safetensors", folder


def test_predict_over_a_folder_writes_csv_and_json(exported, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    prompts, folder = exported
    images = sorted(str(p) for p in folder.rglob("*.png"))
    want = load_prompts(prompts, device="cpu").predict(images, top_k=2)
    out_csv, out_json = tmp_path / "p.csv", tmp_path / "p.json"
    assert main(["predict", f"prompts={prompts}", str(folder), "top_k=2", f"out={out_csv}", "batch_size=2"]) == 0
    assert "5 image(s) -> " in capsys.readouterr().out
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["image"] for r in rows] == images
    assert [(r["class_1"], r["class_2"]) for r in rows] == [(t[0][0], t[1][0]) for t in want]
    assert [float(r["probability_1"]) for r in rows] == pytest.approx([t[0][1] for t in want], abs=1e-6)
    assert main(["predict", f"prompts={prompts}", str(folder), "top_k=2", f"out={out_json}"]) == 0
    got = json.loads(out_json.read_text())
    assert [g["image"] for g in got] == images and [g["top"][0]["class"] for g in got] == [t[0][0] for t in want]
    assert main(["predict", f"prompts={prompts}", str(folder), f"out={tmp_path / 'p.txt'}"]) == 2
    assert "ending in .csv or .json" in capsys.readouterr().err


def test_a_failed_run_leaves_failed_json_not_half_written_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    root = tmp_path / "tex"
    for k, folder in enumerate(["a", "b"]):
        (root / folder).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (90 * k, 30 * i, 0)).save(root / folder / f"{i}.png")
    (root / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    out = tmp_path / "run"
    args = ["train", "adapter=linear_probe", "data=folder", f"data.root={root}", "shots=2", f"out={out}"]
    assert main(args) == 2  # the run reaches the broken file
    failed = json.loads((out / "failed.json").read_text())
    assert failed["status"] == "failed" and "broken.png" in failed["error"]
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "failed.json"]  # no split.json of a non-run
    assert main([*args, "data.skip_bad_images=true"]) == 0
    assert (out / "metrics.json").exists() and not (out / "failed.json").exists()


def test_a_command_that_fails_before_writing_leaves_no_empty_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    out = tmp_path / "never"
    assert main(["zeroshot", "data=toy-shaps", f"out={out}"]) == 2
    assert not out.exists()

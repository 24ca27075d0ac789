"""Unreadable or non-image files found up front and left out on request (issue 36, item 6)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from fewclip.cli.main import main


@pytest.fixture
def damaged(tmp_path) -> Path:
    root = tmp_path / "textile"
    for k, folder in enumerate(["hole", "nominal", "stain"]):
        (root / folder).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (40, 40), (70 * k, 20 * i, 90)).save(root / folder / f"{i}.jpg", format="JPEG")
    whole = io.BytesIO()
    Image.effect_noise((64, 64), 40).convert("RGB").save(whole, format="JPEG")
    (root / "nominal" / "cut.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])  # truncated
    (root / "stain" / "notes.jpg").write_text("not an image, only its name says so")
    return root


def test_datasets_check_lists_each_bad_file_once(damaged, capsys, monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    assert main(["datasets", "check", "data=folder", f"data.root={damaged}"]) == 1
    out = capsys.readouterr().out
    assert "textile: 20 images checked, 2 cannot be read:" in out
    assert out.count("cut.jpg") == 1 and out.count("notes.jpg") == 1 and "data.skip_bad_images=true" in out
    good = damaged.parent / "good"
    for folder in ("a", "b"):
        (good / folder).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(good / folder / "x.png")
    assert main(["datasets", "check", "data=folder", f"data.root={good}"]) == 0
    assert "all 2 images" in capsys.readouterr().out


def test_skip_bad_images_drops_them_and_the_run_records_which(damaged, tmp_path, monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    out = tmp_path / "zs"
    assert main(["zeroshot", "data=folder", f"data.root={damaged}", "data.skip_bad_images=true", f"out={out}"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_images"] == {"textile": ["nominal/cut.jpg", "stain/notes.jpg"]}


def test_a_sweep_stops_before_its_first_run_naming_the_files(damaged, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"sweep:\n  datasets: [{{name: folder, root: {damaged}}}]\n  methods: [zeroshot, linear_probe]\n"
                     "  shots: [1]\n  seeds: [1, 2]\n")
    out = tmp_path / "runs"
    assert main(["sweep", str(sweep), f"out={out}", "report=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("cut.jpg") == 1 and err.count("notes.jpg") == 1 and "no run started" in err
    assert not list(out.glob("**/metrics.json"))
    assert main(["sweep", str(sweep), f"out={out}", "report=false", "sweep.args=[data.skip_bad_images=true]"]) == 0
    assert len(list(out.glob("**/metrics.json"))) == 3

"""Class names and prompt templates from files, as CLIP_benchmark takes them (issue 36, item 3)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from fewclip.data.base import DataConfig, build_dataset
from fewclip.data.name_files import read_classnames, read_templates
from fewclip.utils.errors import InputError

FOLDERS = ["defect_hole", "nominal", "stain"]  # classes: "defect hole", "nominal", "stain"


@pytest.fixture
def textile(tmp_path) -> Path:
    root = tmp_path / "textile"
    for k, folder in enumerate(FOLDERS):
        (root / folder).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (60 * k, 10 * i, 90)).save(root / folder / f"{i}.png")
    return root


def _build(root, **kw):
    return build_dataset(DataConfig(name="folder", root=str(root), **kw))


@pytest.mark.parametrize("suffix, text", [
    (".json", json.dumps({"nominal": "a woven textile without defects", "defect_hole": "a textile with a hole"})),
    (".yaml", "nominal: a woven textile without defects\ndefect hole: a textile with a hole\n"),
    (".csv", "folder,classname\nnominal,a woven textile without defects\ndefect_hole,a textile with a hole\n"),
])
def test_a_mapping_from_folder_name_to_class_name(textile, tmp_path, suffix, text):
    f = tmp_path / f"names{suffix}"
    f.write_text(text)
    ds = _build(textile, classnames=str(f))
    # label order kept; a class the mapping leaves out keeps its own name
    assert ds.classnames == ["a textile with a hole", "a woven textile without defects", "stain"]


@pytest.mark.parametrize("suffix, text", [
    (".txt", "# one a line, label order\nhole\n\nplain weave\nstain mark\n"),
    (".json", json.dumps(["hole", "plain weave", "stain mark"])),
    (".json", json.dumps({"textile": ["hole", "plain weave", "stain mark"], "other": ["x", "y"]})),  # CLIP_benchmark
])
def test_a_list_of_class_names_in_label_order(textile, tmp_path, suffix, text):
    f = tmp_path / f"names{suffix}"
    f.write_text(text)
    assert _build(textile, classnames=str(f)).classnames == ["hole", "plain weave", "stain mark"]


@pytest.mark.parametrize("text, message", [
    (json.dumps({"nominall": "x"}), "'nominall' is not class(es) of the dataset"),
    ("a\nb\n", "2 name(s) for 3 classes"),
])
def test_a_class_name_file_that_does_not_fit_is_one_message(textile, tmp_path, text, message):
    f = tmp_path / ("bad.json" if text.startswith(("{", "[")) else "bad.txt")
    f.write_text(text)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _build(textile, classnames=str(f))


def test_prompt_templates_from_a_file(textile, tmp_path):
    lines = tmp_path / "prompts.txt"
    lines.write_text("a close-up photo of {}.\n# a comment\na macro shot of {c} fabric.\n")
    ds = _build(textile, prompts_file=str(lines))
    assert ds.templates == ["a close-up photo of {}.", "a macro shot of {} fabric."]
    bench = tmp_path / "templates.json"  # CLIP_benchmark's: templates per dataset, {c} for the class
    bench.write_text(json.dumps({"textile": ["a photo of {c}, a fabric."], "cars": ["a photo of a {c}."]}))
    assert read_templates(bench, "textile") == ["a photo of {}, a fabric."]
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholder\n")
    with pytest.raises(InputError, match=r"data.prompts_file=.*exactly one '\{\}'"):
        read_templates(bad)
    with pytest.raises(InputError, match="no such file"):
        read_classnames(tmp_path / "missing.json", ["a", "b"])
    with pytest.raises(ValueError, match="data.prompts and data.prompts_file"):
        DataConfig(prompts=["a {}"], prompts_file=str(lines))


def test_a_zero_shot_run_uses_the_files_and_they_are_part_of_its_identity(textile, tmp_path, monkeypatch, capsys):
    from fewclip.cli.main import main

    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    names, prompts = tmp_path / "names.json", tmp_path / "prompts.txt"
    names.write_text(json.dumps({"nominal": "a woven textile without defects"}))
    prompts.write_text("a photo of {}.\n")
    args = ["zeroshot", "data=folder", f"data.root={textile}", f"data.classnames={names}",
            f"data.prompts_file={prompts}", f"out={tmp_path / 'zs'}"]
    assert main(args) == 0
    metrics = json.loads((tmp_path / "zs" / "metrics.json").read_text())
    assert metrics["templates"] == ["a photo of {}."]
    assert "a woven textile without defects" in metrics["per_class"]
    prompts.write_text("a macro photo of {}.\n")  # another file content: another run, not "already finished"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "overwrite=true" in err, err

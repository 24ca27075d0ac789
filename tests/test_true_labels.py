"""Labels that are true: a run that got fewer shots than asked says so (metrics.json, its line, the report); the
templates in use are named; train, zeroshot and the shipped sweeps share one template default; a word-level
tokenizer names the words it does not know."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fewclip.cli.main import main

CLASSES = {"circle": 30, "square": 34, "triangle": 34}  # 30 images: 15 train (50/20/30 split); 34: 17


@pytest.fixture(scope="module")
def short_class(tmp_path_factory):
    """A folder dataset whose `circle` class has 15 training images, the others 17."""
    from fewclip.datasets import DataConfig, build_dataset

    ds = build_dataset(DataConfig(name="toy-shapes"))
    root = tmp_path_factory.mktemp("data") / "shapes"
    seen = {c: 0 for c in CLASSES}
    for it in ds.items("test"):
        name = ds.classnames[it.label]
        if name in CLASSES and seen[name] < CLASSES[name]:
            (root / name).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.asarray(ds.load_image(it))).save(root / name / f"{seen[name]}.png")
            seen[name] += 1
    built = build_dataset(DataConfig(name="folder", root=str(root)))
    assert sum(1 for it in built.items("train") if it.label == 0) == 15
    return root


TRAIN = ["adapter=coop", "adapter.n_ctx=2", "train.epochs=1", "shots=16", "backbone.device=cpu", "data.max_test=12"]


def test_a_class_with_fewer_images_than_shots_is_recorded_and_marked(short_class, tmp_path, capsys):
    args = ["train", "data=folder", f"data.root={short_class}", *TRAIN]
    assert main([*args, f"out={tmp_path / 'no'}"]) == 2  # without allow_fewer_shots: an error naming the class
    assert "'circle' (15)" in capsys.readouterr().err
    assert main([*args, "data.allow_fewer_shots=true", f"out={tmp_path / 'run'}"]) == 0
    printed, log = capsys.readouterr()
    assert "coop 16-shot (fewest 15 per class) seed 1" in printed
    assert "1 class(es) have fewer than shots=16 training images" in log and "circle (15)" in log
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["shots"] == 16 and m["shots_per_class"] == {"circle": 15, "square": 16, "triangle": 16}

    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"""\
sweep:
  datasets: [{{name: folder, root: {short_class}}}]
  methods: [coop]
  shots: [4, 16]
  seeds: [1]
  args: [data.allow_fewer_shots=true, adapter.n_ctx=2, train.epochs=1, backbone.device=cpu, data.max_test=12]
""")
    assert main(["sweep", str(spec), f"out={tmp_path / 'sweep'}"]) == 0
    report = (tmp_path / "sweep" / "report.md").read_text()
    row = next([c.strip() for c in line.strip().strip("|").split("|")] for line in report.splitlines()
               if line.replace(" ", "").startswith("|shapes|coop|"))
    four, sixteen = row[2:4]
    assert sixteen.endswith("‡") and not four.endswith("‡")  # 4 shots: every class had them
    assert "‡ Fewer training images than shots in some class" in report
    assert "- `coop` on shapes at 16 shots: the fewest 15 per class" in report


def test_train_zeroshot_and_sweeps_share_the_single_template_default_and_name_it(capsys, tmp_path):
    from fewclip.config.compose import RunConfig, load_config
    from fewclip.runs.run import load_train_config
    from fewclip.runs.sweep import load_sweep_config, plan_sweep

    assert load_config([], RunConfig).data.templates == load_train_config([]).data.templates == "single"
    assert main(["zeroshot", "data=toy-shapes", "data.max_test=16", "backbone.device=cpu",
                 f"out={tmp_path / 'zs'}"]) == 0
    printed, log = capsys.readouterr()
    assert "template 'a photo of a {}.'" in printed
    assert "toy-shapes: 1 prompt template(s) (data.templates=single): a photo of a {}." in log
    m = json.loads((tmp_path / "zs" / "metrics.json").read_text())
    assert (m["templates"], m["templates_mode"]) == (["a photo of a {}."], "single")
    # the reference sweep keeps its ensemble column, and every other run of every shipped sweep names its
    # templates: so the default's change changed no run of a shipped sweep (nor any number the manual shows)
    ref = {r["method"]: load_train_config(r["args"]).data.templates
           for r in plan_sweep(load_sweep_config(["sweep/reference.yaml"]).sweep)}
    assert ref == {"zeroshot": "ensemble", "zeroshot_single": "single", "linear_probe": "ensemble"}
    sweeps = sorted((Path(__file__).resolve().parents[1] / "configs" / "sweep").glob("*.yaml"))
    assert len(sweeps) >= 10
    for path in sweeps:
        for r in plan_sweep(load_sweep_config([str(path)]).sweep):
            assert any(a.startswith("data.templates=") for a in r["args"]), (path.name, r["dir"])


def test_a_word_level_tokenizer_names_the_words_it_does_not_know(caplog):
    from fewclip.backbones.tokenizer import WordTokenizer

    tok = WordTokenizer(["a", "photo", "of", "red", "circle"])
    with caplog.at_level(logging.WARNING, logger="fewclip.backbones.tokenizer"):
        ids = tok.encode("a photo of a golden retriever")
        tok.encode("a photo of a golden circle")  # nothing new: nothing said
        tok(["a photo of a red blob."])
    assert ids[-2:] == [tok.unk_token_id] * 2
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "'golden', 'retriever' not in its vocabulary" in warned[0] and "<unk>" in warned[0]
    assert "'blob' not in its vocabulary" in warned[1]

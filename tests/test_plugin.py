"""A method, a dataset and a checkpoint format from outside the repository: examples/fewclip-plugin-example is
pip-installed (into a folder of its own on the path, so tests running beside these never see it half installed), and
fewclip finds them through its entry points, in every command and in a sweep's worker processes, with no edit to
fewclip."""
import importlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch

from fewclip.adapter.base import ADAPTERS
from fewclip.backbones.importer import FORMATS, import_checkpoint
from fewclip.data.base import DATASETS

# pip-installs the example (seconds); tests/test_frame.py covers entry points, a plugin launcher's sweep and a plugin
# geometry in the default run, CI runs these too.
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fewclip-plugin-example"
BIN = Path(sys.executable).parent
ENV = dict(os.environ)  # the commands' environment: PYTHONPATH holds the plugin's folder while it is installed


def fewclip(*args, cwd=None):
    """Run the installed `fewclip` command; its output (the command must exit 0)."""
    p = subprocess.run([str(BIN / "fewclip"), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       timeout=600, env=ENV)
    assert p.returncode == 0, f"fewclip {' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The example plugin installed as a user would (pip), but into a folder of its own put on this process's path
    and the commands' PYTHONPATH: installing into the shared environment let tests on other pytest workers see its
    entry points while its module was half installed or already removed. It is built from a copy, so pip's build
    folder never lands in the repository."""
    target = None
    if importlib.util.find_spec("fewclip_plugin_example") is None:
        root = tmp_path_factory.mktemp("plugin")
        source, target = root / EXAMPLE.name, root / "site"
        shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
        ENV["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    for registry in (ADAPTERS, DATASETS, FORMATS):
        registry.refresh()
    yield
    if target is not None:
        sys.path.remove(str(target))
        importlib.invalidate_caches()
        ENV.clear()
        ENV.update(os.environ)
        for registry, name in ((ADAPTERS, "centroid"), (DATASETS, "colour-patches"), (FORMATS, "npz")):
            registry.pop(name, None)


def test_the_plugin_is_listed_beside_the_builtins(plugin):
    assert "centroid" in ADAPTERS and "colour-patches" in DATASETS and "npz" in FORMATS
    assert ADAPTERS.source("centroid") == "fewclip_plugin_example.centroid"
    out = fewclip("adapters", "centroid")
    assert "[from fewclip_plugin_example.centroid]" in out
    assert "adapter.text_weight: 4  # copies of the zero-shot prototype" in out  # help from the field metadata
    assert "colour-patches" in fewclip("datasets")


def test_train_sweep_on_two_workers_export_and_predict(plugin, tmp_path):
    env_out = tmp_path / "runs"
    out = fewclip("train", "adapter=centroid", "data=colour-patches", "shots=4", "seed=1", "backbone=toy-clip",
                  f"out={env_out / 'one'}")
    metrics = json.loads((env_out / "one" / "metrics.json").read_text())
    assert metrics["method"] == "centroid" and metrics["n_test"] == 150 and "top-1" in out
    # a sweep on two local worker processes, each finding the plugin through the entry points
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("sweep:\n  backbones: [toy-clip]\n  datasets: [colour-patches]\n  methods: [zeroshot, centroid]\n"
                     "  shots: [1, 4]\n  seeds: [1, 2]\nlauncher:\n  workers: 2\n")
    out = fewclip("sweep", sweep, f"out={env_out / 'sweep'}")
    assert "sweep: 5 runs, 0 already done, 5 ran" in out and "centroid" in out
    report = (env_out / "sweep" / "report.md").read_text()
    assert "centroid" in report and "zeroshot" in report
    # the run exports through fewclip's generic adapter format and predicts what it scored
    fewclip("export", env_out / "one", "-o", tmp_path / "centroid.safetensors")
    from fewclip.adapter.exports import load_prompts
    from fewclip.data.base import build_dataset
    from fewclip.runs.run import load_train_config

    clf = load_prompts(tmp_path / "centroid.safetensors", device="cpu")
    ds = build_dataset(load_train_config(["data=colour-patches", "adapter=centroid"]).data)
    items = ds.items("test")[::15]
    for i, item in enumerate(items):
        ds.load_image(item).save(tmp_path / f"img{i}.png")
    preds = clf.predict([tmp_path / f"img{i}.png" for i in range(len(items))], top_k=1)
    printed = fewclip("predict", f"prompts={tmp_path / 'centroid.safetensors'}", tmp_path / "img0.png", "top_k=1")
    assert preds[0][0][0] in printed
    assert sum(p[0][0] == ds.classnames[it.label] for p, it in zip(preds, items)) >= len(items) // 2


def test_a_checkpoint_format_from_the_plugin_reads_what_open_clip_s_reads(plugin, tmp_path, monkeypatch):
    import open_clip.factory as factory

    cfg = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2,
                                           "head_width": 16},
           "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-npz", cfg)
    g = torch.Generator().manual_seed(3)
    model = open_clip.create_model("fewclip-test-npz", pretrained=None).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        model.logit_scale.fill_(math.log(30.0))
    sd = model.state_dict()
    np.savez(tmp_path / "model.npz", **{k: v.numpy() for k, v in sd.items()})
    torch.save(sd, tmp_path / "model.pt")
    _, ours = import_checkpoint("npz", tmp_path / "model.npz", tmp_path / "npz-card", {"model": "fewclip-test-npz"})
    _, ref = import_checkpoint("open_clip", tmp_path / "model.pt", tmp_path / "oc-card", {"model": "fewclip-test-npz"})
    x = torch.randn(3, 3, 32, 32, generator=g)
    with torch.no_grad():
        assert torch.equal(ours.encode_images(x), ref.encode_images(x))
    assert ours.geometry.params() == ref.geometry.params()
    assert "(npz)" in (tmp_path / "npz-card" / "card.yaml").read_text()

"""Exported prompts: export a real toy CoOp run, load it back, predict, and refuse what does not fit."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fewclip
from fewclip.adapter.exports import METADATA_KEY, ExportError, backbone_identity, check_backbone, load_prompts
from fewclip.adapters import build_adapter
from fewclip.adapters.coop_export import FORMAT_VERSION, read_prompts
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.cli.main import main
from fewclip.datasets import DataConfig, build_dataset, read_split
from fewclip.runs.export import export_run
from fewclip.runs.run import load_train_config

N_CTX, K = 4, 3


def train(out, *extra):
    args = ["train", "adapter=coop", "data=toy-shapes", "shots=1", "seed=1", "train.epochs=2",
            "train.augment_views=1", "data.max_test=16", "backbone.device=cpu", f"out={out}", *extra]
    assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "unified": train(root / "unified", f"adapter.n_ctx={N_CTX}"),
        "csc": train(root / "csc", "adapter.n_ctx=2", "adapter.csc=true", "train.epochs=1"),
    }


@pytest.fixture(scope="module")
def backbone():
    return load_backbone(BackboneConfig(name="toy-clip", device="cpu"))


@pytest.fixture(scope="module")
def prompts(runs, backbone):
    """The unified run exported with the library function."""
    done = export_run(runs["unified"], nearest=K, backbone=backbone)
    assert done.path == runs["unified"] / "prompts.safetensors"
    return done.path


@pytest.fixture(scope="module")
def clf(prompts, backbone):
    return load_prompts(prompts, backbone=backbone)


@pytest.fixture(scope="module")
def test_images():
    ds = build_dataset(DataConfig(name="toy-shapes"))
    items = ds.items("test")[:16]
    return [ds.load_image(it) for it in items], [ds.classnames[it.label] for it in items]


def run_adapter(run_dir, backbone):
    """The run's CoOp adapter rebuilt from config.yaml, split.json and adapter.safetensors."""
    cfg = load_train_config([str(run_dir / "config.yaml")])
    adapter = build_adapter(cfg.adapter, backbone, read_split(run_dir / "split.json").classnames, [])
    adapter.load_adapter_state_dict(load_file(str(run_dir / "adapter.safetensors")))
    return adapter


def rewrite(src, dst, edit_meta=None, edit_tensors=None):
    """Copy a prompt file with its metadata or tensors changed."""
    with safe_open(str(src), "pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_meta:
        edit_meta(meta)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst), metadata={METADATA_KEY: json.dumps(meta)})
    return dst


# -- round trip ---------------------------------------------------------------


def test_logits_equal_the_runs_adapter(runs, clf, backbone, test_images):
    adapter = run_adapter(runs["unified"], backbone)
    images, _ = test_images
    pixels = torch.stack([backbone.preprocess()(im) for im in images])
    with torch.no_grad():
        want = adapter(backbone.encode_images(pixels))
        torch.testing.assert_close(clf.prototypes, adapter.prototypes(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(clf.text_features, adapter.text_features(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(clf.ctx, adapter.ctx.detach())
    torch.testing.assert_close(clf.logits(pixels), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(clf.logits(images), want, atol=1e-5, rtol=1e-5)  # PIL images in
    assert clf.classnames == adapter.classnames
    assert clf.geometry.name == "clip"


@pytest.mark.parametrize("name", ["toy-euclip", "toy-meru", "toy-siglip"])
def test_round_trip_on_every_geometry(name, tmp_path, test_images):
    run = train(tmp_path / name, f"backbone={name}", "adapter.n_ctx=2", "train.epochs=1")
    clf = load_prompts(export_run(run).path, device="cpu")
    bb = clf.backbone
    images, _ = test_images
    raw = bb.encode_images(torch.stack([bb.preprocess()(im) for im in images]))
    with torch.no_grad():
        want = run_adapter(run, bb)(raw)
    torch.testing.assert_close(clf.logits_from_features(raw), want, atol=1e-5, rtol=1e-5)
    flipped = clf.with_classnames(clf.classnames[::-1])
    torch.testing.assert_close(flipped.logits_from_features(raw).flip(-1), want, atol=1e-5, rtol=1e-5)


def test_plain_formulas_of_the_docstring(clf, tmp_path, test_images):
    """The module docstring's recipe without fewclip gives the classifier's logits (clip, euclidean)."""
    images, _ = test_images
    raw = clf.backbone.encode_images(clf.pixels(images))
    p = clf.meta["geometry"]["params"]
    plain = p["logit_scale"] * torch.nn.functional.normalize(raw, dim=-1) @ clf.prototypes.T
    torch.testing.assert_close(plain, clf.logits_from_features(raw), atol=1e-5, rtol=1e-5)
    euc = load_prompts(export_run(train(tmp_path / "euc", "backbone=toy-euclip", "adapter.n_ctx=2",
                                        "train.epochs=1")).path, device="cpu")
    assert euc.geometry.name == "euclidean_sq"  # the docstring's euclidean formula, squared
    raw = euc.backbone.encode_images(euc.pixels(images))
    p = euc.meta["geometry"]["params"]
    plain = -p["logit_scale"] * torch.cdist(raw / raw.shape[-1] ** 0.5, euc.prototypes) ** 2
    torch.testing.assert_close(plain, euc.logits_from_features(raw), atol=1e-4, rtol=1e-5)


def test_metadata(prompts, runs, backbone):
    tensors, meta = read_prompts(prompts)
    C = len(meta["classnames"])
    assert set(tensors) == {"ctx", "prototypes", "text_features"}
    assert tensors["ctx"].shape[0] == N_CTX and tensors["prototypes"].shape == (C, 64)
    assert meta["format_version"] == FORMAT_VERSION and meta["fewclip_version"] == fewclip.__version__
    assert meta["backbone"]["weights_sha256"] == backbone.weights_sha256
    assert meta["backbone"]["config"]["name"] == "toy-clip"
    assert meta["geometry"]["params"]["logit_scale"] == pytest.approx(backbone.geometry.params()["logit_scale"])
    assert meta["prompt"] == {"class_token_position": "end", "n_ctx": N_CTX, "csc": False, "ctx_init": None}
    assert meta["tokenizer"]["type"] == "word"
    metrics = json.loads((runs["unified"] / "metrics.json").read_text())
    assert meta["run"]["top1"] == metrics["top1"]
    assert (meta["run"]["dataset"], meta["run"]["shots"], meta["run"]["seed"]) == ("toy-shapes", 1, 1)
    words = meta["nearest_words"]
    assert len(words) == N_CTX and all(len(w) == K and all(isinstance(t, str) for t in w) for w in words)


def test_export_cli_prints_a_summary(runs, tmp_path, capsys):
    out = tmp_path / "p.safetensors"
    assert main(["export", str(runs["unified"]), "-o", str(out), "nearest=2"]) == 0
    text = capsys.readouterr().out
    assert str(out) in text and "n_ctx=4" in text and "circle" in text
    _, meta = read_prompts(out)
    for i, w in enumerate(meta["nearest_words"]):
        assert f"ctx {i + 1}: {', '.join(w)}" in text and len(w) == 2


# -- predict --------------------------------------------------------------


def test_predict_cli(prompts, test_images, tmp_path, capsys):
    images, labels = test_images
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"img{i}.png"))
        images[i].save(paths[-1])
    assert main(["predict", f"prompts={prompts}", *paths, "top_k=2", "backbone.device=cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "softmax" in lines[0]
    for i, p in enumerate(paths):
        at = lines.index(p)
        rows = lines[at + 1 : at + 3]
        assert all(r.split()[1] in ("circle", "square", "triangle", "diamond", "cross", "star", "ring", "crescent")
                   for r in rows)
        assert float(rows[0].split()[0]) >= float(rows[1].split()[0])
    assert len(lines) == 1 + 2 * 3
    assert main(["predict", f"prompts={prompts}", paths[0], "backbone.device=cpu"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 1 + 5  # default top_k=5


def test_predict_api(clf, test_images):
    images, labels = test_images
    preds = clf.predict(images, top_k=3)
    assert len(preds) == len(images) and all(len(p) == 3 for p in preds)
    assert sum(p[0][0] == y for p, y in zip(preds, labels)) >= len(labels) // 2  # far above chance (1/8)
    probs = clf.probabilities(images)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(images)))


# -- new class names --------------------------------------------------------


def test_with_classnames_unified_is_consistent(clf, test_images):
    images, _ = test_images
    names = list(reversed(clf.classnames)) + ["moon", "plus"]
    new = clf.with_classnames(names)
    assert new.classnames == names and new.prototypes.shape[0] == len(names)
    cols = [names.index(n) for n in clf.classnames]
    torch.testing.assert_close(new.logits(images)[:, cols], clf.logits(images), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new.ctx, clf.ctx)


def test_with_classnames_csc_refuses_new_names(runs, backbone, tmp_path):
    done = export_run(runs["csc"], tmp_path / "csc.safetensors", nearest=K, backbone=backbone)
    words = done.meta["nearest_words"]
    assert len(words) == 8 and all(len(g) == 2 and all(len(w) == K for w in g) for g in words)
    csc = load_prompts(done.path, backbone=backbone)
    with pytest.raises(ExportError, match=r"unseen class.*'moon'.*class-specific"):
        csc.with_classnames(["circle", "moon"])
    sub = csc.with_classnames(["star", "circle"])  # trained classes: their own contexts
    torch.testing.assert_close(sub.prototypes, csc.prototypes[[5, 0]])


# -- refusals -------------------------------------------------------------------


def test_other_backbone_is_refused(prompts, backbone, tmp_path, capsys):
    other = rewrite(prompts, tmp_path / "other.safetensors",
                    edit_meta=lambda m: m["backbone"].update(weights_sha256="0" * 64))
    with pytest.raises(ExportError, match="exported from another backbone"):
        load_prompts(other, backbone=backbone)
    assert main(["predict", f"prompts={other}", "x.png", "backbone.device=cpu"]) == 2
    assert "exported from another backbone" in capsys.readouterr().err


def test_backbone_without_a_weights_file_checksum(prompts):
    """open_clip pretrained tags have no file checksum: the state dict's own checksum names them."""
    bb = load_backbone(BackboneConfig(name="toy-clip", device="cpu"))
    bb.weights_sha256 = None
    _, meta = read_prompts(prompts)
    meta["backbone"].update(backbone_identity(bb))
    assert meta["backbone"]["weights_sha256"] is None and len(meta["backbone"]["state_sha256"]) == 64
    check_backbone(meta, bb, prompts)
    with torch.no_grad():
        bb.model.text_projection.add_(1e-3)
    with pytest.raises(ExportError, match="exported from another backbone.*state-dict sha256"):
        check_backbone(meta, bb, prompts)


def test_damaged_files_are_refused(prompts, tmp_path, capsys):
    data = prompts.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=r"truncated\.safetensors is damaged"):
        read_prompts(truncated)
    assert main(["predict", f"prompts={truncated}", "x.png"]) == 2
    assert "truncated.safetensors" in capsys.readouterr().err

    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(prompts)), str(bare))
    with pytest.raises(ExportError, match=f"bare.safetensors has no '{METADATA_KEY}' metadata"):
        read_prompts(bare)
    newer = rewrite(prompts, tmp_path / "newer.safetensors", edit_meta=lambda m: m.update(format_version=99))
    with pytest.raises(ExportError, match="format version 99.*newer fewclip"):
        read_prompts(newer)
    no_classes = rewrite(prompts, tmp_path / "nocls.safetensors", edit_meta=lambda m: m.pop("classnames"))
    with pytest.raises(ExportError, match="'classnames' is missing"):
        read_prompts(no_classes)
    short = rewrite(prompts, tmp_path / "short.safetensors",
                    edit_tensors=lambda t: t.update(prototypes=t["prototypes"][:-1].contiguous()))
    with pytest.raises(ExportError, match=r"short.safetensors is damaged: prototypes has shape \(7, 64\)"):
        read_prompts(short)
    with pytest.raises(ExportError, match="not found"):
        read_prompts(tmp_path / "missing.safetensors")


def test_unreadable_image_is_named(prompts, tmp_path, capsys):
    bad = tmp_path / "not_an_image.png"
    bad.write_text("hello")
    assert main(["predict", f"prompts={prompts}", str(bad), "backbone.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot read image" in err and "not_an_image.png" in err


def test_a_probe_run_exports_in_the_generic_adapter_format_not_as_prompts(tmp_path, capsys):
    run = tmp_path / "probe"
    assert main(["train", "adapter=zs_probe", "data=toy-shapes", "shots=1", "seed=1", "adapter.epochs=1",
                 "data.max_test=8", "train.augment_views=1", "backbone.device=cpu", f"out={run}"]) == 0
    with pytest.raises(ExportError, match="nearest do not apply to zs_probe runs; their export takes no options"):
        export_run(run, nearest="3")
    assert main(["export", str(run)]) == 0
    assert "zs_probe export" in capsys.readouterr().out
    assert (run / "adapter_export.safetensors").is_file() and not (run / "prompts.safetensors").exists()


def test_import_fewclip_stays_light():
    code = "import sys, fewclip; assert callable(fewclip.load_prompts); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_with_classnames_refuses_a_string_one_class_and_warns_of_duplicates(clf, caplog):
    from fewclip.datasets import DatasetError

    with pytest.raises(DatasetError, match=r"with_classnames: expected a list of class names, got the string 'abc'"):
        clf.with_classnames("abc")  # list("abc") would be three classes a, b, c
    twice = clf.with_classnames(["circle", "circle", "square"])  # a class is its label: names may repeat
    assert "with_classnames: classes with the same name (so the same prompt): 'circle' (labels 0, 1)" in caplog.text
    assert twice.classnames == ["circle", "circle", "square"]
    with pytest.raises(DatasetError, match="at least 2 classes"):
        clf.with_classnames(["circle"])


def test_prompt_file_of_another_width_is_refused(prompts, backbone, tmp_path):
    from fewclip.adapters.coop_export import check_widths

    tensors, _ = read_prompts(prompts)
    check_widths(tensors, backbone, prompts)
    narrow = dict(tensors, prototypes=tensors["prototypes"][:, :32].contiguous(),
                  text_features=tensors["text_features"][:, :32].contiguous())
    with pytest.raises(ExportError, match="prototypes has width 32 but 'toy-clip' needs 64"):
        check_widths(narrow, backbone, prompts)

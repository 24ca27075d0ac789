"""Hostile inputs: every tensor of every file fewclip reads is checked for dtype, shape and finiteness, exports
check themselves against the checksums written with them, a diverged run is never recorded, a damaged torch zip
is named by its own CRC-32, and a split file's class names must be the dataset's. Each case builds the bad file
and drives the command line: one line on stderr, exit 2 for a bad input, exit 1 for a failed run."""
import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fewclip.cli.main import main
from fewclip.features.feature_file import write_feature_file

CLASSES = ["circle", "square", "triangle", "star"]


@pytest.fixture(autouse=True)
def no_store(monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", "off")


def one_error(capsys, code, want_code, *words):
    """The command exited ``want_code`` with one error line holding ``words`` and no trace."""
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if " INFO " not in line and " WARNING " not in line]
    assert code == want_code, err
    assert len(errors) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


def rewrite(src: Path, dst: Path, change) -> Path:
    """``src`` with ``change(tensors)`` applied and its metadata kept, written to ``dst``."""
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata=meta)
    return dst


def flip_bytes(path: Path, name: str, dst: Path) -> Path:
    """``path`` (a safetensors file) with 8 bytes inside tensor ``name``'s data replaced (header kept)."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    start = 8 + n + header[name]["data_offsets"][0]
    data[start : start + 8] = bytes([0x3F, 0x80, 0x12, 0x34, 0x40, 0x11, 0x22, 0x33])  # finite floats
    dst.write_bytes(bytes(data))
    return dst


# ---------------------------------------------------------------- 1: feature files


@pytest.fixture(scope="module")
def feature_file(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    C, D = len(CLASSES), 8
    text = torch.nn.functional.normalize(torch.randn(C, D, generator=g), dim=-1)

    def pool(n):
        y = torch.arange(n) % C
        return text[y] + 0.1 * torch.randn(n, D, generator=g), y

    path = tmp_path_factory.mktemp("ff") / "feats.safetensors"
    train = pool(32)
    views = torch.stack([train[0] + 0.01 * torch.randn_like(train[0]) for _ in range(2)])
    return write_feature_file(path, train=train, test=pool(16), classnames=CLASSES, text=text,
                              geometry={"name": "clip", "params": {"logit_scale": 100.0}}, views=views)


def test_the_good_feature_file_runs(feature_file, tmp_path):
    assert main(["zeroshot", "data=features", f"data.path={feature_file}", f"out={tmp_path / 'zs'}"]) == 0
    assert json.loads((tmp_path / "zs" / "metrics.json").read_text())["top1"] == 100.0


@pytest.mark.parametrize("case, change, words", [
    ("nan-text", lambda t: t["text"].__setitem__((0, 0), float("nan")), "text holds 1 NaN or infinite value(s)"),
    ("inf-text", lambda t: t["text"].__setitem__((2, 3), float("inf")), "text holds 1 NaN or infinite value(s)"),
    ("int-text", lambda t: t.__setitem__("text", t["text"].round().long()), "text holds int64 values"),
    ("nan-views", lambda t: t["train.views"].__setitem__((1, 0, 0), float("nan")),
     "train.views holds 1 NaN or infinite value(s)"),
    ("int-views", lambda t: t.__setitem__("train.views", t["train.views"].long()), "train.views holds int64"),
    ("views-shape", lambda t: t.__setitem__("train.views", t["train.views"][:, :5]),
     "train.views has shape [2, 5, 8], expected [V, 32, 8]"),
    ("float-labels", lambda t: t.__setitem__("train.y", t["train.y"].float()), "train.y holds float32 values"),
    ("nan-test", lambda t: t["test.x"].__setitem__((0, 0), float("nan")), "test.x holds 1 NaN"),
])
@pytest.mark.parametrize("method", ["zeroshot", "tip_adapter"])
def test_a_bad_tensor_in_a_feature_file_is_one_line(feature_file, tmp_path, capsys, case, change, words, method):
    bad = rewrite(feature_file, tmp_path / f"{case}.safetensors", change)
    out = tmp_path / "run"
    args = ["zeroshot"] if method == "zeroshot" else ["train", "adapter=tip_adapter", "shots=2"]
    code = main([*args, "data=features", f"data.path={bad}", f"out={out}"])
    one_error(capsys, code, 2, str(bad), words)
    assert not (out / "metrics.json").exists()


def test_changed_bytes_in_a_feature_file_are_named(feature_file, tmp_path, capsys):
    """Finite but changed features: the sha256 of each tensor that write_feature_file adds names the tensor."""
    for name in ("train.x", "text"):
        bad = flip_bytes(feature_file, name, tmp_path / f"{name}.safetensors")
        code = main(["zeroshot", "data=features", f"data.path={bad}", f"out={tmp_path / 'run'}"])
        one_error(capsys, code, 2, str(bad), f"the bytes of tensor {name!r} do not match the checksum")


# ---------------------------------------------------------------- 2: divergence after the last loss

TRAIN = ["train", "data=toy-shapes", "shots=1", "seed=1", "train.augment_views=1", "data.max_test=8",
         "backbone.device=cpu"]


def test_a_run_that_diverges_at_its_last_step_is_not_recorded(tmp_path, capsys):
    """Step 1 is the warm-up lr, step 2 (the last) 1e30: its loss is finite, its update is not."""
    out = tmp_path / "coop"
    code = main([*TRAIN, "adapter=coop", "adapter.n_ctx=2", "train.epochs=2", "train.lr=1e30", f"out={out}"])
    one_error(capsys, code, 1, "coop gives NaN or infinite logits for 8 of 8 images",
              "the run is not recorded as finished")
    assert not (out / "metrics.json").exists() and not (out / "adapter.safetensors").exists()
    code = main(["export", str(out)])
    one_error(capsys, code, 2, "not finished")


def test_non_finite_parameters_after_the_last_step_stop_the_run(tmp_path, capsys, monkeypatch):
    import fewclip.training.engine

    real = fewclip.training.engine.make_optimizer

    def poisoned(params, cfg, fused=False):
        opt = real(params, cfg, fused)
        step = opt.step

        def nan_step(*a, **k):  # the update itself goes non-finite, after a finite loss
            out = step(*a, **k)
            with torch.no_grad():
                for g in opt.param_groups:
                    for p in g["params"]:
                        p.fill_(float("nan"))
            return out

        opt.step = nan_step
        return opt

    monkeypatch.setattr(fewclip.training.engine, "make_optimizer", poisoned)
    out = tmp_path / "probe"
    code = main([*TRAIN, "adapter=coop", "adapter.n_ctx=2", "train.epochs=1", f"out={out}"])
    one_error(capsys, code, 1, "coop's parameters became NaN or infinite at step 1 (the last)")
    assert not (out / "metrics.json").exists()


# ---------------------------------------------------------------- 3: exports check themselves


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Finished toy runs of several export formats, each exported: {name: export path}, and an image."""
    from PIL import Image

    t = tmp_path_factory.mktemp("exports")
    made = {}
    for name, args, opts in (("maple", ["adapter=maple", "train.epochs=1"], []),
                             ("tip_adapter_f", ["adapter=tip_adapter_f", "train.epochs=1"], []),
                             ("coop", ["adapter=coop", "adapter.n_ctx=2", "train.epochs=1"], []),
                             ("clip_svd", ["adapter=clip_svd", "train.iterations=2"], ["merge=true"]),
                             ("lora", ["adapter=lora", "train.iterations=2"], ["merge=true"])):
        out = t / name
        assert main([*TRAIN, *args, f"out={out}"]) == 0, name
        dest = out / ("export" if name == "lora" else "export.safetensors")
        assert main(["export", str(out), "-o", str(dest), *opts]) == 0, name
        made[name] = dest
    made["clip_svd.merged"] = made["clip_svd"].with_name("export.merged.safetensors")
    made["lora.merged"] = made["lora"] / "merged.safetensors"
    made["lora.peft"] = made["lora"] / "adapter_model.safetensors"
    img = t / "img.png"
    Image.new("RGB", (32, 32), (200, 10, 10)).save(img)
    made["image"] = img
    return made


def first_float_tensor(path: Path) -> str:
    with safe_open(str(path), "pt") as f:
        return next(k for k in sorted(f.keys()) if f.get_slice(k).get_dtype().startswith(("F", "BF")))


def test_good_exports_predict(exports, capsys):
    for name in ("maple", "tip_adapter_f", "coop", "clip_svd", "clip_svd.merged", "lora", "lora.merged"):
        assert main(["predict", f"prompts={exports[name]}", str(exports["image"])]) == 0, name
        assert "nan" not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["maple", "tip_adapter_f", "coop", "clip_svd.merged", "lora.merged", "lora.peft"])
@pytest.mark.parametrize("damage", ["nan", "bytes"])
def test_a_damaged_export_is_refused_on_load(exports, tmp_path, capsys, name, damage):
    import shutil

    src = exports[name]
    if name == "lora.peft":  # the folder, with its peft weights damaged
        folder = tmp_path / "export"
        shutil.copytree(exports["lora"], folder)
        target, prompts = folder / src.name, folder
    else:
        target = prompts = tmp_path / src.name
        shutil.copy(src, target)
    key = first_float_tensor(src)
    if damage == "nan":
        rewrite(src, target, lambda t: t[key].view(-1).__setitem__(0, float("nan")))
        words = [f"{key}", "holds 1 NaN or infinite value(s)"]
    else:
        flip_bytes(src, key, target)
        words = [f"the bytes of tensor {key!r} do not match the checksum written with the file"]
    code = main(["predict", f"prompts={prompts}", str(exports["image"])])
    line = one_error(capsys, code, 2, *words)
    assert str(target) in line or str(prompts) in line
    assert "nan" not in capsys.readouterr().out


# ---------------------------------------------------------------- 4: a torch zip checkpoint's own CRC-32


def test_a_torch_zip_with_changed_bytes_in_a_tensor_is_named_by_its_crc(tmp_path, capsys):
    import shutil

    import fewclip

    ref = Path(fewclip.__file__).parent / "reference"
    card = tmp_path / "card.yaml"  # toy-clip's card on a torch zip of its weights (no pinned sha256)
    text = (ref / "toy-clip.yaml").read_text().replace("weights: toy-clip.safetensors", "weights: w.pt")
    card.write_text("\n".join(line for line in text.splitlines() if not line.startswith("sha256:")) + "\n")
    shutil.copy(ref / "toy-vocab.json", tmp_path / "toy-vocab.json")
    torch.save(load_file(str(ref / "toy-clip.safetensors")), tmp_path / "w.pt")
    zs = ["zeroshot", f"backbone={card}", "data=toy-shapes", "data.max_test=8"]
    assert main([*zs, f"out={tmp_path / 'good'}"]) == 0
    capsys.readouterr()
    with zipfile.ZipFile(tmp_path / "w.pt") as z:
        record = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray((tmp_path / "w.pt").read_bytes())
    off = record.header_offset
    start = off + 30 + int.from_bytes(data[off + 26 : off + 28], "little") + int.from_bytes(data[off + 28 : off + 30],
                                                                                          "little")
    data[start + 64 : start + 72] = bytes([0x3F, 0x80, 0x12, 0x34, 0x40, 0x11, 0x22, 0x33])  # finite floats
    (tmp_path / "w.pt").write_bytes(bytes(data))
    code = main([*zs, f"out={tmp_path / 'bad'}"])
    one_error(capsys, code, 2, str(tmp_path / "w.pt"), f"its record {record.filename!r} does not match the CRC-32")
    assert not (tmp_path / "bad" / "metrics.json").exists()


# ---------------------------------------------------------------- 13: a split file's class names


@pytest.fixture(scope="module")
def zhou_files(tmp_path_factory):
    t = tmp_path_factory.mktemp("splits")
    for data in ("toy-shapes", "toy-colours"):
        assert main(["split", "export", f"data={data}", "shots=2", "seed=1", "format=zhou",
                     f"out={t / data}.json"]) == 0
    return t


def edited(src: Path, dst: Path, rename) -> Path:
    obj = json.loads(src.read_text())
    for rows in obj.values():
        for row in rows:
            row[2] = rename(row[2])
    dst.write_text(json.dumps(obj))
    return dst


def first_row(path: Path, differs):
    """The first training or validation row whose name ``differs`` from the dataset's."""
    obj = json.loads(path.read_text())
    return next(row for section in ("train", "val") for row in obj[section] if differs(row))


SHAPES = ["circle", "square", "triangle", "diamond", "cross", "star", "ring", "crescent"]


@pytest.mark.parametrize("case", ["other-dataset", "one-name", "wrong-name", "renumbered-names"])
def test_a_split_files_class_names_must_be_the_datasets(zhou_files, tmp_path, capsys, case):
    shapes = zhou_files / "toy-shapes.json"
    if case == "other-dataset":  # toy-colours' split: the same image ids and labels, other classes
        path = zhou_files / "toy-colours.json"
    elif case == "one-name":
        path = edited(shapes, tmp_path / "one.json", lambda name: "circle")
    elif case == "wrong-name":
        path = edited(shapes, tmp_path / "wrong.json", lambda name: "hexagon" if name == "star" else name)
    else:  # the names of two classes swapped: each label is still one class
        swap = {"square": "triangle", "triangle": "square"}
        path = edited(shapes, tmp_path / "swapped.json", lambda name: swap.get(name, name))
    obj = json.loads(path.read_text())
    rows = [row for section in ("train", "val") for row in obj[section]]
    want = next(row for row in rows if row[2] != SHAPES[row[1]])
    words = [str(path), f"image {want[0]!r} is class {want[2]!r} in the file but {SHAPES[want[1]]!r}"]
    one_error(capsys, main(["split", "import", str(path), "data=toy-shapes"]), 2, *words)
    out = tmp_path / "run"
    code = main(["train", "adapter=linear_probe", "data=toy-shapes", "shots=2", "seed=1", "data.max_test=8",
                 f"data.fewshot_file={path}", f"out={out}"])
    one_error(capsys, code, 2, *words)
    assert not (out / "metrics.json").exists()


def test_names_that_differ_only_in_case_or_underscores_are_the_same(zhou_files, tmp_path, capsys):
    path = edited(zhou_files / "toy-shapes.json", tmp_path / "case.json", lambda name: f"_{name.upper()}_")
    assert main(["split", "import", str(path), "data=toy-shapes", "seed=1"]) == 0
    assert "the same training and validation images" in capsys.readouterr().out


@pytest.mark.parametrize("damage, words", [
    ("nan", "holds 1 NaN or infinite value(s)"),
    ("int", "holds int64 values where floating-point values belong"),
])
def test_a_legacy_runs_bad_adapter_tensors_are_not_exported(exports, tmp_path, capsys, damage, words):
    """A run without a record (an older fewclip's, or one written by hand) has no checksums: its tensors are
    checked against the adapter they are loaded into."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(exports["maple"].parent, run)
    (run / "export.safetensors").unlink()
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.pop("run_record")
    (run / "metrics.json").write_text(json.dumps(metrics))
    weights = run / "adapter.safetensors"
    key = first_float_tensor(weights)
    if damage == "nan":
        rewrite(weights, weights, lambda t: t[key].view(-1).__setitem__(0, float("nan")))
    else:
        rewrite(weights, weights, lambda t: t.__setitem__(key, t[key].round().long()))
    code = main(["export", str(run), "-o", str(tmp_path / "x.safetensors")])
    one_error(capsys, code, 2, str(weights), key, words)
    assert not (tmp_path / "x.safetensors").exists()

"""Few-shot split files (fewclip.data.split_files): CoOp's split_zhou JSON, 2SFS's JSON lines, manifests and a run's
split.json, written and read back, checked against datasets, and used by runs (data.fewshot_file)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from fewclip.cli.main import main
from fewclip.data.base import DataConfig, Item, build_dataset
from fewclip.data.protocols import make_plan
from fewclip.data.split_files import SplitFileError, read_file, resolve, split_from_file, write_file
from fewclip.data.splits import make_few_shot_split

FIXTURE = Path(__file__).parent / "fixtures" / "split_files_ref"
RUN = ["train", "adapter=linear_probe", "data=toy-shapes", "train.epochs=2", "data.max_test=40",
       "backbone.device=cpu"]


def ids(items):
    return [(it.id, it.label) for it in items]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def pets_root(tmp_path_factory):
    """CoOp's $DATA layout with a tiny oxford_pets: the fixture's split files and a 4x4 PNG per image."""
    root = tmp_path_factory.mktemp("data")
    shutil.copytree(FIXTURE / "oxford_pets", root / "oxford_pets")
    split = json.loads((root / "oxford_pets" / "split_zhou_OxfordPets.json").read_text())
    for rows in split.values():
        for relpath, label, _ in rows:
            path = root / "oxford_pets" / "images" / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (4, 4), (40 * label, 10, 10)).save(path, format="PNG")
    return root


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt, name", [("zhou", "split.json"), ("2sfs", "out" + os.sep), ("manifest", "split.csv"),
                                       ("manifest", "split.txt"), ("fewclip", "split.json")])
def test_export_then_import_gives_fewclips_own_draw(shapes, tmp_path, fmt, name):
    drawn = make_few_shot_split(shapes, 4, 3)
    out = str(tmp_path / name) + (os.sep if name.endswith(os.sep) else "")
    written = write_file(drawn, shapes, fmt, out)
    assert all(p.is_file() for p in written)
    sf = read_file(written[0])
    assert sf.format == fmt
    got = resolve(sf, shapes, seed=3, shots=4)
    assert ids(got.train) == ids(drawn.train) and len(got.train) == 4 * len(shapes.classnames)
    assert ids(got.val) == ids(drawn.val)  # a .txt manifest holds no val: the same seeded draw fills it
    assert got.source["sha256"] == sha256(written[0]) and got.source["format"] == fmt
    if fmt == "2sfs":
        assert [p.name for p in written] == ["shot_4-seed_3_train.jsonl", "shot_4-seed_3_val.jsonl"]
        assert got.source["other_files"] == {str(written[1].resolve()): sha256(written[1])}
        # given the val file, the pair is read as well
        assert ids(resolve(read_file(written[1]), shapes, seed=3, shots=4).train) == ids(drawn.train)


def test_zhou_export_is_coops_layout(shapes, tmp_path):
    drawn = make_few_shot_split(shapes, 2, 1)
    (path,) = write_file(drawn, shapes, "zhou", tmp_path / "s.json")
    obj = json.loads(path.read_text())
    assert set(obj) == {"train", "val", "test"}
    assert obj["train"][0] == [drawn.train[0].id, drawn.train[0].label, shapes.classnames[drawn.train[0].label]]
    assert len(obj["test"]) == len(shapes.items("test"))  # a whole split file: CoOp's read_split reads it


def test_line_order_does_not_change_the_split(shapes, tmp_path):
    drawn = make_few_shot_split(shapes, 2, 5)
    path = tmp_path / "m.txt"
    path.write_text("# my split\n" + "\n".join(it.id for it in reversed(drawn.train)) + "\n")
    assert ids(resolve(read_file(path), shapes, seed=5, shots=2).train) == ids(drawn.train)


def test_paths_match_by_their_trailing_part(tmp_path):
    root = tmp_path / "pics"
    for c in ("cat", "dog"):
        for i in range(6):
            path = root / c / f"{c}{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (4, 4)).save(path)
    ds = build_dataset(DataConfig(name="folder", root=str(root)))
    train = ds.items("train")
    a, b = train[0], train[-1]
    path = tmp_path / "m.csv"
    path.write_text(f"id,label,split\n/elsewhere/data/pics/{a.id},,train\n{b.id.split('/')[-1]},,train\n")
    got = resolve(read_file(path), ds, seed=1, allow_fewer=True)
    assert {it.id for it in got.train} == {a.id, b.id}


# ---------------------------------------------------------------- the 2SFS fixture


def test_2sfs_fixture_in_the_authors_layout(pets_root, capsys):
    ds = build_dataset(DataConfig(name="oxford_pets", root=str(pets_root)))
    train_file = pets_root / "oxford_pets" / "split_fewshot" / "shot_2-seed_1_train.jsonl"
    sf = read_file(train_file)
    assert sf.format == "2sfs" and (sf.shots, sf.seed) == (2, 1) and len(sf.train) == len(sf.val) == 6
    got = resolve(sf, ds, seed=1, shots=2)
    assert ids(got.train) == [("Abyssinian_2.jpg", 0), ("Abyssinian_4.jpg", 0), ("american_bulldog_1.jpg", 1),
                              ("american_bulldog_5.jpg", 1), ("american_pit_bull_terrier_2.jpg", 2),
                              ("american_pit_bull_terrier_3.jpg", 2)]
    assert {it.id for it in got.val} == {f"{c}_{i}.jpg" for c in ("Abyssinian", "american_bulldog",
                                                                 "american_pit_bull_terrier") for i in (6, 7)}
    assert main(["split", "import", str(train_file), "data=oxford_pets", f"data.root={pets_root}", "shots=2"]) == 0
    out = capsys.readouterr().out
    assert "2sfs split file" in out and "3 classes, all images found" in out
    assert "train: 6 images, 2 per class" in out and "val: 6 images, 2 per class" in out
    assert sha256(train_file) in out

    # fewclip's 2SFS export of the same split writes the same images and labels, the paths relative to $DATA as
    # theirs (the class names are fewclip's: "american bulldog")
    written = write_file(got, ds, "2sfs", pets_root / "again_train.jsonl", root=str(pets_root))

    def rows(path):
        return sorted((r["_impath"], r["_label"], r["_domain"]) for r in map(json.loads, path.read_text().splitlines()))

    assert rows(written[0]) == rows(train_file)
    assert rows(written[1]) == rows(train_file.with_name("shot_2-seed_1_val.jsonl"))


def test_a_run_trains_on_the_2sfs_fixture(pets_root, tmp_path):
    pattern = pets_root / "oxford_pets" / "split_fewshot" / "shot_{shots}-seed_{seed}_train.jsonl"
    out = tmp_path / "run"
    assert main(["train", "adapter=linear_probe", "data=oxford_pets", f"data.root={pets_root}", "shots=2", "seed=1",
                 "train.epochs=2", "backbone.device=cpu", f"data.fewshot_file={pattern}", f"out={out}"]) == 0
    split = json.loads((out / "split.json").read_text())
    assert [row[0] for row in split["train"]][:2] == ["Abyssinian_2.jpg", "Abyssinian_4.jpg"]
    train_file = Path(str(pattern).format(shots=2, seed=1))
    assert split["source"]["path"] == str(train_file.resolve()) and split["source"]["sha256"] == sha256(train_file)


# ---------------------------------------------------------------- runs


def test_run_on_a_file_equals_the_run_on_the_drawn_split(tmp_path, capsys):
    drawn_run, file_run = tmp_path / "drawn", tmp_path / "file"
    assert main([*RUN, "shots=2", "seed=2", f"out={drawn_run}"]) == 0
    path = tmp_path / "s.json"
    assert main(["split", "export", "data=toy-shapes", "shots=2", "seed=2", "format=zhou", f"out={path}"]) == 0
    assert main([*RUN, "shots=2", "seed=2", f"data.fewshot_file={path}", f"out={file_run}"]) == 0
    a = json.loads((drawn_run / "metrics.json").read_text())
    b = json.loads((file_run / "metrics.json").read_text())
    assert a["top1"] == b["top1"] and a["per_class"] == b["per_class"]
    assert "split_file" not in a
    assert b["split_file"] == {"path": str(path.resolve()), "format": "zhou", "sha256": sha256(path)}
    split_a = json.loads((drawn_run / "split.json").read_text())
    split_b = json.loads((file_run / "split.json").read_text())
    assert split_b.pop("source")["sha256"] == sha256(path)
    assert split_a == split_b
    assert f"fewshot_file: {path}" in (file_run / "config.yaml").read_text()
    # the record holds the file's checksum: another file of the same name is another run, even with the same images
    rows = json.loads(path.read_text())
    rows["train"] = rows["train"][1:] + rows["train"][:1]  # the same images, another order: the same split
    path.write_text(json.dumps(rows))
    assert main([*RUN, "shots=2", "seed=2", f"data.fewshot_file={path}", f"out={file_run}"]) == 2
    assert "holds the results of another run: data changed" in capsys.readouterr().err


def test_zeroshot_and_sweep_take_a_file_pattern(tmp_path, capsys):
    folder = tmp_path / "splits"
    for seed in (1, 2):
        assert main(["split", "export", "data=toy-shapes", "shots=1", f"seed={seed}", "format=2sfs",
                     f"out={folder}/"]) == 0
    spec = tmp_path / "sweep.yaml"

    def write_spec(methods, extra):
        spec.write_text(f"""\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [{methods}]
  shots: [1]
  seeds: [1, 2]
  args: [train.epochs=2, data.max_test=40, backbone.device=cpu{extra}]
""")

    write_spec("zeroshot, linear_probe", f', "data.fewshot_file={folder}/shot_{{shots}}-seed_{{seed}}_train.jsonl"')
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), f"out={out}", "report=false"]) == 0
    for seed in (1, 2):
        m = json.loads((out / f"toy-clip/toy-shapes/linear_probe/1shot/seed{seed}/metrics.json").read_text())
        assert m["split_file"]["path"] == str((folder / f"shot_1-seed_{seed}_train.jsonl").resolve())
        drawn = make_few_shot_split(build_dataset(DataConfig(name="toy-shapes")), 1, seed)
        split = json.loads((out / f"toy-clip/toy-shapes/linear_probe/1shot/seed{seed}/split.json").read_text())
        assert [tuple(r) for r in split["train"]] == ids(drawn.train)
    assert "split_file" not in json.loads((out / "toy-clip/toy-shapes/zeroshot/metrics.json").read_text())
    # zeroshot trains on no images: its run is the one without a split file (a sweep without it finds it done)
    write_spec("zeroshot", "")
    assert main(["sweep", str(spec), f"out={out}", "report=false"]) == 0
    assert "sweep: 1 runs, 1 already done, 0 ran" in capsys.readouterr().out


def test_base2new_keeps_the_base_images_of_a_split_of_all_classes(tmp_path):
    ds = build_dataset(DataConfig(name="toy-shapes"))
    path = tmp_path / "s.json"
    write_file(make_few_shot_split(ds, 2, 4), ds, "zhou", path)
    plan = make_plan("base2new", ds)
    got = split_from_file(str(path), plan.source, plan.train, shots=2, seed=4)
    assert ids(got.train) == ids(make_few_shot_split(plan.train, 2, 4).train)
    assert got.classnames == plan.train.classnames and got.source["sha256"] == sha256(path)


def test_a_base2new_run_on_a_file_of_all_classes_equals_the_drawn_run(tmp_path):
    path = tmp_path / "all.csv"
    assert main(["split", "export", "data=toy-shapes", "shots=2", "seed=3", "format=manifest", f"out={path}"]) == 0
    runs = []
    for extra in ([], [f"data.fewshot_file={path}"]):
        out = tmp_path / f"run{len(runs)}"
        assert main([*RUN, "protocol=base2new", "shots=2", "seed=3", *extra, f"out={out}"]) == 0
        runs.append(json.loads((out / "metrics.json").read_text()))
    assert runs[0]["evals"] == runs[1]["evals"] and runs[0]["evals"]["base"]["top1"] is not None
    assert runs[1]["split_file"]["sha256"] == sha256(path)


# ---------------------------------------------------------------- errors


def test_missing_images_are_one_error_listing_the_first_few(shapes, tmp_path, capsys):
    path = tmp_path / "m.txt"
    train = make_few_shot_split(shapes, 1, 1).train
    path.write_text("\n".join([it.id for it in train] + [f"train/nope{i}" for i in range(7)]) + "\n")
    with pytest.raises(SplitFileError, match=r"names 7 of its 15 image\(s\) that dataset 'toy-shapes' does not "
                                             r"have: 'train/nope0', .*'train/nope4' and 2 more"):
        resolve(read_file(path), shapes, seed=1)
    assert main(["split", "import", str(path), "data=toy-shapes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'train/nope0'" in err and "and 2 more" in err
    assert main([*RUN, "shots=1", f"data.fewshot_file={path}", f"out={tmp_path / 'r'}"]) == 2
    assert "does not have" in capsys.readouterr().err


@pytest.mark.parametrize("name, content, fmt", [
    ("s.json", '{"training": []}', "zhou"),
    ("s.json", '{"train": [["a.png", 0]]}', "zhou"),
    ("s.json", "not json", "zhou"),
    ("s_train.jsonl", '{"path": "a.png", "label": 0}\n', "2sfs"),
    ("s_train.jsonl", '{"_impath": "a.png", "_label": "0", "_domain": -1, "_classname": "circle"}\n', "2sfs"),
    ("s.csv", "path,class\na.png,0\n", "manifest"),
    ("s.csv", "id,label,split\na.png,0,test\n", "manifest"),
])
def test_wrong_format_names_the_file_and_the_expected_format(shapes, tmp_path, name, content, fmt, capsys):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SplitFileError, match=rf"{path} is not a {fmt} split file .*; expected "):
        read_file(path)
    assert main(["split", "import", str(path), "data=toy-shapes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err


def test_splits_that_do_not_fit_the_run(shapes, tmp_path):
    drawn = make_few_shot_split(shapes, 2, 1)
    path = tmp_path / "s.json"
    write_file(drawn, shapes, "zhou", path)
    with pytest.raises(SplitFileError, match=r"more than shots=1 .*set shots=2"):
        resolve(read_file(path), shapes, seed=1, shots=1)
    with pytest.raises(SplitFileError, match=r"fewer than shots=4 .*data.allow_fewer_shots=true"):
        resolve(read_file(path), shapes, seed=1, shots=4)
    assert len(resolve(read_file(path), shapes, seed=1, shots=4, allow_fewer=True).train) == len(drawn.train)

    test_image = shapes.items("test")[0]
    write_file(drawn.__class__(2, 1, drawn.train + [test_image], drawn.val), shapes, "zhou", path)
    with pytest.raises(SplitFileError, match=r"lists 1 test image\(s\) .* a run is scored on them"):
        resolve(read_file(path), shapes, seed=1)
    write_file(drawn.__class__(2, 1, drawn.train, drawn.train[:1]), shapes, "zhou", path)
    with pytest.raises(SplitFileError, match=r"lists 1 image\(s\) twice: .*\(train and val\)"):
        resolve(read_file(path), shapes, seed=1)
    first = drawn.train[0]
    relabelled = [Item(it.id, (it.label + 1) % len(shapes.classnames)) if it == first else it for it in drawn.train]
    write_file(drawn.__class__(2, 1, relabelled, drawn.val), shapes, "zhou", path)
    with pytest.raises(SplitFileError, match="names another class elsewhere"):
        resolve(read_file(path), shapes, seed=1)


def test_labels_may_number_classes_otherwise(shapes, tmp_path):
    drawn = make_few_shot_split(shapes, 1, 1)
    n = len(shapes.classnames)
    path = tmp_path / "m.csv"
    path.write_text("id,label,split\n" + "".join(f"{it.id},{n - 1 - it.label},train\n" for it in drawn.train))
    assert ids(resolve(read_file(path), shapes, seed=1, shots=1).train) == ids(drawn.train)


# ---------------------------------------------------------------- the command line


def test_split_help_is_light():
    code = ("import sys; from fewclip.cli.main import main; main(['split', '--help']); "
            "print('heavy' if 'torch' in sys.modules or 'omegaconf' in sys.modules else 'light')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: fewclip split export" in out and "data.fewshot_file" in out and "format:" in out
    assert out.strip().endswith("light")


@pytest.mark.parametrize("args", [["split"], ["split", "copy"], ["split", "import"], ["split", "export", "x"],
                                  ["split", "export", "format=csv", "out=x"], ["split", "export", "data=toy-shapes"]])
def test_split_usage_errors_are_one_line(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fewclip split: error:")


def test_import_compares_with_the_draw_of_a_seed(tmp_path, capsys):
    path = tmp_path / "s.csv"
    assert main(["split", "export", "data=toy-shapes", "shots=2", "seed=7", "format=manifest", f"out={path}"]) == 0
    assert main(["split", "import", str(path), "data=toy-shapes", "seed=7"]) == 0
    assert ("2-shot draw of seed 7 (data.sampler=fewclip): the same training and validation images"
            in capsys.readouterr().out)
    assert main(["split", "import", str(path), "data=toy-shapes", "seed=8"]) == 0
    out = capsys.readouterr().out
    assert "2-shot draw of seed 8 (data.sampler=fewclip): other training and validation images (" in out
    assert main(["split", "import", str(path), "data=toy-shapes", "seed=7", "data.sampler=coop"]) == 0
    out = capsys.readouterr().out  # toy-shapes lists classes in label order, each with more than 2 images: CoOp's
    assert "CoOp's 2-shot draw of seed 7 (data.sampler=coop): other validation images (" in out  # training draw
    assert out.rstrip().endswith("; the same training images")  # is fewclip's; its validation draw is not
    ids_only = tmp_path / "ids.txt"
    assert main(["split", "export", "data=toy-shapes", "shots=2", "seed=7", "format=manifest", f"out={ids_only}"]) == 0
    assert main(["split", "import", str(ids_only), "data=toy-shapes", "shots=2"]) == 0
    out = capsys.readouterr().out
    assert "train: 16 images, 2 per class" in out and "val: none (none in the file: a run draws them" in out


def test_import_names_what_differs_with_counts(shapes, tmp_path, capsys):
    """The same training images with other validation images is not "other images" (and the reverse)."""
    drawn = make_few_shot_split(shapes, 2, 7)
    taken = {it.id for it in drawn.train + drawn.val}
    spare = [it for it in shapes.items("val") if it.id not in taken]
    other_val = [spare[0], spare[1]] + drawn.val[2:]  # two validation images swapped for others
    other_train = [it for it in shapes.items("train") if it.id not in taken and it.label == drawn.train[0].label]
    cases = [(drawn.train, other_val, "other validation images (2 of the file's 16 validation images are not in the "
                                      "draw, 2 of the draw's 16 not in the file); the same training images"),
             ([other_train[0]] + drawn.train[1:], drawn.val,
              "other training images (1 of the file's 16 training images are not in the draw, 1 of the draw's 16 not "
              "in the file); the same validation images")]
    for train, val, says in cases:
        path = tmp_path / "s.csv"
        write_file(drawn.__class__(2, 7, train, val), shapes, "manifest", path)
        assert main(["split", "import", str(path), "data=toy-shapes", "seed=7"]) == 0
        assert f"2-shot draw of seed 7 (data.sampler=fewclip): {says}" in capsys.readouterr().out

"""CoOp's few-shot pickles (split_fewshot/shot_K-seed_S.pkl) read by a restricted unpickler: Dassl's Datum records
and plain containers only; anything else refused without running it. The three pickles under
tests/fixtures/coop_fewshot/*/split_fewshot were written by CoOp's own readers (make_draws.py)."""
import os
import pickle
import shutil
from pathlib import Path

import pytest

from fewclip.cli.main import main
from fewclip.data.base import DataConfig, build_dataset
from fewclip.data.coop_sampler import coop_split
from fewclip.data.split_files import SplitFileError, read_file, resolve
from fewclip.data.splits import make_few_shot_split
from helpers.coop_trees import FIXTURE, make_tree


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("coop_pickle_data")
    for name in ("oxford_pets", "fgvc_aircraft", "imagenet"):
        make_tree(root, name)
    return root


def pkl(name: str) -> Path:
    return FIXTURE / name / "split_fewshot" / "shot_2-seed_1.pkl"


def ids(items):
    return [(it.id, it.label) for it in items]


@pytest.mark.parametrize("name", ["oxford_pets", "fgvc_aircraft"])
def test_coops_pickle_is_coops_draw(data_root, name):
    ds = build_dataset(DataConfig(name=name, root=str(data_root)))
    sf = read_file(pkl(name))
    assert (sf.format, sf.shots, sf.seed) == ("coop_pickle", 2, 1)
    assert sf.train[0].path.startswith("/tmp/splits-ref/DATA/")  # the author's absolute paths, matched by their tail
    got = resolve(sf, ds, seed=1, shots=2, allow_fewer=True)
    drawn = coop_split(ds, 2, 1, allow_fewer=True)
    assert ids(got.train) == ids(drawn.train) and ids(got.val) == ids(drawn.val) and got.val


def test_split_import_and_a_run_take_coops_pickle(data_root, tmp_path, capsys):
    args = ["data.name=oxford_pets", f"data.root={data_root}", "data.allow_fewer_shots=true"]
    assert main(["split", "import", str(pkl("oxford_pets")), *args, "seed=1", "data.sampler=coop"]) == 0
    out = capsys.readouterr().out
    assert "coop_pickle split file" in out and "all images found" in out
    assert "CoOp's 2-shot draw of seed 1 (data.sampler=coop): the same training and validation images" in out
    from fewclip.runs.run import build_plan, few_shot_split, load_train_config

    cfg = load_train_config(["adapter=linear_probe", *args, "shots=2", "seed=1",
                             f"data.fewshot_file={FIXTURE}/{{dataset}}/split_fewshot/shot_{{shots}}-seed_{{seed}}.pkl"])
    plan = build_plan(cfg)
    split = few_shot_split(cfg, plan)
    assert ids(split.train) == ids(coop_split(plan.train, 2, 1, allow_fewer=True).train)
    assert split.source["format"] == "coop_pickle"


def test_imagenets_pickle_has_no_validation_and_none_of_its_images_validates(data_root):
    """CoOp's ImageNet pickle holds training images only, drawn from all of images/train, some of which fewclip
    holds out as validation: those must not be drawn as validation images (the leak of issue 32)."""
    ds = build_dataset(DataConfig(name="imagenet", root=str(data_root)))
    sf = read_file(pkl("imagenet"))
    assert sf.val is None
    held = {it.id for it in ds.items("val")}
    got = resolve(sf, ds, seed=1, shots=2, allow_fewer=True)
    train = {it.id for it in got.train}
    assert train & held  # the file trains on held-out images: the case that leaked
    assert got.val and not train & {it.id for it in got.val}
    assert {it.id for it in got.val} <= held


class Payload:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


class CallsEval:
    def __reduce__(self):
        return eval, ("open('/tmp/x', 'w')",)


def payloads(target: Path):
    yield r"\w+\.system", pickle.dumps({"train": [Payload(target)], "val": []})  # posix.system, nt.system
    yield r"\w+\.system", pickle.dumps(Payload(target), protocol=0)
    yield "builtins.eval", pickle.dumps({"train": [CallsEval()]})
    # Dassl's Datum named, but called with arguments (REDUCE) instead of rebuilt from its fields
    yield "calls a Datum record with arguments", (b"\x80\x04\x8c dassl.data.datasets.base_dataset\x94\x8c\x05Datum\x94\x93\x94"
                           b"\x8c\x01x\x94\x85\x94R\x94.")


def test_a_pickle_that_asks_for_anything_else_is_refused_unrun(tmp_path):
    target = tmp_path / "pwned"
    for i, (what, data) in enumerate(payloads(target)):
        path = tmp_path / f"shot_2-seed_{i}.pkl"
        path.write_bytes(data)
        with pytest.raises(SplitFileError, match=f"refused, unrun: .*{what}.*only Dassl's Datum records"):
            read_file(path)
        assert not target.exists(), what
    pickle.loads(pickle.dumps(Payload(target)))  # the payload does run when unpickled as pickle does
    assert target.exists()


def test_other_pickles_and_damaged_files_are_one_error(tmp_path, data_root):
    cases = [(pickle.dumps([1, 2]), "holds list, not CoOp's few-shot split"),
             (pickle.dumps({"train": [{"_impath": "a"}]}), "'train' is not a list of Dassl Datum records"),
             (pkl("oxford_pets").read_bytes()[:200], "not a readable pickle"),
             (pkl("oxford_pets").read_bytes().replace(b"_classname", b"_something"), "refused, unrun: a Datum record")]
    for data, says in cases:
        path = tmp_path / "shot_2-seed_1.pkl"
        path.write_bytes(data)
        with pytest.raises(SplitFileError, match=says):
            read_file(path)
    path = tmp_path / "split.json"
    shutil.copy(pkl("oxford_pets"), path)
    with pytest.raises(SplitFileError, match="it is a pickle; CoOp's few-shot pickles are format=coop_pickle"):
        read_file(path, "zhou")
    assert read_file(path).format == "coop_pickle"  # by its first byte, whatever its name


def test_coop_pickle_is_read_only(shapes, tmp_path):
    from fewclip.data.split_files import write_file

    with pytest.raises(SplitFileError, match="format=coop_pickle is read only"):
        write_file(make_few_shot_split(shapes, 1, 1), shapes, "coop_pickle", tmp_path / "x.pkl")

"""Bad input files reach the user as one line naming the file and the fix, exit 2; never as "unexpected ...
likely a bug in fewclip" (exit 1)."""
import logging

import pytest
import torch

from fewclip.cli.main import main


def one_error(capsys, command):
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "likely a bug in fewclip" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and lines[0].startswith(f"fewclip {command}: error: "), err
    return lines[0]


@pytest.mark.parametrize("content, words", [
    (b'{"embed_dim": 32,\n', ["is not a JSON model config (line 2 column 1", "give the open_clip model-config JSON"]),
    (b"\xff\xfe\x00garbage", ["is not a JSON model config (not UTF-8 text)"]),
    (b"[1, 2]", ["holds list JSON, not a model config"]),
])
def test_import_with_a_model_config_that_is_not_json(tmp_path, capsys, content, words):
    torch.save({"a": torch.zeros(2)}, tmp_path / "ck.pt")
    (tmp_path / "cfg.json").write_bytes(content)
    assert main(["import", "open_clip", str(tmp_path / "ck.pt"), f"model_config={tmp_path / 'cfg.json'}",
                 f"out={tmp_path / 'card'}"]) == 2
    line = one_error(capsys, "import")
    assert f"model_config={tmp_path / 'cfg.json'}" in line
    for w in words:
        assert w in line, (w, line)
    assert not (tmp_path / "card").exists()


def test_predict_with_an_export_whose_metadata_lists_fewer_classes(tmp_path, capsys):
    """A Tip-Adapter export (fewclip's generic adapter format) whose metadata names 3 of its 8 classes."""
    import json

    from PIL import Image
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fewclip.adapter.exports import METADATA_KEY

    run, export = tmp_path / "tip", tmp_path / "tip.safetensors"
    assert main(["train", "adapter=tip_adapter", "data=toy-shapes", "shots=1", "seed=1", "data.max_test=8",
                 "backbone.device=cpu", f"out={run}"]) == 0
    assert main(["export", str(run), "-o", str(export)]) == 0
    with safe_open(str(export), "pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert len(meta["classnames"]) == 8
    cut = tmp_path / "three.safetensors"
    save_file(tensors, str(cut), metadata={METADATA_KEY: json.dumps({**meta, "classnames": meta["classnames"][:3]})})
    Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "img.png")
    capsys.readouterr()
    assert main(["predict", f"prompts={cut}", str(tmp_path / "img.png"), "backbone.device=cpu"]) == 2
    line = one_error(capsys, "predict")
    # the export's own tensor check (fewclip.utils.tensor_checks) finds it first: the cache is for 8 classes
    assert f"{cut}: 'cache_values' has shape [8, 8], expected [?, 3]" in line and "export the run again" in line
    assert main(["predict", f"prompts={export}", str(tmp_path / "img.png"), "backbone.device=cpu"]) == 0


# ---------------------------------------------------------------- damaged TorchScript archives


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


def _rewrite(src, dst, change):
    """A copy of zip ``src`` at ``dst`` with ``change(name, data) -> data`` applied to each member."""
    import zipfile

    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
        for name in a.namelist():
            b.writestr(name, change(name, a.read(name)))


def _cyclic_pickle(qualname):
    """data.pkl of a module (of the archive's class ``qualname``) that holds itself as its child: pickle's memo
    allows it, torch.jit.save never writes it. Pickled from a stand-in class, whose global is then renamed."""
    import pickle
    import sys
    import types

    stand_in = types.ModuleType("fewclip_test_stand_in")
    stand_in.Small = type("Small", (), {"__module__": "fewclip_test_stand_in"})
    sys.modules["fewclip_test_stand_in"] = stand_in
    try:
        m = stand_in.Small()
        m.training = False
        m.child = m
        data = pickle.dumps(m, protocol=2)
    finally:
        del sys.modules["fewclip_test_stand_in"]
    module, name = qualname.rsplit(".", 1)
    assert b"cfewclip_test_stand_in\nSmall\n" in data
    return data.replace(b"cfewclip_test_stand_in\nSmall\n", f"c{module}\n{name}\n".encode())


def _class_of(path):
    import zipfile

    from fewclip.backbones.torchscript import _declarations, archive_prefix

    with zipfile.ZipFile(path) as z:
        return next(q for q in _declarations(z, archive_prefix(path)) if q.endswith("._Small"))  # the root's class


@pytest.mark.parametrize("change, words", [
    (lambda n, d: b"\xff\xfe" + d if n.endswith(".py") and "/code/" in n else d, ["is not UTF-8 text"]),
    (lambda n, d: d.replace(b"__parameters__ = [", b"__parameters__ = [weight, ") if n.endswith(".py") else d,
     ["__parameters__ is not a list of names"]),
    (lambda n, d: d.replace(b"__parameters__ = [", b"__parameters__ = [1, ") if n.endswith(".py") else d,
     ["__parameters__ is not a list of names"]),
    ("cycle", ["module tree has a cycle at child"]),
])
def test_a_damaged_torchscript_archive_is_a_bad_input(tmp_path, change, words):
    from fewclip.backbones.backbone import BackboneError, load_weights_file
    from fewclip.utils.errors import describe

    torch.jit.save(torch.jit.script(_Small()), str(tmp_path / "good.pt"))
    if change == "cycle":
        cyclic = _cyclic_pickle(_class_of(tmp_path / "good.pt"))
        change = lambda n, d: cyclic if n.endswith("/data.pkl") else d  # noqa: E731
    _rewrite(tmp_path / "good.pt", tmp_path / "bad.pt", change)
    with pytest.raises(BackboneError) as e:
        load_weights_file(tmp_path / "bad.pt")
    message, code = describe(e.value)
    assert code == 2 and message.startswith(f"cannot read TorchScript archive {tmp_path / 'bad.pt'}: ")
    for w in words:
        assert w in message, (w, message)
    assert "damaged or not made by torch.jit.save" in message


def test_an_import_onto_a_full_disk_is_one_line_about_the_card_folder(tmp_path, capsys, monkeypatch):
    import open_clip
    import open_clip.factory as factory

    import fewclip.backbones.importer

    # open_clip logs on the root logger: not through a handler an earlier command line left on a closed capture
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1,
                                           "head_width": 16},
           "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-test-full-disk", cfg)
    torch.save(open_clip.create_model("fewclip-test-full-disk", pretrained=None).state_dict(), tmp_path / "m.pt")

    def full(*args, **kwargs):  # what safetensors raises when the disk is full
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(fewclip.backbones.importer, "save_file", full)
    card = tmp_path / "cards" / "tiny"
    assert main(["import", "open_clip", str(tmp_path / "m.pt"), "model=fewclip-test-full-disk", f"out={card}"]) == 1
    line = one_error(capsys, "import")
    assert f"no space left on the device (or quota exceeded) writing {card / 'weights.safetensors'}" in line
    assert not card.exists() and list((tmp_path / "cards").iterdir()) == []  # no temporary card folder left

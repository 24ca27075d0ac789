"""backbone.pretrained=none: random weights seeded from backbone.seed, the same in every process, so a rerun of
the same command is the same run and the feature store serves its features."""
import json
import os
import subprocess
import sys

import pytest

from fewclip.backbones.backbone import Backbone, BackboneConfig, load_backbone
from fewclip.cli.main import main
from fewclip.utils.checksums import weights_checksum

TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}

# A fresh process: registers the tiny architecture, moves torch's global RNG by a process-specific amount (as
# other work would), builds the random backbone and prints its weights checksum.
_CHILD = """
import json, os, sys, torch
import open_clip.factory as factory
factory._MODEL_CONFIGS["fewclip-rw"] = json.loads(sys.argv[1])
torch.randn(int(sys.argv[3]))
from fewclip.backbones.backbone import Backbone, BackboneConfig, load_backbone
from fewclip.utils.checksums import weights_checksum
print(weights_checksum(load_backbone(BackboneConfig(name="fewclip-rw", pretrained="none", device="cpu",
                                                    seed=int(sys.argv[2])))))
"""


def _child(seed: int, noise: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(TINY), str(seed), str(noise)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def arch(monkeypatch):
    import open_clip.factory as factory

    monkeypatch.setitem(factory._MODEL_CONFIGS, "fewclip-rw", TINY)
    return "fewclip-rw"


@pytest.mark.slow
def test_two_processes_build_the_same_random_weights():
    a, b = _child(0, 3), _child(0, 1000)
    assert a == b and a.startswith("state:")
    assert _child(1, 3) != a  # the seed is what decides them


def test_the_seed_decides_the_weights_and_the_callers_rng_is_untouched(arch):
    import torch

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    w0 = weights_checksum(load_backbone(BackboneConfig(name=arch, pretrained="none", device="cpu")))
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG did not move
    torch.randn(17)  # whatever the process drew before does not matter
    assert weights_checksum(load_backbone(BackboneConfig(name=arch, pretrained="none", device="cpu", seed=0))) == w0
    assert weights_checksum(load_backbone(BackboneConfig(name=arch, pretrained="none", device="cpu", seed=5))) != w0


def test_the_same_command_on_random_weights_is_accepted_again_and_reuses_stored_features(arch, tmp_path, monkeypatch,
                                                                                        capfd):
    monkeypatch.setenv("FEWCLIP_CACHE", str(tmp_path / "store"))
    out = tmp_path / "run"
    cmd = ["train", "adapter=zeroshot", "data=toy-shapes", "data.max_test=24", f"backbone={arch}",
           "backbone.pretrained=none", "backbone.device=cpu", "shots=0", f"out={out}"]
    import torch

    assert main(cmd) == 0
    first = json.loads((out / "metrics.json").read_text())
    stored = sorted(p.name for p in (tmp_path / "store").rglob("*.safetensors"))
    assert stored
    torch.randn(99)  # another process state: the global RNG elsewhere
    capfd.readouterr()
    assert main(cmd) == 0  # before backbone.seed: "backbone weights changed", refused without overwrite=true
    assert "already finished with this config" in capfd.readouterr().err
    assert json.loads((out / "metrics.json").read_text()) == first
    other = tmp_path / "run2"
    encoded = []
    real = Backbone.encode_images
    monkeypatch.setattr(Backbone, "encode_images", lambda self, x, *a, **k: encoded.append(len(x)) or real(self, x, *a, **k))
    assert main([*cmd[:-1], f"out={other}"]) == 0  # a new run on the same random network: features from the store
    second = json.loads((other / "metrics.json").read_text())
    assert second["top1"] == first["top1"]
    assert second["run_record"]["parts"]["weights"] == first["run_record"]["parts"]["weights"]
    assert encoded == []  # every test image's features came from the store (before: encoded again)
    assert sorted(p.name for p in (tmp_path / "store").rglob("*.safetensors")) == stored
    # another seed is another run: its identity differs, so it is refused in the same folder
    assert main([*cmd, "backbone.seed=1"]) != 0

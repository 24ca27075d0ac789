"""A typo answered in under a second of CPU, before torch is imported, with close matches (issue 36, item 7)."""
from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from fewclip.cli.early_check import backbone_hint, check, check_backbone, open_clip_architectures
from fewclip.utils.errors import InputError

PROBE = ("import sys; from fewclip.cli.main import main; code = main(sys.argv[1:]); "
         "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")


@pytest.mark.parametrize("args, message", [
    (["train", "adapter=coop", "trian.epochs=3"], "Key 'trian' not in"),
    (["train", "shots=x"], "shots: Value 'x'"),
    (["train", "adapter=cop"], "unknown adapter 'cop' (adapter.name); did you mean 'coop'"),
    (["zeroshot", "backbone=toy-clp"], "unknown backbone 'toy-clp' (backbone); did you mean 'toy-clip'"),
    (["zeroshot", "backbone=ViT-B/32"], "did you mean 'ViT-B-32' (open_clip's spelling of OpenAI's ViT-B/32)?"),
    (["sweep", "sweep.backbones=[toy-clip,RN5O]"], "unknown backbone 'RN5O' (sweep.backbones); did you mean 'RN50'"),
    (["features", "backbone=toy-clipp"], "did you mean 'toy-clip'"),
    (["train", f"out={__file__}"], "is a file, not a folder; give out= a folder path"),
    (["sweep", f"out={__file__}/runs"], f"{__file__} is a file, not a folder"),
])
def test_a_typo_is_answered_before_torch_in_under_a_second_of_cpu(args, message):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "no torch" and "Traceback" not in proc.stderr
    assert cpu < 1.0, f"{cpu:.2f} s of CPU"  # CPU time, not wall: the same on a busy machine


def test_a_good_config_goes_on_to_the_full_command():
    """No false alarm: the names the full command accepts pass (a card file, an open_clip architecture), and a
    feature file's out= is a file, not a folder."""
    check("features", [f"out={__file__}"])
    assert "ViT-B-32" in open_clip_architectures() and "RN50" in open_clip_architectures()
    for name in ("toy-clip", "ViT-B-32", "RN50", "cards/mine.yaml"):
        check_backbone(name)
    with pytest.raises(InputError, match="unknown backbone 'RN-50'"):
        check_backbone("RN-50")
    assert backbone_hint("nothing-like-it-at-all", ["toy-clip"], ["RN50"]) == ""

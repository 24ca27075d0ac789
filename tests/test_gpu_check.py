"""scripts/gpu_check.py without a GPU: one line, exit 0; its measurements run on the CPU with a tiny model."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fewclip.backbones.backbone import BackboneConfig, load_backbone

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

NO_GPU = "gpu_check: no CUDA GPU on this machine; nothing to check (the CPU tests cover the rest)."


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu_check runs for real")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [NO_GPU]


@pytest.mark.slow  # the same main([]) in this process: test_without_a_gpu_it_says_so_in_one_line_and_exits_0
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu_check runs for real")
def test_without_a_gpu_the_script_says_so_in_one_line_and_exits_0():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == [NO_GPU]


@pytest.fixture(scope="module")
def bb():
    return load_backbone(BackboneConfig(name="toy-clip", device="cpu"))


@pytest.mark.parametrize("key", sorted(gpu_check.TEXT_METHODS))
def test_text_step_measurement_runs_on_the_cpu(bb, key):
    got = gpu_check.text_step(bb, key, ["circle", "square", "star"], "none", steps=1)
    assert got["method"] == key and got["classes"] == 3 and got["flops"] > 0 and got["s_per_step"] > 0
    assert got["peak_gb"] is None  # measured on CUDA only


def test_extraction_and_gemm_measurements_run_on_the_cpu(bb):
    e = gpu_check.extraction(bb, 4, "none", steps=1)
    assert e["bare_images_per_s"] > 0 and e["fewclip_images_per_s"] > 0 and e["share"] > 0
    assert gpu_check.gemm_tflops(64, torch.device("cpu"), torch.float32, steps=1) > 0


def test_the_table_marks_a_missed_target():
    result = {"device": "X", "torch": "2", "date": "d", "gemm_tflops": 100.0,
              "coop_epoch": {"arch": "ViT-B-16", "classes": 100, "shots": 16, "best_s_per_epoch": 1.0,
                             "reference_s_per_epoch": 5.0, "speedup_vs_reference": 5.0},
              "text_step": [{"method": "coop", "classes": 1000, "tflops": 50.0, "peak_gb": 3.0}],
              "extraction": {"batch": 256, "fewclip_images_per_s": 990.0, "bare_images_per_s": 1000.0, "share": 0.99}}
    table = gpu_check.markdown(result)
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").rsplit(" | ", 1)[1] for line in table.splitlines()
            if line.startswith("| ") and "---" not in line and not line.startswith("| target")}
    assert rows["CoOp epoch ViT-B-16 100x16 bf16 vs reference"] == "NO"  # 5x < 10x
    assert rows["text step coop 1000 classes"] == "yes" and rows["feature extraction, batch 256"] == "yes"

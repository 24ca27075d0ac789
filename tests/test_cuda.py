"""On a real GPU (marked ``cuda``; skipped without CUDA): what the device audit cannot see, run for real.

Every method's training steps (backward and optimiser included, under bf16 autocast) and scoring on the
GPU in two geometries; the feature store filled and read from the GPU; a sweep with local workers that
each get one GPU; a sweep on Ray with fractional GPUs. ``python scripts/gpu_check.py`` runs these with the
benchmarks; ``python -m pytest -m cuda`` runs them alone.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from fewclip.adapters import ADAPTERS, adapter_info, build_adapter
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.cli.main import main
from fewclip.features.encode import FeatureCache, Features
from fewclip.features.store import FeatureStore
from fewclip.training.compiled import compile_text_step, uncompile_text_step
from fewclip.training.engine import CachedFeatures, FitData, TrainConfig, amp_autocast, train_loop

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.py)")]

CLASSNAMES = ["circle", "square", "star", "golden retriever"]
TEMPLATES = ["a photo of a {}.", "a drawing of a {}."]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_backbones():
    return {name: load_backbone(BackboneConfig(name=name, device="cuda")) for name in ("toy-clip", "toy-meru")}


@pytest.mark.parametrize("backbone", ["toy-clip", "toy-meru"])
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_every_method_trains_and_scores_on_the_gpu(name, backbone, gpu_backbones):
    bb = gpu_backbones[backbone]
    info = adapter_info(name)
    gen = torch.Generator().manual_seed(0)
    px = torch.randn(8, 3, bb.image_size, bb.image_size, generator=gen)
    x, y = bb.encode_images(px).cpu(), torch.arange(8) % len(CLASSNAMES)
    adapter = build_adapter(info.config_cls(), bb, CLASSNAMES, TEMPLATES, generator=torch.Generator().manual_seed(0))
    assert all(t.device.type == "cuda" for t in adapter.state_dict().values())
    cfg = TrainConfig(amp="bf16", iterations=3, batch_size=4, warmup_epochs=0, compile="off")
    if adapter.trained_by == "loop" and not adapter.trains_image_tower:
        train_loop(adapter, CachedFeatures([Features(x, y)], Features.empty(x.shape[1])), cfg, 2,
                   torch.Generator().manual_seed(0))
    elif adapter.trained_by == "loop":  # the adapted image tower: backward through it on the GPU
        adapter.train()
        opt = torch.optim.SGD(adapter.trainable_parameters(), lr=1e-3)
        for _ in range(2):
            with amp_autocast(CUDA, "bf16"):
                extra = {"frozen": x[:4].to(CUDA)} if adapter.wants_frozen_features else {}
                loss = adapter.training_loss(adapter.encode_images(px[:4].to(CUDA)), y[:4].to(CUDA), **extra)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        adapter.eval()
    elif adapter.trained_by == "fit":
        views = [Features(x, y)] * adapter.fit_views()
        adapter.fit(FitData(Features(x, y), views, Features(x, y), cfg, 2, torch.Generator().manual_seed(0)))
    with torch.no_grad(), amp_autocast(CUDA, "bf16"):
        logits = adapter(x.to(CUDA))
    assert logits.device.type == "cuda" and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert all(torch.isfinite(p).all() for p in adapter.parameters())


def test_compiled_text_step_on_the_gpu(gpu_backbones):
    bb = gpu_backbones["toy-clip"]
    adapter = build_adapter(adapter_info("coop").config_cls(), bb, CLASSNAMES, TEMPLATES)
    x = bb.encode_images(torch.randn(4, 3, bb.image_size, bb.image_size))
    with torch.no_grad():
        want = adapter(x)
        compile_text_step(adapter)
        got = adapter(x)
        uncompile_text_step(adapter)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_feature_store_on_the_gpu(shapes, tmp_path, gpu_backbones):
    bb = gpu_backbones["toy-clip"]
    store = FeatureStore(tmp_path / "store")
    items = shapes.items("test")[:8]
    first = FeatureCache(store).features(bb, shapes, items)
    again = FeatureCache(store).features(bb, shapes, items)
    assert first.encoded == len(items) and again.from_store == len(items)
    assert first.features.x.device.type == "cpu" and torch.equal(first.features.x, again.features.x)
    assert [g.address["device"] for g in store.groups()] == ["cuda"]


SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, coop, linear_probe, lora]
  shots: [1]
  seeds: [1]
  args: [train.epochs=2, train.augment_views=1, data.max_test=16, backbone.device=cuda]
  variants:
    coop: [adapter=coop, adapter.n_ctx=2]
"""


def _sweep(tmp_path, *args):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}", f"feature_store={tmp_path / 'store'}", *args]) == 0
    metrics = [json.loads(p.read_text()) for p in Path(out).rglob("metrics.json")]
    assert len(metrics) == 4 and all(m["top1"] >= 0 for m in metrics)
    return metrics


def test_local_workers_one_gpu_each(tmp_path, monkeypatch):
    n = torch.cuda.device_count()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n)))))
    _sweep(tmp_path, f"launcher.workers={max(2, n)}")


def test_ray_with_fractional_gpus(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        _sweep(tmp_path, "launcher=ray", "launcher.gpus_per_run=0.25")  # four runs share the GPU
    finally:
        ray.shutdown()

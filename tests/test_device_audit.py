"""The device audit (fewclip.training.device_audit): every registered method, in every geometry, on a fake CUDA device.

For each method the backbone is moved to a fake ``cuda`` device, the adapter is built on it as a run builds
it, and three paths run under the audit: scoring (``adapter(features)``), the training loss's forward
(``training_loss``, through ``encode_images`` for methods that train the image tower) and the export's
classifier (written from a CPU adapter, loaded on the fake device, asked for logits of pixels). A tensor
on the wrong device, a tensor created on the CPU, or a host sync fails the test with the method and the
line. Fit-trained methods are fitted on the CPU (``fit`` runs once per run, some in float64 with L-BFGS on
the host by design) and their fitted state is loaded into the adapter on the device.
"""
import contextlib
import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from conftest import method_geometry_params

import fewclip.adapters.lora as lora_module
from fewclip.adapter.base import Adapter
from fewclip.adapter.exports import export_metadata
from fewclip.adapters import ADAPTERS, AdapterConfig, adapter_info, build_adapter, register_adapter
from fewclip.backbones.geometry import GEOMETRIES
from fewclip.features.encode import Features
from fewclip.training.device_audit import DataDependentOutputException, DeviceAuditError, FakeDevice, is_fake
from fewclip.training.engine import FitData, TrainConfig
from helpers.audit import CLASSNAMES, GEOMETRY_NAMES, TEMPLATES, backbones  # noqa: F401
from helpers.configs import small_config


def test_every_geometry_is_audited():
    assert set(GEOMETRY_NAMES) == set(GEOMETRIES)




def _data(bb, n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    px = torch.randn(n, 3, bb.image_size, bb.image_size, generator=gen)
    x = bb.encode_images(px)
    y = torch.arange(n) % len(CLASSNAMES)
    return px, x, y


@contextlib.contextmanager
def _no_seed_draw():
    """LoRA's build draws a seed from a CPU generator for peft's init (a host read, once per build, not a step);
    fake tensors have no values to read, and the draw decides nothing the audit looks at."""
    original = lora_module.forked_global_rng
    lora_module.forked_global_rng = lambda seed: contextlib.nullcontext()
    try:
        yield
    finally:
        lora_module.forked_global_rng = original


def _fitted_state(info, bb, x, y):
    """A fit-trained method fitted on the CPU, as the run does it; its state dict."""
    adapter = build_adapter(small_config(info.name), bb, CLASSNAMES, TEMPLATES, generator=torch.Generator().manual_seed(0))
    views = [Features(x, y)] * adapter.fit_views()
    adapter.fit(FitData(Features(x, y), views, Features(x, y), TrainConfig(), 2, torch.Generator().manual_seed(0)))
    return adapter, adapter.adapter_state_dict()


def audit_method(name: str, bb, tmp_path) -> dict:
    """Run the three paths of method ``name`` on ``bb`` moved to a fake CUDA device; returns what ran."""
    info = adapter_info(name)
    px, x, y = _data(bb)
    probe = build_adapter(small_config(info.name), bb, CLASSNAMES, TEMPLATES, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the features the method takes (ProLIP: the image tower's before its projection)
        x = probe.feature_tower().encode_images(px)
    cpu_adapter, state = _fitted_state(info, bb, x, y) if info.adapter_cls.trained_by == "fit" else (None, None)
    if cpu_adapter is None:
        cpu_adapter = build_adapter(small_config(info.name), bb, CLASSNAMES, TEMPLATES,
                                    generator=torch.Generator().manual_seed(0))
    export = None
    if info.export is not None:
        path = tmp_path / f"{name}{'' if info.export.default_path.endswith('.safetensors') else '_dir'}"
        path = path.with_suffix(".safetensors") if info.export.default_path.endswith(".safetensors") else path
        meta = info.export.write(cpu_adapter, path, export_metadata(cpu_adapter, info.export))
        export = (path, meta)
    ran = []
    device_bb = copy.deepcopy(bb)
    with FakeDevice() as dev, _no_seed_draw():
        dev.move(device_bb)
        adapter = build_adapter(small_config(info.name), device_bb, CLASSNAMES, TEMPLATES,
                                generator=torch.Generator().manual_seed(0))
        if state is not None:
            adapter.load_adapter_state_dict(state)
        assert all(is_fake(t) and t.device.type == "cuda" for t in adapter.state_dict().values())
        fx, fy, fpx = dev.tensor(x), dev.tensor(y), dev.tensor(px)
        with torch.no_grad():
            out = dev.audit(f"{name} scoring", lambda: adapter(fx), warmup=True)
        assert out.device.type == "cuda" and out.shape == (len(x), len(CLASSNAMES))
        ran.append("scoring")
        if info.adapter_cls.trained_by == "loop":
            adapter.train()
            extra = {"frozen": fx} if adapter.wants_frozen_features else {}
            feats = (lambda: adapter.encode_images(fpx)) if adapter.trains_image_tower else (lambda: fx)
            terms = dev.audit(f"{name} training loss", lambda: adapter.training_loss(feats(), fy, **extra),
                              warmup=True)
            assert terms["loss"].device.type == "cuda" and terms["loss"].dim() == 0
            adapter.eval()
            ran.append("training loss")
        if export is not None:
            try:
                clf = info.export.load(export[0], export[1], device_bb)
            except DataDependentOutputException:
                # The loader reads values once (LoRA's checks that the merged weights are finite): fake tensors
                # have none, so it loads on the CPU and the classifier is moved, as load_prompts(device=) would.
                with dev.paused():
                    clf = info.export.load(export[0], export[1], copy.deepcopy(bb))
                dev.move_attributes(clf)
                ran.append("export loaded on the CPU")
            logits = dev.audit(f"{name} export classifier", lambda: clf.logits(fpx), warmup=True)
            assert logits.device.type == "cuda" and logits.shape == (len(x), len(CLASSNAMES))
            ran.append("export classifier")
    return {"ran": ran}


@pytest.mark.parametrize("name, geometry", method_geometry_params(sorted(ADAPTERS), GEOMETRY_NAMES))
def test_every_method_stays_on_the_device(name, geometry, backbones, tmp_path):
    ran = audit_method(name, backbones[geometry], tmp_path)["ran"]
    info = adapter_info(name)
    assert "scoring" in ran
    assert ("training loss" in ran) == (info.adapter_cls.trained_by == "loop")
    assert ("export classifier" in ran) == (info.export is not None)


# ---------------------------------------------------------------- the audit catches what it is built for


@dataclass
class BrokenConfig(AdapterConfig):
    name: str = "test_broken_device"
    mistake: str = "cpu_tensor"


class Broken(Adapter):
    """A deliberately broken adapter: a linear head whose forward makes the mistake its config names."""

    name = "test_broken_device"

    def __init__(self, cfg, backbone, classnames, templates, *, generator=None):
        super().__init__(cfg, backbone, classnames, templates)
        D = backbone.encode_text(["a"]).shape[-1]
        self.head = nn.Linear(D, len(self.classnames))

    def forward(self, features):
        logits = self.head(features)
        if self.cfg.mistake == "cpu_tensor":
            return logits + torch.arange(logits.shape[-1])  # no device=: created on the CPU every step
        if self.cfg.mistake == "item":
            return logits * logits.abs().max().item()  # a host sync every step
        if self.cfg.mistake == "cpu_copy":
            return logits.cpu()
        return logits


@pytest.fixture
def broken():
    register_adapter("test_broken_device", BrokenConfig, Broken)
    yield
    del ADAPTERS["test_broken_device"]


@pytest.mark.parametrize("mistake, problem", [("cpu_tensor", "created on the CPU"), ("item", "a host sync"),
                                              ("cpu_copy", "a copy to the host")])
def test_a_broken_adapter_is_caught_with_its_line(broken, mistake, problem, backbones):
    bb = copy.deepcopy(backbones["clip"])
    _, x, _ = _data(bb)
    with FakeDevice() as dev:
        dev.move(bb)
        adapter = build_adapter(BrokenConfig(mistake=mistake), bb, CLASSNAMES, TEMPLATES)
        with pytest.raises(DeviceAuditError) as e:
            dev.audit("test_broken_device scoring", lambda: adapter(dev.tensor(x)))
    msg = str(e.value)
    assert msg.startswith("test_broken_device scoring: ") and problem in msg
    assert "test_device_audit.py:" in msg and "in forward" in msg  # the line of the mistake


def test_a_cpu_tensor_meeting_a_device_tensor_is_caught(backbones):
    bb = copy.deepcopy(backbones["hyperbolic"])
    _, x, _ = _data(bb)
    protos_on_cpu = torch.randn(3, x.shape[1])
    with FakeDevice() as dev:
        dev.move(bb)
        with pytest.raises(DeviceAuditError, match="tensors on different devices.*geometry.py"):
            dev.audit("geometry", lambda: bb.geometry.similarity(dev.tensor(x), protos_on_cpu))


def test_a_correct_adapter_passes(broken, backbones):
    bb = copy.deepcopy(backbones["clip"])
    _, x, _ = _data(bb)
    with FakeDevice() as dev:
        dev.move(bb)
        adapter = build_adapter(BrokenConfig(mistake="none"), bb, CLASSNAMES, TEMPLATES)
        out = dev.audit("fine", lambda: adapter(dev.tensor(x)))
    assert is_fake(out) and out.device.type == "cuda"

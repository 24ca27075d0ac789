"""The compiled text step and the fused optimiser (fewclip.training.compiled): the same logits and training as eager."""
import pytest
import torch

import fewclip.training.compiled as compiled
from fewclip.adapters import adapter_info, build_adapter
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.features.encode import Features
from fewclip.training.compiled import COMPILE_MODES, StepTuner, compile_text_step, is_compiled, uncompile_text_step
from fewclip.training.engine import CachedFeatures, TrainConfig, make_optimizer, train_loop

CLASSNAMES = ["circle", "square", "star", "golden retriever"]
# The prompt methods whose text side is compiled: CoOp unified and CSC, the CoCoOp family, the deep prompts.
METHODS = {"coop": {}, "coop_csc": {"csc": True}, "cocoop": {}, "maple": {}, "ivlp": {}, "kgcoop": {}, "tcp": {}}


@pytest.fixture(scope="module")
def bb():
    return load_backbone(BackboneConfig(name="toy-clip", device="cpu"))


def _build(bb, key, seed=0):
    name = key.split("_")[0]
    info = adapter_info(name)
    cfg = info.config_cls(**METHODS[key])
    return build_adapter(cfg, bb, CLASSNAMES, ["a photo of a {}."], generator=torch.Generator().manual_seed(seed))


def _features(bb, n=5):
    gen = torch.Generator().manual_seed(0)
    return bb.encode_images(torch.randn(n, 3, bb.image_size, bb.image_size, generator=gen))


def _logits_and_grads(adapter, x):
    adapter.zero_grad(set_to_none=True)
    logits = adapter(x)
    (logits.float().logsumexp(-1).sum()).backward()
    # (image-side prompts get none from features: they act in encode_images)
    return logits.detach(), [None if p.grad is None else p.grad.clone() for p in adapter.trainable_parameters()]


def _compare(bb, key, backend):
    adapter = _build(bb, key)
    adapter.train()
    x = _features(bb)
    want, want_g = _logits_and_grads(adapter, x)
    compile_text_step(adapter, backend=backend)
    assert is_compiled(adapter)
    got, got_g = _logits_and_grads(adapter, x)
    uncompile_text_step(adapter)
    assert not is_compiled(adapter)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert [g is None for g in got_g] == [w is None for w in want_g] and any(g is not None for g in got_g)
    for g, w in zip(got_g, want_g):
        if g is not None:  # summed in another order: within 1e-4 of the gradient's largest entry
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4 * w.abs().max().item())


@pytest.mark.parametrize("key", sorted(METHODS))
def test_compiled_text_step_equals_eager(bb, key):
    """The same path as inductor's (dynamo's capture, AOT autograd's forward and backward graphs), without
    generating code: seconds instead of a minute per method on a busy 2-core CPU."""
    _compare(bb, key, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["coop", "coop_csc", "cocoop", "maple"])
def test_inductor_text_step_equals_eager(bb, key):
    _compare(bb, key, "inductor")


def _run(bb, key, compile_mode, steps=10):
    adapter = _build(bb, key)
    x = _features(bb, 8)
    y = torch.arange(8) % len(CLASSNAMES)
    cfg = TrainConfig(compile=compile_mode, iterations=steps, batch_size=4, warmup_epochs=0)
    info = train_loop(adapter, CachedFeatures([Features(x, y)], Features.empty(x.shape[1])), cfg, 2,
                      torch.Generator().manual_seed(0))
    assert not is_compiled(adapter)  # the eager step is back after training
    return adapter, info


def test_auto_measures_on_the_first_steps_and_caches_the_choice(bb, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setattr(compiled, "COMPILE_WORTH_S", 0.0)  # any run is long enough here
    compiled.forget_choices()
    off, _ = _run(bb, "coop", "off")
    auto, info = _run(bb, "coop", "auto")
    rec = info["compile"]
    assert {"step_eager", "step_compiled", "optimizer_default", "optimizer_fused"} <= set(rec["timings_s"])
    assert any("(measured" in r for r in rec["why"])
    torch.testing.assert_close(auto.ctx, off.ctx, rtol=0, atol=1e-5)
    again, info2 = _run(bb, "coop", "auto")  # the same device, shapes and precision: no new measurement
    assert "measured before on cpu" in info2.get("compile", {"why": ["measured before on cpu"]})["why"]
    assert "step_eager" not in info2.get("compile", {}).get("timings_s", {})
    torch.testing.assert_close(again.ctx, off.ctx, rtol=0, atol=1e-5)
    compiled.forget_choices()


def test_auto_leaves_short_runs_alone(bb):
    compiled.forget_choices()
    off, off_info = _run(bb, "coop", "off")
    auto, info = _run(bb, "coop", "auto")
    assert "compile" not in info and "compile" not in off_info
    assert torch.equal(auto.ctx, off.ctx)  # bit for bit: nothing was compiled, fused or switched


def test_on_compiles_and_fuses(bb, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    off, _ = _run(bb, "coop", "off")
    on, info = _run(bb, "coop", "on")
    assert info["compile"]["compiled_text_step"] and info["compile"]["fused_optimizer"]
    torch.testing.assert_close(on.ctx, off.ctx, rtol=0, atol=1e-5)


def test_methods_without_a_text_step_are_not_compiled(bb):
    adapter = build_adapter(adapter_info("clip_adapter").config_cls(), bb, CLASSNAMES, ["a {}."])
    params = adapter.trainable_parameters()
    tuner = StepTuner(adapter, params, "on", lambda ps, fused=False: make_optimizer(ps, TrainConfig(), fused), 10,
                      "None")
    assert not tuner.plan.compiled and tuner.plan.fused
    assert isinstance(tuner.optimizer, torch.optim.SGD) and tuner.optimizer.defaults["fused"]


def test_compile_setting_is_checked():
    assert COMPILE_MODES == ("auto", "on", "off")
    with pytest.raises(ValueError, match="train.compile must be one of auto, on, off"):
        TrainConfig(compile="yes")

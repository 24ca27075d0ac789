"""The cache-based methods against their authors' code, on the same cached features.

Fixtures: tests/fixtures/cache_ref/ (numbers only; README there says how each was made). Each was produced by
running the authors' own functions on small synthetic CLIP-like features (5 classes, 4 shots, D = 64, logit
scale 100). Here a ``FeatureBackbone`` stands in for the backbone: the clip geometry at scale 100 and a text
tower that is a table of the fixture's class text features, so the adapters' own code (prototypes, cache,
logits, losses, optimiser settings) runs on exactly the authors' inputs. Float64 fixtures are compared with
the adapters in float64 and in float32, fewclip's working precision (logits to 1e-4). In float64 the
differences are those of the fixture's float32 inputs: its unit vectors have norms 1 +- 3e-8, which the authors
use as they are and fewclip normalises again (so, e.g., logits at scale 100 differ by up to ~3e-6).
"""
import math

import numpy as np
import pytest
import torch

from fewclip.adapters._cache import authors_grid, search_alpha_beta
from fewclip.adapters.clap import Clap, ClapConfig
from fewclip.adapters.clip_adapter import ClipAdapter, ClipAdapterConfig
from fewclip.adapters.lpp import LPP, LPPConfig
from fewclip.adapters.taskres import TaskRes, TaskResConfig
from fewclip.adapters.tip_adapter import TipAdapter
from fewclip.adapters.tip_adapter_f import TipAdapterF, TipAdapterFConfig
from fewclip.features.encode import Features
from fewclip.training.engine import CachedFeatures, FitData, TrainConfig, cosine_lr, make_optimizer, train_loop
from helpers.cache_parity import FeatureBackbone, authors_config, f64, fixture  # noqa: F401

# Tolerances, in float64 and float32 alike (the fixture's inputs are float32: see the module docstring).
LOGITS, PARAM, LOSS = 1e-4, 1e-6, 1e-5






def build(cls, cfg, text, dtype=torch.float32):
    """The adapter on the fixture's inputs in ``dtype`` (its text features upcast from the stored float32)."""
    bb = FeatureBackbone(text)
    return cls(cfg, bb, bb.names, ["{}"]).to(dtype), bb


def maxdiff(a, b):
    """The largest absolute difference (``pytest -s`` prints each, with the line that asks)."""
    import inspect

    d = float((a.detach().double() - b.detach().double()).abs().max())
    caller = inspect.stack()[1]
    print(f"\nparity {caller.function}:{caller.lineno} max|diff| = {d:.2e}", end="")
    return d




def fit_data(train, views, val, cfg=None):
    return FitData(train, views, val, cfg or TrainConfig(), 4, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- Tip-Adapter


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_tip_adapter_cache_logits_and_search_equal_the_authors(dtype):
    t, m = fixture("tip_adapter")
    cfg = m["config"]
    tip, _ = build(TipAdapter, authors_config("tip_adapter"), t["clip_weights"].T, dtype)
    views = [Features(t["train_views_raw"][v].to(dtype), t["train_labels"]) for v in range(10)]
    val = Features(t["val_feats"].to(dtype), t["val_labels"])
    test = t["test_feats"].to(dtype)
    tol = LOGITS

    with torch.no_grad():
        assert maxdiff(tip(val.x), t["val_zs_logits"]) < tol  # before fit: zero-shot
        tip.build_cache([v.x for v in views], views[0].y)
        assert maxdiff(tip.cache_keys.T, t["cache_keys"]) < PARAM
        assert torch.equal(tip.cache_values, t["cache_values"].to(tip.cache_values.dtype))
        tip.beta.fill_(cfg["init_beta"]), tip.alpha.fill_(cfg["init_alpha"])
        assert maxdiff(tip(val.x), t["val_tip_logits_init"]) < tol
        tip.alpha.fill_(0.0)
        assert maxdiff(tip(val.x), t["val_tip_logits_alpha0"]) < tol

    # the grid and the search, through fit (views 0-9 build the cache, the search runs on validation)
    info = tip.fit(fit_data(views[0], views, val))
    assert (info["beta"], info["alpha"]) == (m["tip"]["best_beta"], m["tip"]["best_alpha"])
    assert info["val_acc"] == pytest.approx(m["tip"]["best_val_acc"], abs=1e-5)
    g = tip.backbone.geometry
    with torch.no_grad():
        img = g.embed_image(val.x)
        _, _, acc = search_alpha_beta(g.logits(img, tip.prototypes), 1 - g.similarity(img, tip.cache_keys),
                                      tip.cache_values, val.y, authors_grid(7, 200), authors_grid(3, 20), "first")
        assert maxdiff(acc, t["search_val_acc_grid"]) < 1e-4
        assert maxdiff(tip(test), t["test_tip_logits_best"]) < tol


def test_tip_adapter_grid_is_the_authors():
    _, m = fixture("tip_adapter")
    betas, alphas = authors_grid(7, 200), authors_grid(3, 20)
    assert [betas[0], betas[-1]] == m["tip"]["beta_list_first_last"]
    assert [alphas[0], alphas[-1]] == m["tip"]["alpha_list_first_last"]


def test_tip_adapter_f_one_step_through_the_engine_loop_equals_the_authors():
    """One AdamW step (lr 1e-3, eps 1e-4, weight decay 0.01, batch 256 >= 20 images: the whole support set)
    with the adapter's own train defaults, run by the engine's loop; then the search on validation."""
    t, m = fixture("tip_adapter")
    tip, _ = build(TipAdapterF, authors_config("tip_adapter_f"), t["clip_weights"].T, f64)
    tip.build_cache([t["train_views_raw"][v].to(f64) for v in range(10)], t["train_labels"])
    batch = Features(t["F1_train_feats_raw"].to(f64), t["F1_train_labels"])
    val = Features(t["val_feats"].to(f64), t["val_labels"])

    grad_check, _ = build(TipAdapterF, TipAdapterFConfig(), t["clip_weights"].T, f64)
    grad_check.build_cache([t["train_views_raw"][v].to(f64) for v in range(10)], t["train_labels"])
    loss = grad_check.training_loss(batch.x, batch.y)["loss"]
    loss.backward()
    assert abs(float(loss.detach()) - m["tip_f_one_step"]["loss"]) < PARAM
    assert maxdiff(grad_check.cache_keys.grad, t["F1_grad"]) < PARAM

    cfg = TrainConfig(**{**TipAdapterF.train_defaults, "epochs": 1, "select": "last"})
    info = train_loop(tip, CachedFeatures([batch], Features(val.x[:0], val.y[:0])), cfg, 4, torch.Generator())
    assert info["steps"] == 1 and info["final_loss"] == pytest.approx(m["tip_f_one_step"]["loss"], abs=LOSS)
    assert maxdiff(tip.cache_keys, t["F1_weight_after"]) < PARAM
    found = tip.search(val)
    assert (found["beta"], found["alpha"]) == (m["tip_f_one_step"]["best_beta"], m["tip_f_one_step"]["best_alpha"])


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_tip_adapter_f_four_steps_with_the_engines_schedule_equal_the_authors(dtype):
    """Two epochs of two batches of 10 in the authors' order, stepped with the adapter's optimiser and the
    engine's cosine schedule (no warm-up: CosineAnnealingLR over every step)."""
    t, m = fixture("tip_adapter")
    tip, _ = build(TipAdapterF, authors_config("tip_adapter_f"), t["clip_weights"].T, dtype)
    tip.build_cache([t["train_views_raw"][v].to(dtype) for v in range(10)], t["train_labels"])
    cfg = TrainConfig(**TipAdapterF.train_defaults)
    opt = make_optimizer(tip.trainable_parameters(), cfg)
    fa, la = t["F1_train_feats_raw"].to(dtype), t["F1_train_labels"]
    fb, lb = t["F4_train_feats_raw_epoch1"].to(dtype), t["F4_train_labels_epoch1"]
    batches = [(fa[:10], la[:10]), (fa[10:], la[10:]), (fb[:10], lb[:10]), (fb[10:], lb[10:])]
    tol = PARAM
    for k, (x, y) in enumerate(batches):
        lr = cosine_lr(k, 4, 0, cfg.lr, cfg.warmup_lr)
        assert lr == pytest.approx(m["tip_f_four_steps"]["lrs"][k], rel=1e-12)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = tip.training_loss(x, y)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(float(loss.detach()) - m["tip_f_four_steps"]["losses"][k]) < LOSS
        assert maxdiff(tip.cache_keys, t["F4_weights_after"][k]) < tol
    # The authors keep the epoch with the best *test* accuracy (epoch 0 here) and search on validation with
    # it; fewclip selects on validation. Given the same keys, the search agrees.
    with torch.no_grad():
        tip.cache_keys.copy_(t["F4_search_weight"])
    found = tip.search(Features(t["val_feats"].to(dtype), t["val_labels"]))
    assert (found["beta"], found["alpha"]) == (m["tip_f_four_steps"]["best_beta"], m["tip_f_four_steps"]["best_alpha"])


# ---------------------------------------------------------------- CLIP-Adapter


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_clip_adapter_forward_and_three_sgd_steps_equal_the_authors(dtype):
    t, m = fixture("clip_adapter")
    ad, _ = build(ClipAdapter, ClipAdapterConfig(ratio=m["ratio"], reduction=m["reduction"]), t["text_raw"], dtype)
    with torch.no_grad():
        ad.fc1.copy_(t["w1_init"]), ad.fc2.copy_(t["w2_init"])
    test = t["test_feats"].to(dtype)
    tol = LOGITS
    with torch.no_grad():
        assert maxdiff(ad(test), t["test_logits_init"]) < tol
        ad.cfg.ratio = 0.0  # the authors' ratio 0 is zero-shot (their forward hard-codes 0.2)
        assert maxdiff(ad(test), t["test_zs_logits"]) < tol
        ad.cfg.ratio = m["ratio"]
    opt = make_optimizer(ad.trainable_parameters(), TrainConfig())  # CoOp's: SGD 0.002, momentum 0.9, wd 5e-4
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.002
    for s in range(3):
        x = t["train_views_raw_0to2"][s].to(dtype)  # raw features: the adapter normalises, the authors do not
        loss = ad.training_loss(x, t["train_labels"])["loss"]
        opt.zero_grad()
        loss.backward()
        assert abs(float(loss.detach()) - m["losses"][s]) < LOSS
        assert maxdiff(ad.fc1.grad, t["grad_w1"][s]) < PARAM
        assert maxdiff(ad.fc2.grad, t["grad_w2"][s]) < PARAM
        opt.step()
        assert maxdiff(ad.fc1, t["w1_after"][s]) < PARAM
        assert maxdiff(ad.fc2, t["w2_after"][s]) < PARAM
    with torch.no_grad():
        assert maxdiff(ad(test), t["test_logits_after3"]) < tol


# ---------------------------------------------------------------- TaskRes


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_taskres_starts_at_zero_shot_and_three_adam_steps_equal_the_authors(dtype):
    t, m = fixture("taskres")
    ad, _ = build(TaskRes, TaskResConfig(scale=m["residual_scale"]), t["text_raw"], dtype)
    # the base is the authors' raw text feature (one template)
    assert maxdiff(ad.base, t["text_raw"]) < LOSS
    test = t["test_feats"].to(dtype)
    tol = LOGITS
    with torch.no_grad():
        assert maxdiff(ad(test), t["test_zs_logits"]) < tol
    opt = make_optimizer(ad.trainable_parameters(), TrainConfig(**TaskRes.train_defaults))
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 5e-4 and opt.defaults["eps"] == 1e-8
    for s in range(3):
        loss = ad.training_loss(t["train_views_raw_0to2"][s].to(dtype), t["train_labels"])["loss"]
        opt.zero_grad()
        loss.backward()
        assert abs(float(loss.detach()) - m["raw_losses"][s]) < LOSS
        assert maxdiff(ad.residual.grad, t["raw_grad"][s]) < PARAM
        opt.step()
        assert maxdiff(ad.residual, t["raw_residual_after"][s]) < PARAM
    with torch.no_grad():
        assert maxdiff(ad(test), t["raw_test_logits_after3"]) < tol


# ---------------------------------------------------------------- LP++


@pytest.mark.parametrize("run", ["e1", "e10", "e300"])
def test_lpp_init_step_sizes_and_epochs_equal_the_authors(run):
    t, m = fixture("lpp")
    ad, _ = build(LPP, authors_config("lpp", epochs=0), t["clip_weights"].T, f64)  # alpha_grad, bias_init theirs
    train = Features(t["train_feats_raw"].to(f64), t["train_labels"])
    val = Features(t["val_feats"].to(f64), t["val_labels"])
    info = ad.fit(fit_data(train, [train], val))  # 0 epochs: the initialisation and the step sizes
    bound = t["train_feats_raw"].shape[1] ** -0.5  # nn.Linear's default bias, drawn as theirs (their draw: below)
    assert float(ad.bias.detach().abs().max()) <= bound and float(t["bias_init"].abs().max()) <= bound
    assert float(ad.bias.detach().abs().min()) > 0
    assert maxdiff(ad.weight, t["W_init"]) < PARAM
    assert maxdiff(ad.alpha, t["alpha_vec_init"][0]) < PARAM and info["alpha_init"] == pytest.approx(m["alpha_init"],
                                                                                                    rel=1e-8)
    assert info["lr_w"] == pytest.approx(m["lr_w"], rel=1e-9)
    assert info["lr_alpha"] == pytest.approx(m["lr_alpha"], rel=1e-7)

    r = m["runs"][run]
    ad.cfg.epochs = r["epochs"]
    f, s = ad._parts(train.x)
    vf, vs = ad._parts(val.x)
    # the code's random nn.Linear bias (fewclip starts it at 0), given explicitly
    info = ad.train_blocks(f, s, train.y, vf, vs, val.y, t["W_init"], t["bias_init"], t["alpha_vec_init"][0])
    assert info["best_epoch"] - 1 == r["best_val_epoch"] and info["val_acc"] == r["best_val_acc"]
    assert info["final_loss"] == pytest.approx(r["last_train_loss"], rel=1e-6)
    assert maxdiff(ad.weight, t[f"{run}_W"]) < PARAM * max(1, float(t[f"{run}_W"].abs().max()))
    assert maxdiff(ad.bias, t[f"{run}_b"]) < PARAM * max(1, float(t[f"{run}_b"].abs().max()))
    assert maxdiff(ad.alpha, t[f"{run}_alpha"][0]) < PARAM * max(1, float(t[f"{run}_alpha"].abs().max()))
    with torch.no_grad():
        test_acc = 100.0 * float((ad(t["test_feats"].to(f64)).argmax(-1) == t["test_labels"]).double().mean())
    assert test_acc == r["test_acc_at_best_val_epoch"]


def test_lpp_alpha_gradient_modes_differ_only_after_the_first_alpha_step():
    t, _ = fixture("lpp")
    out = {}
    for mode in ("last", "accumulated"):
        ad, _ = build(LPP, LPPConfig(alpha_grad=mode, epochs=20), t["clip_weights"].T, f64)
        f, s = ad._parts(t["train_feats_raw"].to(f64))
        ad.cfg.epochs = 9
        ad.train_blocks(f, s, t["train_labels"], f[:0], s[:0], t["train_labels"][:0], t["W_init"], t["bias_init"],
                        t["alpha_vec_init"][0])
        nine = ad.alpha.detach().clone()
        ad.cfg.epochs = 10
        ad.train_blocks(f, s, t["train_labels"], f[:0], s[:0], t["train_labels"][:0], t["W_init"], t["bias_init"],
                        t["alpha_vec_init"][0])
        out[mode] = (nine, ad.alpha.detach().clone())
    assert torch.equal(out["last"][0], out["accumulated"][0])  # no alpha step before epoch 10
    assert not torch.allclose(out["last"][1], out["accumulated"][1])  # one epoch's gradient vs ten epochs' sum


# ---------------------------------------------------------------- CLAP


def dassl_lr(e, base=0.1, epochs=300):
    """Dassl's schedule as the authors run it: epoch 0 at 1e-5, then cosine restarting after the warm-up."""
    return 1e-5 if e == 0 else base * (1 + math.cos(math.pi * (e - 1) / epochs)) / 2


@pytest.mark.parametrize("constraint", ["l2", "none"])
def test_clap_multipliers_and_first_epochs_equal_the_authors(constraint):
    t, m = fixture("clap")
    ad, _ = build(Clap, authors_config("clap", "authors" if constraint == "l2" else "zslp"), t["text_raw"])
    V, N, D = t["train_views_raw"].shape
    X, Y = t["train_views_raw"].reshape(V * N, D), t["train_labels"].repeat(V)  # rep-major, as the authors
    with torch.no_grad():
        assert maxdiff(ad(t["test_feats"]), t["test_logits_init"]) < 1e-4  # starts at zero-shot
        assert maxdiff(ad(X), t["logits_zs_train"]) < 1e-4
    ad.set_multipliers(X, Y)
    assert maxdiff(ad.multipliers, t["multipliers"]) < 1e-6
    cfg = TrainConfig(**Clap.train_defaults)
    opt = make_optimizer(ad.trainable_parameters(), cfg)
    key = "clap" if constraint == "l2" else "zslp"
    for e in range(3):
        # fewclip's schedule (warm-up epoch at 1e-5, then cosine) at one step per epoch
        lr = cosine_lr(e, 300, 1, cfg.lr, cfg.warmup_lr)
        assert lr == pytest.approx(m["clap_lrs"][e], rel=1e-6)
        for group in opt.param_groups:
            group["lr"] = lr
        idx = t["batch_idx"][e]
        loss = ad.training_loss(X[idx], Y[idx])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(float(loss.detach()) - m[f"{key}_losses"][e]) < 1e-5
        assert maxdiff(ad.weight, t[f"{key}_prototypes_after"][e]) < 1e-5


def test_clap_300_epochs_equal_the_authors():
    """The authors' 300 epochs (their batches: the first 256 of a fresh numpy permutation of the 400 augmented
    features each epoch; their Dassl schedule), with the adapter's loss and optimiser."""
    t, m = fixture("clap")
    ad, _ = build(Clap, ClapConfig(), t["text_raw"])
    V, N, D = t["train_views_raw"].shape
    X, Y = t["train_views_raw"].reshape(V * N, D), t["train_labels"].repeat(V)
    ad.set_multipliers(X, Y)
    opt = make_optimizer(ad.trainable_parameters(), TrainConfig(**Clap.train_defaults))
    rs = np.random.RandomState(m["np_seed"])
    for e in range(300):
        idx = torch.from_numpy(rs.rand(V * N).argsort()[:256].copy())
        if e < 3:
            assert torch.equal(idx, t["batch_idx"][e])
        for group in opt.param_groups:
            group["lr"] = dassl_lr(e)
        loss = ad.training_loss(X[idx], Y[idx])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(float(loss.detach()) - m["clap_loss_epoch300"]) < 1e-4
    assert maxdiff(ad.weight, t["clap_prototypes_after300"]) < 1e-4
    with torch.no_grad():
        assert maxdiff(ad(t["test_feats"]), t["clap_test_logits_after300"]) < 1e-3

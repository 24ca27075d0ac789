"""fewclip.fit_features takes every adapter option by its own name: no argument of its own shadows a field of a
registered method's config (``views`` was both the augmented-views tensor and GDA's / ProKeR's view count)."""
import dataclasses
import inspect

import pytest
import torch

import fewclip
import fewclip.adapters  # noqa: F401  (registers the methods)
from fewclip.adapter.base import ADAPTERS, adapter_info
from fewclip.training.on_features import fit_features


def test_no_argument_of_fit_features_shadows_an_adapter_option():
    own = {n for n, p in inspect.signature(fit_features).parameters.items() if p.kind is not p.VAR_KEYWORD}
    clashes = {name: sorted(own & {f.name for f in dataclasses.fields(adapter_info(name).config_cls)})
               for name in ADAPTERS}
    assert len(clashes) > 20 and not any(clashes.values()), clashes


def _task(V=3, C=4, n=4, D=12):
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(C, D, generator=g)
    y = torch.arange(C).repeat_interleave(n)
    x = centres[y] + 0.5 * torch.randn(len(y), D, generator=g)
    views = x[None] + 0.3 * torch.randn(V, len(y), D, generator=g)  # V, N, D
    vy = torch.arange(C).repeat_interleave(2)
    vx = centres[vy] + 0.5 * torch.randn(len(vy), D, generator=g)
    text = centres + 0.8 * torch.randn(C, D, generator=g)
    return x, y, views, (vx, vy), text, ["a", "b", "c", "d"]


@pytest.mark.parametrize("method", ["gda", "proker"])
def test_views_option_and_view_tensors_both_reach_the_method(method):
    """views=3 with three view tensors uses exactly those three: the same classifier as the method on the three
    views stacked as plain training rows (views=0); the default (10 views) cycles them and gives another."""
    x, y, views, val, text, names = _task()
    test_x = torch.cat([val[0], x])
    three = fit_features(method, x, y, names, text, "clip", val=val, view_features=views, views=3)
    assert three.adapter.cfg.views == 3
    stacked = fit_features(method, views.reshape(-1, x.shape[1]), y.repeat(3), names, text, "clip", val=val,
                           views=0)
    assert torch.allclose(three.logits(test_x), stacked.logits(test_x), atol=1e-5)
    ten = fit_features(method, x, y, names, text, "clip", val=val, view_features=views)
    assert ten.adapter.cfg.views == 10
    assert not torch.allclose(ten.logits(test_x), three.logits(test_x), atol=1e-5)
    # the earlier spelling: a tensor as views= is the view tensors
    old = fewclip.fit_features(method, x, y, names, text, "clip", val=val, views=views)
    assert torch.equal(old.logits(test_x), ten.logits(test_x))


def test_fit_features_names_a_wrong_option_and_views_given_twice():
    x, y, views, val, text, names = _task()
    with pytest.raises(ValueError, match="method 'gda' has no option 'view'; its options are .*views"):
        fit_features("gda", x, y, names, text, "clip", view=3)
    with pytest.raises(ValueError, match="augmented views are given twice"):
        fit_features("gda", x, y, names, text, "clip", view_features=views, views=views)

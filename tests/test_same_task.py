"""The same class names are not the same task (issue 32 item 8).

A method whose authors score their training data and other test sets by different heads is scored by the head
of the test set's kind, not by whether its class names happen to be the trained ones: MMRL fuses its two logits
only on the data it was trained on (yunncheng/MMRL@27d8821 trainers/mmrl.py:421-426, ``TASK CD``: fused on
ImageNet, class-token logits on ImageNet-V2 and -Sketch, which keep ImageNet's names); DePT's head serves a
domain-shift target with every trained class (their ``'ImageNet' in DATASET.NAME``), not a cross-dataset target
with the same names; 2SFS keeps a domain-shift target's classifier rows by label, not by name."""
import json

import pytest
import torch

from fewclip.adapters import build_adapter
from fewclip.adapters.dept import DePTConfig
from fewclip.adapters.mmrl import MMRLConfig
from fewclip.adapters.twosfs import TwoSFSConfig
from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.cli.main import main
from fewclip.data.protocols import plan_base2new, plan_cross_dataset, plan_domain_shift
from fewclip.datasets import DataConfig, build_dataset
from fewclip.training.evals import scorer_for

TEMPLATE = ["a photo of a {}."]


@pytest.fixture(scope="module")
def bb():
    return load_backbone(BackboneConfig(name="toy-clip", device="cpu"))


def ds(name):
    return build_dataset(DataConfig(name=name))


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# Each plan: (the plan, the target's kind); a cross-dataset target with the source's very class names is the
# case "same names, other task" in its purest form.
KINDS = {
    "same classes (domain shift)": lambda: plan_domain_shift(ds("toy-shapes"), [ds("toy-shapes-faded")]),
    "a class subset (domain shift)": lambda: plan_domain_shift(ds("toy-shapes"), [ds("toy-shapes-outline")]),
    "new classes (base to novel)": lambda: plan_base2new(ds("toy-shapes")),
    "same names, cross-dataset": lambda: plan_cross_dataset(ds("toy-shapes"), [ds("toy-shapes-faded")]),
}


def scorers(adapter, plan):
    """(eval set, trained on it?, scorer) for every test set of the plan, as score_plan picks them."""
    for e in plan.evals:
        trained = e.dataset is plan.train
        yield e, trained, scorer_for(adapter, e, e.dataset.prompts("single"), trained_on=trained)[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_mmrl_fuses_only_on_its_training_data(bb, kind):
    plan = KINDS[kind]()
    a = build_adapter(MMRLConfig(rep_depth=2, n_rep_tokens=3, rep_dim=16), bb, plan.train.classnames, TEMPLATE,
                      generator=torch.Generator().manual_seed(0)).eval()
    px = torch.randn(5, 3, bb.image_size, bb.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        f = a.encode_images(px)
        token, rep, _ = a._logits(f)
        fused = 0.7 * token + 0.3 * rep
        assert not torch.allclose(fused, token, atol=1e-3)  # the two heads give other logits
        for e, trained, s in scorers(a, plan):
            if trained:
                assert s is a
                close(s(f), fused)
                continue
            assert not s.fused, e.name
            close(s(f), s._logits(f)[0])
            if e.dataset.classnames == plan.train.classnames and e.dataset.prompts("single") == TEMPLATE:
                close(s(f), token)  # ImageNet-V2's case: the trained names, the class token's logits
            if e.class_map is not None and e.dataset.prompts("single") == TEMPLATE:
                close(s(f), token[:, e.class_map])  # ImageNet-A/R's case: among the target's own classes


@pytest.mark.parametrize("kind", list(KINDS))
def test_dept_head_serves_the_trained_classes_of_a_domain_shift_only(bb, kind):
    plan = KINDS[kind]()
    cfg = DePTConfig(learner="coop", n_ctx=4, ctx_init="a photo of a")
    a = build_adapter(cfg, bb, plan.train.classnames, TEMPLATE).eval()
    for e, trained, s in scorers(a, plan):
        every_class = e.class_map is not None and list(e.class_map) == list(range(len(a.classnames)))
        if trained or every_class:
            assert s is a and s.has_head, e.name
        else:
            assert not s.has_head, e.name


def test_twosfs_keeps_a_targets_rows_by_label_not_by_name(bb):
    names = ["circle", "square", "circle", "star"]  # a class name that two classes share, as ImageNet's 'missile'
    a = build_adapter(TwoSFSConfig(), bb, names, TEMPLATE).eval()
    with torch.no_grad():
        a.classifier.copy_(torch.randn(a.classifier.shape, generator=torch.Generator().manual_seed(0)))
    a.stage.fill_(2)
    a._stage = 2
    same = a.for_classnames(names, TEMPLATE)
    assert same is a
    subset = a.for_target(["circle", "star"], TEMPLATE, class_map=[2, 3])  # the second 'circle', by label
    close(subset.classifier, a.classifier[[2, 3]])
    by_name = a.for_classnames(["star", "circle", "circle"], TEMPLATE)  # no labels: the 'circle' rows in turn
    close(by_name.classifier, a.classifier[[3, 0, 2]])


def test_a_domain_shift_run_scores_same_named_targets_by_the_targets_head(tmp_path):
    """Through `fewclip train`: MMRL's source is scored by the adapter itself, the faded target (toy-shapes'
    names) and the outline subset by the class-token scorer (``for_classnames`` in scored_by)."""
    out = tmp_path / "run"
    assert main(["train", "adapter=mmrl", "adapter.rep_dim=16", "adapter.rep_depth=1", "protocol=domain_shift",
                 "data=toy-shapes", "targets=[toy-shapes-faded,toy-shapes-outline]", "data.templates=single",
                 "shots=1", "seed=1", "train.epochs=1", "data.max_test=8", "backbone.device=cpu",
                 f"out={out}"]) == 0
    evals = json.loads((out / "metrics.json").read_text())["evals"]
    assert evals["source"]["scored_by"] == "adapter"
    assert evals["toy-shapes-faded"]["scored_by"] == evals["toy-shapes-outline"]["scored_by"] == "for_classnames"

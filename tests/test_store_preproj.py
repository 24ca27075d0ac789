"""One encoding of each image for every method: where the image tower ends in a linear projection, the feature
store keeps the features before it and the projected ones are derived (``Backbone.stored_variant``,
``Backbone.project_features``). The derived features are the tower's own, in every reference backbone's geometry;
a run of Tip-Adapter then ProLIP encodes each image and view once; entries of the older layout are never read.
"""
import pytest
import torch

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.data.image_fingerprint import fingerprint
from fewclip.features import store as store_mod
from fewclip.features.encode import FeatureCache, extract_features
from fewclip.features.store import FeatureStore, address
from fewclip.runs.run import load_train_config, run_train

REFERENCE = ("toy-clip", "toy-euclip", "toy-meru", "toy-siglip")


def load(name):
    return load_backbone(BackboneConfig(name=name, device="cpu"))


def count_images(bb):
    """Count the images through each of the backbone's image towers (instance attributes; the class is untouched)."""
    seen = {"plain": 0, "preproj": 0}
    plain, pre = bb.encode_images, bb.encode_images_preproj

    def encode_plain(px):
        seen["plain"] += px.shape[0]
        return plain(px)

    def encode_pre(px):
        seen["preproj"] += px.shape[0]
        return pre(px)

    bb.encode_images, bb.encode_images_preproj = encode_plain, encode_pre
    return seen


@pytest.mark.parametrize("name", REFERENCE)
def test_derived_features_are_the_towers_own_in_every_reference_geometry(name, shapes):
    bb = load(name)
    items = shapes.items("test")[:11]
    direct = extract_features(bb, shapes, items, batch_size=4).x  # the tower with its projection, 3 batches
    z = extract_features(bb.tower_variant("preproj"), shapes, items, batch_size=4).x
    assert z.shape[1] == bb.image_projection().shape[0]  # the tower's width
    derived = bb.project_features(z, batch_size=4)
    torch.testing.assert_close(derived, direct, rtol=1e-6, atol=1e-6)
    print(f"\n{name}: bit-for-bit {torch.equal(derived, direct)}, max |diff| {float((derived - direct).abs().max()):.1e}")
    got = FeatureCache().features(bb, shapes, items, batch_size=4).features.x  # what every method is given
    assert torch.equal(got, derived)
    g = bb.geometry  # and so the same points in the backbone's geometry (MERU's lift, SigLIP's, EuCLIP's)
    torch.testing.assert_close(g.embed_image(got), g.embed_image(direct), rtol=1e-6, atol=1e-6)


def test_plain_and_preprojection_requests_share_one_entry(shapes, tmp_path):
    bb = load("toy-clip")
    seen = count_images(bb)
    items = shapes.items("test")[:6]
    store = FeatureStore(tmp_path / "store")
    cache = FeatureCache(store)
    plain = cache.features(bb, shapes, items)
    pre = cache.features(bb.tower_variant("preproj"), shapes, items)
    assert (plain.encoded, pre.encoded) == (6, 0) and seen == {"plain": 0, "preproj": 6}
    assert [g.address["variant"] for g in store.groups()] == ["|preproj"]  # one group: the features before
    for lookup in (FeatureCache(store).features(bb, shapes, items),  # another process: both read, none encoded
                   FeatureCache(store).features(bb.tower_variant("preproj"), shapes, items)):
        assert (lookup.encoded, lookup.from_store) == (0, 6)
    assert seen["preproj"] == 6
    again = FeatureCache(store).features(bb, shapes, items)
    assert torch.equal(again.features.x, plain.features.x) and torch.equal(again.features.y, plain.features.y)


@pytest.mark.parametrize("old", ["|preproj", ""])
def test_entries_of_the_older_layout_are_encoded_again_never_read(old, shapes, tmp_path, monkeypatch):
    bb = load("toy-clip")
    items = shapes.items("test")[:5]
    ids = [it.id for it in items]
    store = FeatureStore(tmp_path / "store")
    tower = bb.tower_variant("preproj") if old else bb
    with monkeypatch.context() as m:  # what fewclip of store format 2 wrote: features of the same ids, here wrong
        m.setattr(store_mod, "VERSION", 2)
        group = store.group(address(tower, shapes, None, 256))
        width = bb.image_projection().shape[0 if old else 1]
        group.write(ids, torch.zeros(5, width), fingerprint(shapes, items))
        assert group.dir.parent.name == "v2" and group.read(ids) is not None
    got = FeatureCache(store).features(bb, shapes, items)
    assert (got.encoded, got.from_store) == (5, 0)
    torch.testing.assert_close(got.features.x, extract_features(bb, shapes, items).x, rtol=1e-6, atol=1e-6)
    assert [p.name for p in store.old_formats()] == ["v2"]
    store.clear()
    assert store.old_formats() == []


def test_tip_adapter_then_prolip_encode_each_image_once(shapes, tmp_path):
    bb = load("toy-clip")
    seen = count_images(bb)
    cache = FeatureCache(FeatureStore(tmp_path / "store"))
    common = ["shots=2", "seed=1", "data.templates=single", "log_level=warning"]
    tip = run_train(load_train_config(["adapter=tip_adapter", "adapter.views=3", *common]), tmp_path / "tip",
                    backbone=bb, dataset=shapes, cache=cache)
    after_tip = dict(seen)
    assert after_tip["plain"] == 0 and after_tip["preproj"] == tip["images_encoded"] > 0
    prolip = run_train(load_train_config(["adapter=prolip", "adapter.views=3", "adapter.epochs=2", "adapter.search=false",
                                          *common]), tmp_path / "prolip", backbone=bb, dataset=shapes, cache=cache)
    assert seen == after_tip  # ProLIP's views, validation and test images: all encoded for Tip-Adapter already
    assert prolip["images_encoded"] == prolip["images_encoded_shared"] > 0
    assert prolip["lr"] == 1e-5 and prolip["top1"] > 50 and tip["top1"] > 50


def test_derived_features_keep_the_towers_precision_under_any_autocast(shapes):
    bf16 = load_backbone(BackboneConfig(name="toy-clip", device="cpu", precision="bf16"))
    items = shapes.items("test")[:6]
    direct = extract_features(bf16, shapes, items).x  # the bf16 tower with its projection
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an ambient autocast changes nothing
        derived = FeatureCache().features(bf16, shapes, items).features.x
    torch.testing.assert_close(derived, direct, rtol=1e-6, atol=1e-6)
    fp32 = load("toy-clip")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        derived = FeatureCache().features(fp32, shapes, items).features.x
    assert torch.equal(derived, extract_features(fp32, shapes, items).x)

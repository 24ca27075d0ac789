"""The toy world: pure functions of (seed, index), captions, vocabulary, and the toy tasks."""
import json
import re
from collections import Counter

import numpy as np
import pytest

from fewclip.backbones.backbone import REFERENCE_DIR
from fewclip.backbones.tokenizer import WordTokenizer
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets import toyworld as tw
from fewclip.datasets.toytasks import TASKS, ToyTask

SEED = 7


def _idx(*values):
    return np.asarray(values, dtype=np.int64)


# ---------------------------------------------------------------- determinism


def test_render_is_a_pure_function_of_seed_and_index():
    index = np.arange(10)
    a = tw.render_items(SEED, index)
    assert a.dtype == np.uint8 and a.shape == (10, tw.IMAGE_SIZE, tw.IMAGE_SIZE, 3)
    assert np.array_equal(a, tw.render_items(SEED, index))
    # another seed gives other images, and so does another index
    other_seed = tw.render_items(SEED + 1, index)
    assert all(not np.array_equal(a[i], other_seed[i]) for i in range(10))
    assert len({a[i].tobytes() for i in range(10)}) == 10


@pytest.mark.parametrize("fixed", [None, {"shape": 5, "style": 2}], ids=["free", "fixed"])
def test_an_image_does_not_depend_on_its_batch(fixed):
    batch = tw.render_items(SEED, np.arange(10), fixed)
    alone = tw.render_items(SEED, _idx(5), fixed)
    assert np.array_equal(alone[0], batch[5])
    # any batch order or company: far-apart indices, reversed
    mixed = tw.render_items(SEED, _idx(20_000_003, 5, 2), fixed)
    assert np.array_equal(mixed[1], batch[5]) and np.array_equal(mixed[2], batch[2])
    assert np.array_equal(mixed[0], tw.render_items(SEED, _idx(20_000_003), fixed)[0])


def test_scene_and_captions_do_not_depend_on_their_batch():
    batch = tw.sample_scene(SEED, np.arange(10))
    alone = tw.sample_scene(SEED, _idx(5))
    assert batch.attrs(5) == alone.attrs(0)
    assert tw.captions(batch, SEED)[5] == tw.captions(alone, SEED)[0]
    assert tw.captions(batch, SEED) == tw.captions(tw.sample_scene(SEED, np.arange(10)), SEED)


def test_uniform_is_in_unit_interval_and_streams_are_independent():
    index = np.arange(20_000)
    u1, u2 = tw.uniform(SEED, index, 1), tw.uniform(SEED, index, 2)
    assert u1.min() >= 0.0 and u1.max() < 1.0
    assert abs(u1.mean() - 0.5) < 0.01
    assert abs(np.corrcoef(u1, u2)[0, 1]) < 0.03
    assert np.array_equal(u1, tw.uniform(SEED, index, 1))


# ---------------------------------------------------------------- rendering follows the attributes


def test_attributes_render_as_named():
    # A large red circle in the centre on black: the centre pixel is red, a corner is dark.
    fixed = {"shape": tw.SHAPES.index("circle"), "colour": tw.COLOURS.index("red"), "size": 1,
             "position": tw.POSITIONS.index("center"), "pattern": 0, "background": 0, "style": 0}
    img = tw.render_items(SEED, np.arange(20), fixed).astype(int)
    r, g, b = img[:, 16, 16, 0], img[:, 16, 16, 1], img[:, 16, 16, 2]
    assert (r > 140).all() and (r > g + 60).all() and (r > b + 60).all()
    assert (img[:, 0, 0].sum(-1) < 150).all()
    # A ring has a hole: its centre shows the background.
    ring = tw.render_items(SEED, np.arange(20), {**fixed, "shape": tw.SHAPES.index("ring")}).astype(int)
    assert (ring[:, 16, 16].sum(-1) < 150).all()
    # Sketches are dark strokes on pale paper.
    sketch = tw.render_items(SEED, np.arange(20), {**fixed, "style": tw.STYLES.index("sketch")}).astype(int)
    assert (sketch[:, 0, 0].mean(-1) > 150).all()


# ---------------------------------------------------------------- captions


def _words(caption):
    return set(caption.split())


def test_captions_name_the_true_attribute_often_but_not_always():
    n = 400
    cases = {  # attribute, value, words that name it, how often captions mention it
        "colour": ("red", {"red"}, tw.MENTION_P["colour"]),
        "shape": ("star", {"star"}, tw.MENTION_P["shape"]),
        "pattern": ("striped", {"striped", "stripy", "stripes"}, tw.MENTION_P["pattern"]),
        "position": ("left", {"left"}, tw.MENTION_P["position"]),
    }
    for attr, (value, words, p) in cases.items():
        scene = tw.sample_scene(SEED, np.arange(n), {attr: tw.ATTRIBUTES[attr].index(value), "style": 0})
        caps = tw.captions(scene, SEED)
        said = np.mean([bool(_words(c) & words) for c in caps])
        assert 0 < said < 1, attr
        assert abs(said - p) < 0.1, (attr, said, p)


def test_captions_never_name_a_wrong_value():
    n = 300
    scene = tw.sample_scene(SEED, np.arange(n), {"colour": tw.COLOURS.index("blue"), "shape": tw.SHAPES.index("star"),
                                                 "position": tw.POSITIONS.index("left")})
    other_colours = set(tw.COLOURS) - {"blue"} | {"violet", "turquoise"}
    other_shapes = {word for shape, phrases in tw._SHAPE_WORDS.items() if shape != "star"
                    for phrase in phrases for word in phrase.split()}
    for c in tw.captions(scene, SEED):
        words = _words(c)
        assert not words & other_colours, c
        assert not words & other_shapes, c
        assert not words & {"right", "top", "bottom", "middle", "center", "upper", "lower"}, c


def test_captions_are_grammatical_enough():
    caps = tw.captions(tw.sample_scene(SEED, np.arange(500)), SEED)
    for c in caps:
        assert c == c.strip() and "  " not in c
        assert not re.search(r"\ba [aeiou]", c), c  # "an orange", never "a orange"
    # drawings are often, photos never, captioned as drawings
    scene = tw.sample_scene(SEED, np.arange(500))
    drawing_words = {"drawing", "outline", "sketch"}
    for i, c in enumerate(caps):
        if scene.attrs(i)["style"] == "photo":
            assert not _words(c) & drawing_words, c


# ---------------------------------------------------------------- vocabulary


@pytest.fixture(scope="module")
def vocab_tokenizer():
    return WordTokenizer(tw.vocabulary())


def test_vocabulary_covers_every_caption_word(vocab_tokenizer):
    index = np.arange(3000)
    for style_p in (tw.PRETRAIN_STYLE_P, (1 / 3, 1 / 3, 1 / 3)):
        caps = tw.captions(tw.sample_scene(SEED, index, style_p=style_p), SEED)
        unknown = Counter(w for c in caps for w in vocab_tokenizer.unknown_words(c))
        assert not unknown, unknown


@pytest.mark.parametrize("task", sorted(TASKS))
def test_vocabulary_covers_every_task_prompt(vocab_tokenizer, task):
    spec = TASKS[task]
    prompts = [t.format(c) for c in spec.classnames for t in spec.templates]
    assert prompts
    assert [w for p in prompts for w in vocab_tokenizer.unknown_words(p)] == []


def test_shipped_vocabulary_is_the_toy_world_vocabulary():
    # The reference models' token ids come from this file: if the toy world's
    # vocabulary changed, every shipped text tower would read shifted ids.
    shipped = json.loads((REFERENCE_DIR / "toy-vocab.json").read_text())
    assert shipped["vocab"] == tw.vocabulary()
    assert tw.vocabulary() == sorted(set(tw.vocabulary()))


# ---------------------------------------------------------------- toy tasks


@pytest.fixture(scope="module")
def toy_datasets():
    return {name: build_dataset(DataConfig(name=name)) for name in TASKS}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_toy_task_splits_are_balanced(toy_datasets, task):
    ds, spec = toy_datasets[task], TASKS[task]
    assert ds.classnames == list(spec.classnames)
    # each class shows one value of each labelled attribute (named by the class name, or spec.values),
    # and no two classes show the same values
    values = spec.class_values()
    assert len(values) == len({tuple(v.values()) for v in values}) == len(ds.classnames)
    for attr in spec.attributes:
        assert {v[attr] for v in values} <= set(tw.ATTRIBUTES[attr])
    assert ds.templates and all(t.count("{}") == 1 for t in ds.templates)
    C = len(ds.classnames)
    ids = set()
    for split, per_class in zip(("train", "val", "test"), spec.per_class):
        items = ds.items(split)
        assert len(items) == per_class * C
        assert Counter(it.label for it in items) == {c: per_class for c in range(C)}
        ids |= {it.id for it in items}
    assert len(ids) == sum(spec.per_class) * C  # ids are unique across splits


@pytest.mark.parametrize("task", sorted(TASKS))
def test_toy_task_images_are_deterministic(toy_datasets, task, toy_renders, monkeypatch):
    ds = toy_datasets[task]
    monkeypatch.setattr(ToyTask, "render_split", toy_renders)  # the real renderer (conftest's shares renders)
    fresh = build_dataset(DataConfig(name=task))  # no shared cache
    for item in (ds.items("train")[3], ds.items("test")[-1]):
        a, b = ds.load_image(item), fresh.load_image(item)
        assert a.size == (tw.IMAGE_SIZE, tw.IMAGE_SIZE) and a.mode == "RGB"
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # splits are different images, not the same renders relabelled
    train0, test0 = ds.items("train")[0], ds.items("test")[0]
    assert train0.label == test0.label
    assert not np.array_equal(np.asarray(ds.load_image(train0)), np.asarray(ds.load_image(test0)))


def test_toy_task_seeds_differ():
    assert len({spec.seed for spec in TASKS.values()}) == len(TASKS)


def test_toy_positions_put_the_object_where_the_label_says(toy_datasets):
    assert toy_datasets["toy-positions"].hflip_ok is False
    assert all(toy_datasets[t].hflip_ok for t in TASKS if t != "toy-positions")
    # The geometry of the scene, before the task's rendering shift (noise, contrast) is applied.
    import dataclasses

    ds = ToyTask(dataclasses.replace(TASKS["toy-positions"], noise=0.0, contrast=1.0))
    x = ds.render_split("test").astype(np.float32)
    labels = np.array([it.label for it in ds.items("test")])
    # Foreground: pixels far from the image's median colour (mostly background).
    med = np.median(x.reshape(len(x), -1, 3), axis=1)[:, None, None, :]
    fg = (np.abs(x - med).sum(-1) > 60).astype(np.float32)
    yy, xx = np.mgrid[0:tw.IMAGE_SIZE, 0:tw.IMAGE_SIZE]
    cx = (fg * xx).sum((1, 2)) / fg.sum((1, 2))
    cy = (fg * yy).sum((1, 2)) / fg.sum((1, 2))
    mean = {name: (cx[labels == c].mean(), cy[labels == c].mean()) for c, name in enumerate(ds.classnames)}
    assert mean["left"][0] < 11 and mean["right"][0] > 20
    assert mean["top"][1] < 11 and mean["bottom"][1] > 20
    assert all(13 < v < 19 for v in mean["center"])


def test_toy_objects_show_the_colour_and_shape_their_label_names(toy_datasets):
    ds = toy_datasets["toy-objects"]
    assert len(ds.classnames) == 64 and ds.classnames[:2] == ["red circle", "red square"]
    assert TASKS["toy-objects"].attributes == ("colour", "shape")
    # the scene drawn for each test image pins both attributes to the label's values
    scene = tw.sample_scene(ds.spec.seed, np.arange(64) + 20_000_000, ds._fixed(np.arange(64)))
    for c in range(64):
        attrs = scene.attrs(c)
        assert f"{attrs['colour']} {attrs['shape']}" == ds.classnames[c]
    # a red object is redder than a blue one, on average over the red and blue classes, despite the fading
    x = ds.render_split("test").astype(np.float32)
    labels = np.array([it.label for it in ds.items("test")])
    red, blue = labels // 8 == tw.COLOURS.index("red"), labels // 8 == tw.COLOURS.index("blue")
    rb = x[..., 0] - x[..., 2]
    assert rb[red].mean() > rb[blue].mean() + 5


def test_toy_shift_targets_share_toy_shapes_classes():
    shapes = TASKS["toy-shapes"].classnames
    for name in ("toy-sketch", "toy-shapes-outline", "toy-shapes-faded"):
        spec = TASKS[name]
        assert spec.attribute == "shape" and set(spec.classnames) <= set(shapes)
        assert [c for c in shapes if c in spec.classnames] == list(spec.classnames)  # same relative order
    assert TASKS["toy-shapes-outline"].style == "outline" and len(TASKS["toy-shapes-outline"].classnames) == 4


def test_toy_task_spec_rejects_a_class_that_does_not_name_every_attribute():
    from fewclip.datasets.toytasks import ToyTaskSpec

    spec = ToyTaskSpec(name="x", attribute="colour+shape", classnames=("red circle", "blue"), templates=("{}",))
    with pytest.raises(ValueError, match="'blue'.*colour"):
        spec.class_values()


def test_toy_sketch_images_are_sketches(toy_datasets):
    sketch = toy_datasets["toy-sketch"].render_split("test").astype(np.float32)
    photo = toy_datasets["toy-shapes"].render_split("test").astype(np.float32)
    # pale paper everywhere vs. dark-to-mid backgrounds
    assert np.median(sketch, axis=(1, 2, 3)).min() > 150
    assert np.median(photo, axis=(1, 2, 3)).max() < 150

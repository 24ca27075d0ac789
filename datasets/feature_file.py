"""data=features: a feature file of image features, labels, class names and text features (the format and its
reader: ``fewclip.features.feature_file``; methods on your own features)."""
from fewclip.data.base import register_dataset


# The reader is imported when a feature file is read: it loads torch and open_clip (seconds), which listing the
# datasets (`fewclip datasets`) and every run on another dataset do not need.
def _build(cfg):
    from fewclip.features.feature_file import build_feature_dataset

    return build_feature_dataset(cfg)


def _name(cfg):
    from fewclip.features.feature_file import feature_dataset_name

    return feature_dataset_name(cfg)


register_dataset(
    "features",
    _build,
    description="a feature file, data.path=FILE.safetensors: image features, labels, class names and text "
                "features (methods on your own features; `fewclip features` writes one)",
    layout="data.path=FILE.safetensors: train.x/.y, val.x/.y (optional), test.x/.y, text [C, T, D], metadata "
           "'fewclip' = {format: fewclip.features.encode, classnames, templates, geometry}",
    needs_root=False,
    default_name=_name,
)

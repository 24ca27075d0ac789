"""data=features: a feature file of image features, labels, class names and text features (the format and its
reader: ``fewclip.features.feature_file``; methods on your own features)."""
from fewclip.data.base import register_dataset
from fewclip.features.feature_file import build_feature_dataset, feature_dataset_name

register_dataset(
    "features",
    build_feature_dataset,
    description="a feature file, data.path=FILE.safetensors: image features, labels, class names and text "
                "features (methods on your own features; `fewclip features` writes one)",
    layout="data.path=FILE.safetensors: train.x/.y, val.x/.y (optional), test.x/.y, text [C, T, D], metadata "
           "'fewclip' = {format: fewclip.features.encode, classnames, templates, geometry}",
    needs_root=False,
    default_name=feature_dataset_name,
)

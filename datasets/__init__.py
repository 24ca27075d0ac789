"""fewclip.datasets: fewclip's own dataset readers and the toy world.

Importing this package registers every dataset here (fewclip's registry loads it through the
``fewclip.datasets`` entry point, as it loads a plugin's); it reads no files. The dataset interface
(``fewclip.data.base``) and few-shot splits (``fewclip.data.splits``) are re-exported here for convenience.
"""
from fewclip.data.base import (
                          DATASETS,
                          DataConfig,
                          Dataset,
                          DatasetError,
                          Item,
                          build_dataset,
                          check_classnames,
                          dataset_name,
                          register_dataset,
                          to_rgb,
)
from fewclip.data.splits import FewShotSplit, make_few_shot_split, read_split, sample_few_shot, subsample_test, write_split
from fewclip.datasets import (  # noqa: F401  (registration; feature_file: data=features)
                          benchmarks,
                          feature_file,
                          folder,
                          toytasks,
                          world2tasks,  # noqa: F401  (registration: world 2's w2-* tasks)
)

__all__ = [
    "DATASETS", "DataConfig", "Dataset", "DatasetError", "Item", "build_dataset", "check_classnames", "dataset_name",
    "register_dataset", "to_rgb",
    "FewShotSplit", "make_few_shot_split", "read_split", "sample_few_shot", "subsample_test", "write_split",
]

"""fewclip from Python, end to end on the embedded reference backbone (CPU, no downloads; about a minute).

    python examples/python/first_steps.py [OUT_DIR]

Zero-shot, a 4-shot CoOp run and a small sweep with its report; then the CoOp run is loaded back and its
classifier labels a few test images. Every step writes what the matching `fewclip` command writes.
"""
import sys
from pathlib import Path

import fewclip

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/first_steps")

print("methods:", ", ".join(fewclip.list_adapters()))

# 1. The baseline: zero-shot accuracy of the shipped toy-clip backbone on one toy task.
zs = fewclip.zeroshot(backbone="toy-clip", data={"name": "toy-shapes", "max_test": 200}, out=out / "zeroshot")
print(f"zero-shot top-1: {zs.top1:.1f}%")

# 2. One method, one split: CoOp with 4 shots per class, a short schedule.
coop = fewclip.train("coop", backbone="toy-clip", data={"name": "toy-shapes", "max_test": 200}, shots=4, seed=1,
                     train={"epochs": 5}, out=out / "coop")
print(f"CoOp 4-shot top-1: {coop.top1:.1f}% ({coop.metrics['train_time_s']:.1f} s of training)")

# 3. A sweep: methods x shots x seeds, resumable (run this script again: nothing is retrained).
result = fewclip.sweep(args=[], out=out / "sweep", sweep={"datasets": ["toy-shapes"],
                                                          "methods": ["zeroshot", "tip_adapter", "linear_probe"],
                                                          "shots": [1, 4], "seeds": [1, 2],
                                                          "args": ["data.max_test=200"]})
print(f"sweep: {result.counts['planned']} runs, {result.counts['ran']} ran")
print(result.report.markdown)

# 4. A finished run, loaded back: its metrics, its split and its classifier.
run = fewclip.load_run(out / "coop")
split = run.split
print(f"{run.metrics['method']} on {len(split.classnames)} classes; "
      f"{len(split.train)} training images")
from fewclip.datasets import DataConfig, build_dataset  # noqa: E402  (the images to label)

dataset = build_dataset(DataConfig(name="toy-shapes"))
images = [dataset.load_image(item) for item in dataset.items("test")[:3]]
for guess, item in zip(run.predict(images, top_k=2), dataset.items("test")[:3]):
    print(f"  true: {split.classnames[item.label]:<12} predicted: {guess}")

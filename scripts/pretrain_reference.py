"""Pretrain one of fewclip's reference backbones on the toy world.

    python scripts/pretrain_reference.py recipe=toy-clip            # CPU or CUDA, whichever is there
    python scripts/pretrain_reference.py recipe=toy-meru steps=300 out=/tmp/meru

Writes the weights (fp16 safetensors), the vocabulary and the backbone card into
``out`` (default: fewclip/reference, where the shipped models live), then prints
zero-shot top-1 on every toy task. Recipes: toy-clip, toy-euclip, toy-meru, toy-siglip.
"""
import sys
import time

import torch

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.config.compose import load_config
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets.toypretrain import PretrainConfig, pretrain, save_reference
from fewclip.datasets.toytasks import TASKS
from fewclip.runs.run import score_zeroshot
from fewclip.utils.logs import setup_logging


def main(argv):
    cfg = load_config(argv, PretrainConfig)
    setup_logging("info")
    t0 = time.time()
    model, geometry, tokenizer, mcfg, history = pretrain(cfg)
    elapsed = time.time() - t0
    dev = torch.cuda.get_device_name() if next(model.parameters()).is_cuda else f"CPU ({torch.get_num_threads()} threads)"
    card = save_reference(cfg, model, geometry, tokenizer, mcfg, history, cfg.out, elapsed, dev)
    print(f"trained {cfg.recipe} in {elapsed:.1f} s on {dev}; loss {history[0]['loss']:.3f} -> "
          f"{history[-1]['loss_ema']:.3f} (ema); card: {card}")
    bb = load_backbone(BackboneConfig(name=str(card), device="cpu"))
    for task in TASKS:
        m = score_zeroshot(bb, build_dataset(DataConfig(name=task)), templates="ensemble")
        print(f"  zero-shot {task:15s} {m['top1']:6.2f}%")


if __name__ == "__main__":
    main(sys.argv[1:])

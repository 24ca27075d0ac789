"""Pretrain one of world 2's reference backbones (w2-clip, w2-euclip, w2-meru, w2-siglip) on the CPU.

    OMP_NUM_THREADS=1 python scripts/pretrain_world2.py recipe=w2-clip threads=1  # the shipped w2-clip (about 5 min)
    python scripts/pretrain_world2.py recipe=w2-meru steps=100 out=/tmp/meru      # a quick try elsewhere

Writes the weights (fp16 safetensors, about 2.5 MB), ``w2-vocab.json`` and the card ``<recipe>.yaml`` into ``out``
(default fewclip/reference). ``python scripts/world2_check.py backbone=<recipe>`` then prints zero-shot and
1-shot nearest-neighbour accuracy per world-2 task. On a CPU shared with other jobs use one thread: two threads
there ran about ten times slower per step (each waits for the other when it is descheduled).
"""
import logging
import sys
import time

import torch

from fewclip.config.compose import ConfigError, load_config
from fewclip.datasets.world2pretrain import World2PretrainConfig, pretrain, save_reference


def main(argv):
    try:
        cfg = load_config(argv, World2PretrainConfig)
    except (ConfigError, ValueError) as e:  # an unknown key or wrong type; a recipe or step count out of range
        print(f"pretrain_world2: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.time()
    model, geometry, tok, mcfg, history = pretrain(cfg)
    elapsed = time.time() - t0
    dev = f"CPU ({torch.get_num_threads()} threads)"
    card = save_reference(cfg, model, geometry, tok, mcfg, history, cfg.out, elapsed, dev)
    print(f"trained {cfg.recipe} in {elapsed:.1f} s on {dev}; loss {history[0]['loss']:.3f} -> "
          f"{history[-1]['loss_ema']:.3f} (ema); card: {card}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""IVLP: independent deep prompts in the text and image towers.

Independent vision-language prompting, the baseline of MaPLe (Khattak et al., "MaPLe: Multi-modal Prompt
Learning", CVPR 2023) and the model PromptSRC regularises (Khattak et al., "Self-regulating Prompts",
ICCV 2023); code ``trainers/independentVL.py`` of both authors' repositories. Learnable tokens in the
first ``depth_text`` layers of the text tower and the first ``depth_vision`` layers of the image tower,
with no coupling between them; where they go is ``adapters/_deep.py``. The layer-0 text prompt starts
from the words of ``ctx_init`` (the first ``n_ctx_text`` tokens; further words stay fixed tokens, as in
the authors' code), every other prompt from N(0, 0.02).

Defaults: the PromptSRC repository's IVLP config (``configs/trainers/IVLP/vit_b16_c2_ep20_batch4_4+4ctx.yaml``:
4 + 4 tokens, depth 9 in both towers, "a photo of a", SGD lr 0.0025, 20 epochs, batch 4), chosen over the
MaPLe repository's (``vit_b16_c2_ep5_batch4_2+2ctx.yaml``: 2 + 2 tokens, depth 12, lr 0.0035, 5 epochs)
because PromptSRC is this model plus its regularisers: with the same config, IVLP against PromptSRC
measures the regularisers alone, and with 4 tokens all of "a photo of a" is learnable. The MaPLe paper's
IVLP: ``adapter.n_ctx_text=2 adapter.n_ctx_vision=2 adapter.depth_text=12 adapter.depth_vision=12
train.lr=0.0035 train.epochs=5``. A depth beyond a tower's layers prompts every layer.

``depth_vision=0`` prompts the text tower only (the MaPLe repository's "language only" IVLP): the image
tower is the frozen one, trained on cached features, and with ``depth_text=1`` and word init the model
starts at zero-shot CLIP with the template "{ctx_init} {}." (tested in every geometry). ``depth_text=0``
prompts the image tower only (VPT-deep on CLIP): the text features are computed once.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from fewclip.adapter.base import AdapterConfig, AdapterError, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._deep import DeepPromptAdapter, normal, vision_transformer
from fewclip.config.presets import Preset, Setting, register_presets


@dataclass
class IVLPConfig(AdapterConfig):
    name: str = field(default="ivlp", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx_text: int = field(default=4, metadata={"help": 'Learnable tokens per prompted layer in each tower.'})
    n_ctx_vision: int = field(default=4, metadata={"help": "Learnable prompt tokens per image-tower layer."})
    depth_text: int = field(default=9, metadata={"help": (
        "Prompted layers 0 .. depth-1 in each tower (1: input only; 0: none; beyond the tower's layers: all).")})
    depth_vision: int = field(default=9, metadata={"help": (
        "Image-tower layers that get prompts, from the first (deep prompting).")})
    ctx_init: Optional[str] = field(default="a photo of a", metadata={"help": (
        'Words whose first n_ctx_text tokens initialise the layer-0 text prompt; null = N(0, init_std).')})
    init_std: float = field(default=0.02, metadata={"help": (
        "Standard deviation of the prompts' random initialisation (normal, mean 0).")})
    checkpointing: bool = field(default=False, metadata={"help": (
        "Recompute each block's activations in the backward pass instead of keeping them (less memory).")})

    def __post_init__(self) -> None:
        for key in ("n_ctx_text", "n_ctx_vision", "depth_text", "depth_vision"):
            if getattr(self, key) < 0:
                raise ValueError(f"adapter.{key} must be >= 0, got {getattr(self, key)}")
        if self.depth_text and self.n_ctx_text < 1:
            raise ValueError("adapter.n_ctx_text must be >= 1 when adapter.depth_text > 0")
        if self.depth_vision and self.n_ctx_vision < 1:
            raise ValueError("adapter.n_ctx_vision must be >= 1 when adapter.depth_vision > 0")
        if self.depth_text == 0 and self.depth_vision == 0:
            raise ValueError("adapter.depth_text and adapter.depth_vision are both 0: nothing to learn; set one >= 1")
        if self.depth_text == 0 and self.ctx_init is None:
            raise ValueError("adapter.depth_text=0 keeps the text prompt fixed, so it needs words: set "
                             "adapter.ctx_init (e.g. 'a photo of a')")
        if self.ctx_init is not None and not self.ctx_init.strip():
            raise ValueError("adapter.ctx_init must contain words, or be null for random init")
        if self.init_std <= 0:
            raise ValueError(f"adapter.init_std must be > 0, got {self.init_std}")


class IVLP(DeepPromptAdapter):
    name = "ivlp"
    # The PromptSRC repository's IVLP config (SGD, momentum 0.9, weight decay 5e-4, one warm-up epoch at 1e-5).
    train_defaults = {"lr": 0.0025, "epochs": 20, "batch_size": 4}

    @classmethod
    def will_train_image_tower(cls, cfg: IVLPConfig) -> bool:
        """Image prompts (depth_vision > 0) put the image tower in every step: a launcher gives the run a
        whole GPU."""
        return cfg.depth_vision > 0

    def __init__(self, cfg: IVLPConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        n_text = cfg.n_ctx_text if cfg.depth_text else 0
        super().__init__(cfg, backbone, classnames, templates, n_ctx=n_text, ctx_init=cfg.ctx_init,
                         n_ctx_key="n_ctx_text", checkpointing=cfg.checkpointing)
        generator = default_generator(generator)
        device = backbone.device
        self.depth_text = min(cfg.depth_text, len(self.tower.transformer.resblocks))
        if self.depth_text:
            W = self.tower.width
            prompts = normal((self.depth_text, n_text, W), cfg.init_std, generator)
            init = self.word_init()
            if init is not None:
                prompts[0] = init
            self.text_prompts = nn.Parameter(prompts.to(device))
        self.depth_vision = 0
        if cfg.depth_vision:
            visual = vision_transformer(backbone.model, f"adapter {self.name!r} with depth_vision={cfg.depth_vision}")
            self.depth_vision = min(cfg.depth_vision, len(visual.transformer.resblocks))
            W = int(visual.class_embedding.shape[-1])
            prompts = normal((self.depth_vision, cfg.n_ctx_vision, W), cfg.init_std, generator)
            self.vision_prompts = nn.Parameter(prompts.to(device))
        # With prompts in the image tower, the engine encodes fresh pixels through encode_images every step.
        self.trains_image_tower = self.depth_vision > 0
        if not self.trainable_parameters():
            raise AdapterError(f"adapter {self.name!r} has nothing to learn with this config")

    def text_prompt_layers(self) -> Optional[torch.Tensor]:
        return self.text_prompts if self.depth_text else None

    def vision_prompt_layers(self) -> Optional[torch.Tensor]:
        return self.vision_prompts if self.depth_vision else None


register_adapter("ivlp", IVLPConfig, IVLP, export=STATE)

MAPLE_IVLP = "muzairkhattak/multimodal-prompt-learning@69bce21 configs/trainers/IVLP/vit_b16_c2_ep5_batch4_2+2ctx.yaml"
register_presets(
    "ivlp",
    Preset("authors", "the PromptSRC repository's IVLP (muzairkhattak/PromptSRC@bb95c77 configs/trainers/IVLP/"
                      "vit_b16_c2_ep20_batch4_4+4ctx.yaml): fewclip's defaults"),
    Preset("maple", "the MaPLe repository's IVLP, the MaPLe paper's baseline", settings=(
        Setting("adapter.n_ctx_text", 2, f"{MAPLE_IVLP}:35", "MaPLe's IVLP config"),
        Setting("adapter.n_ctx_vision", 2, f"{MAPLE_IVLP}:34", "MaPLe's IVLP config"),
        Setting("adapter.depth_text", 12, f"{MAPLE_IVLP}:39", "MaPLe's IVLP config"),
        Setting("adapter.depth_vision", 12, f"{MAPLE_IVLP}:38", "MaPLe's IVLP config"),
        Setting("train.lr", 0.0035, f"{MAPLE_IVLP}:18", "MaPLe's IVLP config"),
        Setting("train.epochs", 5, f"{MAPLE_IVLP}:19", "MaPLe's IVLP config"),)),
)

"""MaPLe: deep text prompts, and vision prompts coupled to them.

Khattak et al., "MaPLe: Multi-modal Prompt Learning", CVPR 2023; code ``trainers/maple.py`` of
``muzairkhattak/multimodal-prompt-learning``. Learnable text tokens in the first ``depth`` layers of the
text tower; the image tower's prompt of layer i is a linear function of the text prompt of layer i,
``V_i = T_i W_i^T + b_i`` (one coupling Linear per layer, text width -> vision width), so there are no free
vision prompts and the text prompts get gradients from both towers. Where the tokens go in each tower is
``adapters/_deep.py``. As in the authors' code:

* the layer-0 text prompt starts from the first ``n_ctx`` tokens of ``ctx_init`` (with the default 2 and
  "a photo of a", the prompt reads ``[a] [photo] of a {class}.`` with "of a" fixed tokens); deeper text
  prompts from N(0, 0.02);
* the coupling of layer 0 (their ``proj``) has its own default ``nn.Linear`` init; the couplings of layers
  1 .. depth-1 (their ``compound_prompt_projections``) start as identical copies of one default-initialised
  Linear (``copy.deepcopy``) and then train apart;
* the image tower always gets the layer-0 prompt (their ``VPT_shallow = True``): no depth 0.

Their code hard-codes ViT-B/16's widths (512 -> 768); here the widths are the backbone's. Where one tower
has fewer layers than ``depth``, text prompts exist for max(text layers, vision layers) layers (those beyond
the text tower only feed the image tower's couplings), as the authors' code creates them.

Defaults: ``configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx.yaml`` (2 tokens, depth 9, "a photo of a",
SGD lr 0.0035, 5 epochs, batch 4).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from fewclip.adapter.base import AdapterConfig, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._deep import DeepPromptAdapter, linear_init, normal, vision_transformer
from fewclip.config.presets import Preset, register_presets


@dataclass
class MaPLeConfig(AdapterConfig):
    name: str = field(default="maple", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx: int = field(default=2, metadata={"help": (
        'Learnable tokens per prompted layer (the same in both towers).')})
    depth: int = field(default=9, metadata={"help": (
        "Prompted layers 0 .. depth-1 (1: input only; beyond a tower's layers: all of them).")})
    ctx_init: Optional[str] = field(default="a photo of a", metadata={"help": (
        'Words whose first n_ctx tokens initialise the layer-0 text prompt; null = N(0, init_std).')})
    init_std: float = field(default=0.02, metadata={"help": (
        "Standard deviation of the prompts' random initialisation (normal, mean 0).")})
    checkpointing: bool = field(default=False, metadata={"help": (
        "Recompute each block's activations in the backward pass instead of keeping them (less memory).")})

    def __post_init__(self) -> None:
        if self.n_ctx < 1:
            raise ValueError(f"adapter.n_ctx must be >= 1, got {self.n_ctx}")
        if self.depth < 1:
            raise ValueError(f"adapter.depth must be >= 1 (MaPLe always prompts the input layer), got {self.depth}")
        if self.ctx_init is not None and not self.ctx_init.strip():
            raise ValueError("adapter.ctx_init must contain words, or be null for random init")
        if self.init_std <= 0:
            raise ValueError(f"adapter.init_std must be > 0, got {self.init_std}")


class MaPLe(DeepPromptAdapter):
    name = "maple"
    trains_image_tower = True
    # configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx.yaml (SGD, momentum 0.9, weight decay 5e-4, warm-up 1e-5).
    train_defaults = {"lr": 0.0035, "epochs": 5, "batch_size": 4}

    def __init__(self, cfg: MaPLeConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates, n_ctx=cfg.n_ctx, ctx_init=cfg.ctx_init,
                         n_ctx_key="n_ctx", checkpointing=cfg.checkpointing)
        generator = default_generator(generator)
        device = backbone.device
        visual = vision_transformer(backbone.model, "adapter 'maple'")
        text_layers, vision_layers = len(self.tower.transformer.resblocks), len(visual.transformer.resblocks)
        self.depth_text = min(cfg.depth, text_layers)
        self.depth_vision = min(cfg.depth, vision_layers)
        J = max(self.depth_text, self.depth_vision)
        Wt, Wv = self.tower.width, int(visual.class_embedding.shape[-1])
        text = normal((J, cfg.n_ctx, Wt), cfg.init_std, generator)
        init = self.word_init()
        if init is not None:
            text[0] = init
        w0, b0 = linear_init(1, Wv, Wt, generator)  # layer 0: its own Linear
        w, b = linear_init(1, Wv, Wt, generator)  # deeper layers: copies of one Linear
        weight = torch.cat([w0, w.expand(J - 1, -1, -1)])  # J, Wv, Wt
        bias = torch.cat([b0, b.expand(J - 1, -1)])  # J, Wv
        self.text_prompts = nn.Parameter(text.to(device))
        self.coupling_weight = nn.Parameter(weight.contiguous().to(device))
        self.coupling_bias = nn.Parameter(bias.contiguous().to(device))

    def text_prompt_layers(self) -> torch.Tensor:
        return self.text_prompts[: self.depth_text]

    def vision_prompt_layers(self) -> torch.Tensor:
        """V_i = T_i W_i^T + b_i for the image tower's prompted layers: [Jv, n, W_vision]."""
        J = self.depth_vision
        T, W, b = self.text_prompts[:J], self.coupling_weight[:J], self.coupling_bias[:J]
        return torch.einsum("jnt,jvt->jnv", T, W) + b.unsqueeze(1)


register_adapter("maple", MaPLeConfig, MaPLe, export=STATE)

register_presets(
    "maple",
    Preset("authors", "MaPLe's vit_b16_c2_ep5_batch4_2ctx config: fewclip's defaults "
                      "(tests/parity/test_deep_parity.py)"),
)

"""LoRA on the frozen towers, injected with peft (CLIP-LoRA).

Zanella and Ben Ayed, "Low-Rank Few-Shot Adaptation of Vision-Language
Models", CVPRW 2024: low-rank updates ``W + (alpha / r) * B A`` on the query,
key and value projections of every layer of both towers, rank 2, alpha 1,
dropout 0.25 on the LoRA input, AdamW (lr 2e-4, weight decay 1e-2), cosine
schedule, batch 32, 500 x shots iterations. Those are the defaults here; the
optimisation defaults reach the run's ``train`` section through
``LoRA.train_defaults`` and any of them can be overridden on the command line.

open_clip packs q, k and v into one ``in_proj_weight`` of an
``nn.MultiheadAttention``; peft adapts ``nn.Linear`` modules. So the adapter
works on a *copy* of the backbone's module tree (the frozen tensors are shared,
not copied) whose targeted attention modules are ``fewclip.backbones.attention.SplitAttention``
(q, k, v and output as four Linears, numerically the same attention, local
windows kept), and peft's ``LoraConfig`` names exactly the Linears to adapt:
``q``, ``k``, ``v``, ``o`` (attention output) and ``mlp`` (both MLP layers),
in the chosen ``towers`` and ``layers``. The backbone itself is never modified,
so a sweep can reuse it for the next run.

peft initialises B to zero, so at initialisation the logits *are* the
zero-shot logits of the run's templates, in every geometry: the text features
go through the geometry (embedded, averaged per class) exactly as zero-shot's
prototypes do.

Only the text tower adapted: ``forward(features)`` takes the cached image
features of the frozen image tower. Vision tower adapted: the engine calls
``encode_images(pixels)`` every step (under autocast on CUDA), and tests on
features from the adapted image tower.

The saved adapter state (``adapter_state_dict``) is the LoRA A and B matrices
only. ``save_peft(dir)`` writes them in peft's own format
(``adapter_model.safetensors`` + ``adapter_config.json``), and
``merged_state_dict()`` folds them into a plain open_clip state dict; its
export format (``lora_export.py``) uses both.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from fewclip.adapter.base import Adapter, AdapterConfig, default_generator, register_adapter
from fewclip.adapters._text import TextTower
from fewclip.adapters._towers import (  # noqa: F401
    TARGETS,
    TOWERS,
    TowerPrototypes,
    check_tower_targets,
    shared_copy,
    target_linears,
    target_list,
    tower_blocks,
)
from fewclip.adapters.lora_export import LORA
from fewclip.backbones.attention import pack_split_state
from fewclip.config.presets import Preset, register_presets
from fewclip.utils.rng import forked_global_rng

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # peft's adapter slot


def _peft():
    """peft, on first use: it imports transformers (seconds), and only LoRA needs it."""
    import peft  # a measured start-up cost: every command that loads the method registry would pay it

    return peft


@dataclass
class LoRAConfig(AdapterConfig):
    name: str = field(default="lora", metadata={"help": "The method (`fewclip adapters` lists them)."})
    rank: int = field(default=2, metadata={"help": "Rank r of each low-rank update B A (CLIP-LoRA: 2)."})
    alpha: float = field(default=1.0, metadata={"help": "Scale of the update: W + (alpha / r) B A (CLIP-LoRA: 1)."})
    dropout: float = field(default=0.25, metadata={"help": (
        "Dropout on the input of each low-rank update during training (CLIP-LoRA: 0.25).")})
    targets: str = field(default="q,k,v", metadata={"help": (
        'Comma list of q, k, v (each on its own), o (attention output projection) and mlp (both MLP Linears).')})
    towers: str = field(default="both", metadata={"help": '"text", "vision" or "both".'})
    layers: str = field(default="all", metadata={"help": (
        '"all", "first:N", "last:N" or a comma list of layer indices, in each adapted tower.')})

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"adapter.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"adapter.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"adapter.dropout must be in [0, 1), got {self.dropout}")
        check_tower_targets(self.targets, self.towers, self.layers)

    @property
    def target_list(self) -> list[str]:
        return target_list(self.targets)


def lora_target_modules(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Split the targeted blocks' attention (in place, on a copy) and list the full names of the Linears
    peft should adapt."""
    return target_linears(model, cfg.towers, cfg.layers, cfg.target_list, "LoRA")


class LoRA(TowerPrototypes, Adapter):
    name = "lora"
    uses_text_tower = True
    # The adapted towers score any class names: the prototypes of their prompts through the adapted text tower.
    supports_new_classes = True
    # The run's `train` section starts from these (CLIP-LoRA's recipe) instead of CoOp's.
    train_defaults = {"optimizer": "adamw", "lr": 2e-4, "weight_decay": 1e-2, "warmup_epochs": 0,
                      "iterations_per_shot": 500}

    def __init__(self, cfg: LoRAConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates)
        LoraConfig, get_peft_model = _peft().LoraConfig, _peft().get_peft_model

        if not self.templates:
            self.templates = ["a photo of a {}."]
        bad = [t for t in self.templates if t.count("{}") != 1]
        if bad:
            raise ValueError(f"each prompt template needs exactly one '{{}}' for the class name; bad: {bad}")
        self.adapts_text = cfg.towers in ("text", "both")
        self.trains_image_tower = self.will_train_image_tower(cfg)
        model = shared_copy(backbone.model)
        targets = lora_target_modules(model, cfg)
        self.peft_config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                      target_modules=targets, bias="none")
        # peft initialises the A matrices from torch's global RNG and takes no generator: run it on a fork of the
        # global RNG seeded from ours (B starts at zero, so the logits at init do not depend on the draw).
        with forked_global_rng(default_generator(generator)):
            peft_model = get_peft_model(model, self.peft_config, adapter_name=ADAPTER_NAME)
        self.keep_outside("peft_model", peft_model)
        self.keep_outside("model", model)  # the LoRA-injected copy (peft wraps its Linears in place)
        self.keep_outside("tower", TextTower(model, backbone.tokenizer))
        # Register the LoRA modules (and their dropout) on the adapter: parameters(), train() and the
        # state dict then cover exactly the LoRA tensors.
        self.lora = nn.ModuleDict()
        for name, mod in model.named_modules():
            if hasattr(mod, "lora_A") and ADAPTER_NAME in getattr(mod, "lora_A", {}):
                self.lora[name.replace(".", "__")] = nn.ModuleDict({
                    "A": mod.lora_A[ADAPTER_NAME], "B": mod.lora_B[ADAPTER_NAME],
                    "dropout": mod.lora_dropout[ADAPTER_NAME]})
        for p in self.lora.parameters():
            p.requires_grad_(True)
        # Prompts as token ids, cut to the longest prompt where that is exact.
        texts = [t.format(c) for c in self.classnames for t in self.templates]
        tokens = backbone.tokenize(texts)
        if self.tower.can_truncate:
            L = int((tokens != self.tower.pad_id).sum(dim=1).max())
            L = max(L, int(tokens.argmax(dim=1).max()) + 1)
            tokens = tokens[:, :L]
        self.register_buffer("tokens", tokens, persistent=False)
        self._fixed_protos: Optional[torch.Tensor] = None

    @classmethod
    def will_train_image_tower(cls, cfg: LoRAConfig) -> bool:
        return cfg.towers in ("vision", "both")

    # -- towers --------------------------------------------------------------
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw features [B, D] from the (adapted) image tower; gradients flow when enabled."""
        bb = self.backbone
        return self.model.encode_image(pixels.to(bb.device, bb.dtype)).float()

    def text_features(self) -> torch.Tensor:
        """Raw text features [C*T, D] of every class prompt through the (adapted) text tower."""
        tokens = self.tokens
        x = self.tower.embed(tokens)
        return self.tower.forward(x, tokens)

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> LoRA:
        """The adapted towers with the prototypes of other class names and templates: a new LoRA adapter on its
        own copy of the module tree, holding these LoRA weights (image features encoded by this adapter's image
        tower go with it unchanged)."""
        if list(classnames) == self.classnames and (list(templates) or ["a photo of a {}."]) == self.templates:
            return self
        return self.rebuilt_for(classnames, templates)

    # -- export --------------------------------------------------------------
    def trainable_parameter_count(self) -> int:
        return sum(p.numel() for p in self.lora.parameters())

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors under peft's own names (as in ``adapter_model.safetensors``)."""
        get_peft_model_state_dict = _peft().get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.peft_model, adapter_name=ADAPTER_NAME)
        return {k: v.detach().cpu().contiguous() for k, v in sd.items()}

    def load_peft_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        set_peft_model_state_dict = _peft().set_peft_model_state_dict

        result = set_peft_model_state_dict(self.peft_model, sd, adapter_name=ADAPTER_NAME)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"LoRA weights do not fit this adapter: missing {missing[:3]}, "
                             f"unexpected {list(result.unexpected_keys)[:3]}")
        self._fixed_protos = None

    def save_peft(self, folder) -> None:
        """peft's own format: ``adapter_model.safetensors`` and ``adapter_config.json``."""
        self.peft_model.save_pretrained(str(folder), selected_adapters=[ADAPTER_NAME])

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The backbone's open_clip state dict with the LoRA updates folded in (same keys as the original)."""
        get_peft_model, set_peft_model_state_dict = _peft().get_peft_model, _peft().set_peft_model_state_dict

        model = copy.deepcopy(self.backbone.model)  # a real copy: merging writes into the weights
        lora_target_modules(model, self.cfg)
        with forked_global_rng(0):  # peft's init draws are overwritten by the trained weights just below
            pm = get_peft_model(model, self.peft_config, adapter_name=ADAPTER_NAME)
        set_peft_model_state_dict(pm, self.peft_state_dict(), adapter_name=ADAPTER_NAME)
        merged = pm.merge_and_unload()
        sd = pack_split_state({k: v.detach().cpu().contiguous() for k, v in merged.state_dict().items()})
        own = self.backbone.model.state_dict()
        if list(sorted(sd)) != list(sorted(own)):
            raise RuntimeError("merged LoRA state dict does not have the backbone's keys")
        return {k: sd[k].to(own[k].dtype).contiguous() for k in own}

    def load_adapter_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        super().load_adapter_state_dict(sd)
        self._fixed_protos = None


register_adapter("lora", LoRAConfig, LoRA, export=LORA)

register_presets(
    "lora",
    Preset("authors", "CLIP-LoRA's released recipe (rank 2, alpha 1, dropout 0.25, AdamW 2e-4, weight"
                      " decay 1e-2, 500 x shots iterations): fewclip's defaults (tests/test_lora.py)"),
)

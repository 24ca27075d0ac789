"""CoOp: learnable context vectors in front of (or around) the class name.

Zhou et al., "Learning to Prompt for Vision-Language Models", IJCV 2022. The
prompt for class c is, in token embeddings,

    end     [SOT] [ctx_1 .. ctx_n] [name_c] [.] [EOT]
    middle  [SOT] [ctx_1 .. ctx_n/2] [name_c] [ctx_n/2+1 .. ctx_n] [.] [EOT]
    front   [SOT] [name_c] [ctx_1 .. ctx_n] [.] [EOT]

with one context shared by all classes (unified) or one per class (CSC); the
layout is ``assemble_prompts`` (``adapters/_prompts.py``), a pure function of
token ids that the methods built on CoOp's prompts share. The context starts
either at random (normal, std 0.02, drawn from the ``generator`` the adapter
is built with) or from the embeddings of the words of ``ctx_init`` (``"a
photo of a"``; a word that the tokenizer splits into several tokens gives
several context vectors, and ``n_ctx`` is then the number of tokens).
Initialised from words, the prompt *is* the zero-shot prompt
``equivalent_template()``, and the logits equal the zero-shot logits.

The text features go through the backbone's geometry: embedded, turned into
one prototype per class, and compared with the embedded image features by the
geometry's logits, so CoOp runs unchanged on every geometry.

The class prompts' token ids and fixed embeddings are rebuilt from the class
names (non-persistent buffers); the only saved tensor is ``ctx``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from fewclip.adapter.base import Adapter, AdapterConfig, AdapterError, default_generator, register_adapter
from fewclip.adapters._prompts import POSITIONS, packed_suffixes, shared_prefix_length
from fewclip.adapters._text import TextTower, class_prompts, pad_sequences
from fewclip.adapters.coop_export import PROMPTS
from fewclip.config.presets import Preset, register_presets


@dataclass
class CoOpConfig(AdapterConfig):
    name: str = field(default="coop", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx: int = field(default=16, metadata={"help": (
        'Number of context vectors (ignored when ctx_init is given: the words decide).')})
    ctx_init: Optional[str] = field(default=None, metadata={"help": (
        'Initial words, e.g. "a photo of a"; null = random init.')})
    csc: bool = field(default=False, metadata={"help": (
        'Class-specific context: one context per class instead of one shared.')})
    class_token_position: str = field(default="end", metadata={"help": (
        'Where the class name goes: "end" (after the context), "middle" or "front".')})
    init_std: float = field(default=0.02, metadata={"help": (
        "Standard deviation of the random context initialisation (normal, mean 0).")})

    def __post_init__(self) -> None:
        if self.class_token_position not in POSITIONS:
            raise ValueError(f"adapter.class_token_position must be one of {POSITIONS}, "
                             f"got {self.class_token_position!r}")
        if self.ctx_init is None and self.n_ctx < 1:
            raise ValueError(f"adapter.n_ctx must be >= 1, got {self.n_ctx}")
        if self.ctx_init is not None and not self.ctx_init.strip():
            raise ValueError("adapter.ctx_init must contain words, or be null for random init")
        if self.init_std <= 0:
            raise ValueError(f"adapter.init_std must be > 0, got {self.init_std}")


class CoOp(Adapter):
    name = "coop"
    uses_text_tower = True
    text_step = "text_features"
    # A unified context fits any class name (CoOp's and CoCoOp's base-to-novel and transfer evaluations); a
    # class-specific one (csc) does not, and the instance says so (``__init__``).
    supports_new_classes = True

    def __init__(self, cfg: CoOpConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates)
        self.supports_new_classes = not cfg.csc
        generator = default_generator(generator)
        tower = TextTower(backbone.model, backbone.tokenizer)
        self.keep_outside("tower", tower)
        C = len(self.classnames)

        if cfg.ctx_init is not None:
            init_ids = tower.encode_words(cfg.ctx_init)
            if not init_ids:
                raise AdapterError(f"adapter.ctx_init={cfg.ctx_init!r} gives no tokens with this backbone's tokenizer; "
                                   f"give words it knows, or null for a random context")
            n_ctx = len(init_ids)
        else:
            init_ids, n_ctx = None, cfg.n_ctx
        self.n_ctx = n_ctx

        # Token ids per class, with a placeholder id where the context goes: its embedding is replaced, but
        # the pooling must not find it (the start token; padding for a tokenizer without one).
        ends = tower.prompt_ends()  # the tokenizer's start (maybe none) and end tokens
        placeholder = init_ids if init_ids is not None else [tower.placeholder_id] * n_ctx  # embedding replaced
        layout = class_prompts(tower, self.classnames, placeholder, cfg.class_token_position, backbone.name,
                               suffix=self.prompt_suffix())
        seqs, ctx_pos = layout.tokens, layout.ctx_positions
        self.prompt_lengths = [len(s) for s in seqs]  # tokens of each class prompt, start and end included
        # Ids and context positions kept on the host too: reading them back from a GPU would sync.
        self.prompt_token_ids = [list(s) for s in seqs]
        self.prompt_ctx_positions = [list(p) for p in ctx_pos]
        longest = max(self.prompt_lengths)
        # Cut to the longest prompt where that is exact (causal mask, pooling at the end-of-text token).
        L = longest if tower.can_truncate else tower.context_length
        tokens = pad_sequences(seqs, L, pad_id=getattr(tower, "pad_id", 0))
        device = backbone.device
        self.register_buffer("tokens", tokens.to(device), persistent=False)  # C, L
        self.register_buffer("ctx_pos", torch.tensor(ctx_pos, dtype=torch.long, device=device), persistent=False)
        with torch.no_grad():
            fixed = tower.embed(self.tokens).float()  # C, L, W
        self.register_buffer("fixed_embeddings", fixed, persistent=False)

        W = tower.width
        if init_ids is not None:
            with torch.no_grad():
                ctx = tower.embed(torch.tensor(init_ids, device=device)).float()  # n, W
            if cfg.csc:
                ctx = ctx.unsqueeze(0).repeat(C, 1, 1)
        else:
            shape = (C, n_ctx, W) if cfg.csc else (n_ctx, W)
            ctx = torch.randn(shape, generator=generator) * cfg.init_std
        self.ctx = nn.Parameter(ctx.to(device))
        # Positions [0, P) hold the same embedding for every class (start token + shared context).
        self.shared_len = shared_prefix_length(n_ctx, cfg.class_token_position, n_start=len(ends.start),
                                               csc=cfg.csc)
        # "shared": compute the shared prefix once per step (fastest, exact); "truncate": every prompt
        # in full but cut to the longest one; "faithful": full context length (the reference path).
        # On the CPU the shared prefix is fastest; on a GPU the many small kernels of the shared path
        # cost more than they save, and one batched pass over the cut prompts wins (scripts/bench_train.py).
        can_share = tower.can_share_prefix and self.shared_len >= 2
        self.text_mode = "shared" if (can_share and device.type == "cpu") else "truncate"
        # The shared path packs every class's tokens after the prefix end to end (``packed_suffixes``);
        # index tensors for the packing, rebuilt from the class names:
        cls_idx, pos_idx, mask, pool = packed_suffixes(seqs, self.shared_len)
        self.register_buffer("_pack_cls", cls_idx.to(device), persistent=False)
        self.register_buffer("_pack_pos", pos_idx.to(device), persistent=False)
        self.register_buffer("_pack_mask", mask.to(device), persistent=False)
        self.register_buffer("_pack_pool", pool.to(device), persistent=False)

    # -- prompts ----------------------------------------------------------
    def prompt_suffix(self) -> str:
        """The words after the class name: CoOp's full stop (TCP keeps the rest of the dataset's template)."""
        return "."

    def equivalent_template(self) -> Optional[str]:
        """The zero-shot template this context reproduces at initialisation (word init only).

        ``None`` for a random init, and where no template tokenizes to these
        prompts (``middle`` with the split falling inside a multi-token word).
        """
        if self.cfg.ctx_init is None:
            return None
        words = self.cfg.ctx_init.strip()
        pos = self.cfg.class_token_position
        suffix = self.prompt_suffix()
        if pos == "end":
            template = f"{words} {{}}{suffix}"
        elif pos == "front":
            template = f"{{}} {words}{suffix}"
        else:
            ids = self.tower.encode_words(words)
            half = len(ids) // 2
            dec = self.backbone.tokenizer.decode
            first, second = dec(ids[:half]).strip(), dec(ids[half:]).strip()
            template = " ".join(p for p in (first, "{}", second) if p) + suffix
        # The template is equivalent only if it tokenizes to exactly these prompts.
        ends = self.tower.prompt_ends()
        for name, row in zip(self.classnames, self.tokens.tolist()):
            ids = ends.start + self.tower.encode_words(template.format(name)) + ends.end
            if row[: len(ids)] != ids or any(t != self.tower.pad_id for t in row[len(ids):]):
                return None
        return template

    def prompt_embeddings(self) -> torch.Tensor:
        """Prompt embeddings [C, L, W] with the context vectors in place."""
        C = self.tokens.shape[0]
        ctx = self.ctx if self.ctx.dim() == 3 else self.ctx.unsqueeze(0).expand(C, -1, -1)  # C, n, W
        index = self.ctx_pos.unsqueeze(-1).expand(-1, -1, ctx.shape[-1])
        return self.fixed_embeddings.scatter(1, index, ctx.to(self.fixed_embeddings.dtype))

    def set_text_mode(self, mode: str) -> CoOp:
        """Choose how the text tower runs: "shared", "truncate" or "faithful" (all give the same logits)."""
        if mode not in ("shared", "truncate", "faithful"):
            raise ValueError(f"text mode must be shared, truncate or faithful, got {mode!r}")
        if mode == "shared" and not (self.tower.can_share_prefix and self.shared_len >= 2):
            raise ValueError("this prompt layout or text tower has no shared prefix to compute once")
        self.text_mode = mode
        return self

    def text_features(self) -> torch.Tensor:
        """Raw text-tower features [C, D] of the current prompts."""
        x = self.prompt_embeddings()  # C, L, W
        if self.text_mode == "shared":
            packed = x[self._pack_cls, self._pack_pos]  # T, W
            return self.tower.forward_packed(x[0, : self.shared_len], packed, self._pack_pos, self._pack_mask,
                                             self._pack_pool)
        if self.text_mode == "faithful" and x.shape[1] < self.tower.context_length:
            L = self.tower.context_length
            pad_tok = torch.full((x.shape[0], L - x.shape[1]), self.tower.pad_id, dtype=self.tokens.dtype,
                                 device=x.device)
            tokens = torch.cat([self.tokens, pad_tok], dim=1)
            x = torch.cat([x, self.tower.embed(pad_tok).to(x.dtype)], dim=1)
            return self.tower.forward(x, tokens)
        return self.tower.forward(x, self.tokens)

    def prototypes(self) -> torch.Tensor:
        g = self.backbone.geometry
        emb = g.embed_text(self.text_features())  # C, D
        return g.prototype(emb.unsqueeze(1))  # one "template" per class

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.backbone.geometry.image_logits(features, self.prototypes())

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str] = ()) -> CoOp:
        """The learned unified context around other class names (the templates are not used: the context
        replaces them). A class-specific context (``csc``) has no context for a class it was not trained on:
        an ``AdapterError``."""
        if list(classnames) == self.classnames:
            return self
        if self.cfg.csc:
            raise AdapterError("CoOp with a class-specific context (adapter.csc=true) learns one context per trained "
                               "class and cannot score other class names; use the unified context "
                               "(adapter.csc=false) for new classes")
        return self.rebuilt_for(classnames, templates)

    @torch.no_grad()
    def nearest_words(self, k: int = 3) -> list[list[list[str]]]:
        """CoOp's interpretation: the k vocabulary tokens nearest (Euclidean) to each context vector,
        special tokens excluded.

        Returns [n_groups][n_ctx][k] strings; one group for a unified context, one per class for CSC.
        """
        table = self.tower.token_embedding.weight.float()  # V, W
        ctx = self.ctx.float() if self.ctx.dim() == 3 else self.ctx.float().unsqueeze(0)
        tok = self.backbone.tokenizer
        decoder = getattr(tok, "decoder", {})
        # Special tokens (start, end, padding, unknown) are not words: leave them out.
        special = [getattr(tok, a, None) for a in ("sot_token_id", "eot_token_id", "pad_token_id", "unk_token_id")]
        special = torch.tensor([i for i in special if i is not None and 0 <= i < table.shape[0]], dtype=torch.long)
        out = []
        for group in ctx:
            d = torch.cdist(group, table)  # n, V
            if len(special):
                d[:, special.to(d.device)] = float("inf")
            idx = d.topk(k, largest=False).indices
            out.append([[str(decoder.get(int(i), int(i))).replace("</w>", "") for i in row] for row in idx])
        return out


register_adapter("coop", CoOpConfig, CoOp, export=PROMPTS)

register_presets(
    "coop",
    Preset("authors", "CoOp's released configs (KaiyangZhou/CoOp configs/trainers/CoOp/*.yaml): "
                      "fewclip's defaults (tests/parity/test_prompt_parity.py)"),
)

"""Running a frozen open_clip text tower on prompt *embeddings* (shared plumbing).

Prompt-learning adapters replace some token embeddings with learned vectors
and need the rest of the text tower exactly as open_clip runs it: add the
positional embedding, run the transformer with the tower's own attention mask
(causal for CLIP, none for SigLIP-style towers), apply the final LayerNorm,
pool (at the end-of-text token for ``argmax``/``eos``, the last position for
``last``, the first for ``first``) and project.

``TextTower.prompt_ends`` gives the special tokens the backbone's tokenizer puts
around every text and its padding id: CLIP's BPE and fewclip's word tokenizer
start with a start-of-text token and end with end-of-text; a Hugging Face
tokenizer (SigLIP's) may have no start token at all. Prompt learning builds its
prompts from these, so that a prompt equals the tokenizer's own output for the
equivalent text.

``TextTower.can_truncate`` says when running a shorter sequence is *exact*:
with a causal mask, position i never sees positions after it, so cutting every
sequence right after its pooled token changes nothing. Without a causal mask
(padding tokens are attended to) or with ``last`` pooling it is not exact, and
the tower runs at the full context length.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.transformer import ResidualAttentionBlock, text_global_pool

from fewclip.adapter.base import AdapterError
from fewclip.adapters._prompts import PromptLayout, assemble_prompts


@dataclass(frozen=True)
class PromptEnds:
    """What a tokenizer puts around every text: ``start + words + end``, then ``pad`` up to the length."""

    start: list[int]  # empty for tokenizers without a start token (SigLIP's)
    end: list[int]
    pad: int

    @property
    def has_start(self) -> bool:
        return bool(self.start)


def prompt_ends(tokenizer) -> PromptEnds:
    """The special tokens of fewclip's word tokenizer, open_clip's BPE, or ``fewclip.backbones.tokenizer.HFTextTokenizer``."""
    if hasattr(tokenizer, "start_ids"):  # HFTextTokenizer: read from the Hugging Face tokenizer itself
        return PromptEnds(list(tokenizer.start_ids), list(tokenizer.end_ids), int(tokenizer.pad_token_id))
    return PromptEnds([int(tokenizer.sot_token_id)], [int(tokenizer.eot_token_id)],
                      int(getattr(tokenizer, "pad_token_id", 0) or 0))  # open_clip's BPE pads with 0


class TextTower:
    """Public pieces of the text tower of an open_clip ``CLIP`` or ``CustomTextCLIP``."""

    def __init__(self, model: nn.Module, tokenizer):
        t = model.text if hasattr(model, "text") else model
        if getattr(t, "cls_emb", None) is not None:
            raise AdapterError("text towers with an appended class embedding (CoCa) are not supported by prompt "
                               "learning")
        if not hasattr(t, "token_embedding"):
            raise AdapterError("this backbone's text tower (e.g. a Hugging Face model) exposes no token embedding; "
                               "prompt learning needs an open_clip TextTransformer")
        self.token_embedding = t.token_embedding
        self.positional_embedding = t.positional_embedding
        self.transformer = t.transformer
        self.ln_final = t.ln_final
        self.text_projection = t.text_projection
        self.attn_mask: Optional[torch.Tensor] = t.attn_mask
        self.pool_type = t.text_pool_type if hasattr(t, "text_pool_type") else t.pool_type
        self.eos_id = getattr(t, "text_eos_id", None) if hasattr(t, "text_eos_id") else getattr(t, "eos_id", None)
        # The model's padding id, which its padding mask looks for; prompts are padded with the tokenizer's.
        self.mask_pad_id = getattr(t, "pad_id", 0)
        self.use_pad_mask = bool(getattr(t, "use_pad_mask", False))
        self.context_length = int(t.context_length)
        self.width = int(self.token_embedding.weight.shape[1])
        self.tokenizer = tokenizer
        if not hasattr(tokenizer, "encode") or not (hasattr(tokenizer, "sot_token_id") or hasattr(tokenizer, "start_ids")):
            raise AdapterError("prompt learning needs a tokenizer with encode() and known start/end tokens "
                               "(open_clip's SimpleTokenizer, fewclip's WordTokenizer, or a Hugging Face tokenizer "
                               "loaded by fewclip)")
        self._ends = prompt_ends(tokenizer)
        self.pad_id = self._ends.pad  # what the tokenizer pads with: prompts must match its output

    @property
    def causal(self) -> bool:
        return self.attn_mask is not None

    @property
    def can_truncate(self) -> bool:
        return self.causal and self.pool_type in ("argmax", "eos", "first") and not self.use_pad_mask

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.get_cast_dtype()

    def encode_words(self, text: str) -> list[int]:
        """Token ids of ``text`` without start/end tokens."""
        return list(self.tokenizer.encode(text))

    def prompt_ends(self) -> PromptEnds:
        """The tokenizer's start tokens (possibly none), end tokens and padding id."""
        return self._ends

    @property
    def placeholder_id(self) -> int:
        """An id for positions whose embedding is replaced (learned context): the start token where there is
        one, else the smallest id that is no special token, so that pooling and padding never see it."""
        if self._ends.has_start:
            return self._ends.start[0]
        special = {*self._ends.end, self._ends.pad, self.mask_pad_id, self.eos_id}
        return next(i for i in range(self.token_embedding.num_embeddings) if i not in special)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, L, W] for ids [N, L]."""
        return self.token_embedding(tokens)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor,
                before_block: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Raw text features [N, D] from prompt embeddings ``x`` [N, L, W] and their ids ``tokens`` [N, L].

        ``tokens`` decide the pooled position (``argmax``/``eos``) and padding;
        L may be shorter than the context length only where ``can_truncate``.
        ``before_block(i, h) -> h``, when given, may change the hidden states [N, L, W] entering block i
        (TCP puts its class-aware tokens in at one block).
        """
        N, L, W = x.shape
        if L > self.context_length:
            raise ValueError(f"prompt of {L} tokens exceeds the text tower's context length {self.context_length}")
        x = x.to(self.dtype) + self.positional_embedding[:L].to(self.dtype)
        mask = self.attn_mask[:L, :L] if self.attn_mask is not None else None
        if self.use_pad_mask:
            pad = torch.zeros(N, 1, L, dtype=x.dtype, device=x.device)
            pad.masked_fill_((tokens == self.mask_pad_id)[:, None, :], float("-inf"))
            heads = self.transformer.resblocks[0].attn.num_heads
            pad = pad.expand(N, L, L).repeat_interleave(heads, 0)
            mask = pad if mask is None else mask.unsqueeze(0) + pad
        x = self.transformer(x, attn_mask=mask) if before_block is None else self._blocks(x, mask, before_block)
        x = self.ln_final(x)
        pooled = text_global_pool(x, tokens, self.pool_type, eos_token_id=self.eos_id)
        if self.text_projection is not None:
            pooled = self.text_projection(pooled) if isinstance(self.text_projection, nn.Linear) \
                else pooled @ self.text_projection
        return pooled.float()

    def _blocks(self, x: torch.Tensor, mask: Optional[torch.Tensor], before_block) -> torch.Tensor:
        """The transformer's blocks one by one on [N, L, W], with ``before_block`` at each block's input."""
        batch_first = getattr(self.transformer, "batch_first", True)
        for i, blk in enumerate(self.transformer.resblocks):
            x = before_block(i, x)
            x = blk(x, attn_mask=mask) if batch_first else blk(x.transpose(0, 1), attn_mask=mask).transpose(0, 1)
        return x

    # -- pieces of ``forward``, for towers run block by block (deep prompts, adapters/_deep.py) ----------
    def attention_mask(self, tokens: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The attention mask ``forward`` gives the transformer for ids ``tokens`` [N, L]: the causal mask
        cut to L (or none), plus the padding mask [N*heads, L, L] where the tower has one."""
        N, L = tokens.shape
        mask = self.attn_mask[:L, :L].to(dtype) if self.attn_mask is not None else None
        if self.use_pad_mask:
            pad = torch.zeros(N, 1, L, dtype=dtype, device=tokens.device)
            pad.masked_fill_((tokens == self.mask_pad_id)[:, None, :], float("-inf"))
            heads = self.transformer.resblocks[0].attn.num_heads
            pad = pad.expand(N, L, L).repeat_interleave(heads, 0)
            mask = pad if mask is None else mask.unsqueeze(0) + pad
        return mask

    def pool(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The pooled rows [N, W] of the last block's output ``x`` [N, L, W] (``forward``'s pooling)."""
        return text_global_pool(x, tokens, self.pool_type, eos_token_id=self.eos_id)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and projection of pooled rows [N, W] -> raw features [N, D] in float32 (LayerNorm
        acts per token, so normalising after pooling is ``forward``'s normalising before it)."""
        pooled = self.ln_final(pooled)
        if self.text_projection is not None:
            pooled = self.text_projection(pooled) if isinstance(self.text_projection, nn.Linear) \
                else pooled @ self.text_projection
        return pooled.float()

    # -- shared prefix ----------------------------------------------------------
    @property
    def can_share_prefix(self) -> bool:
        """Whether ``forward_packed`` applies: a causal tower of standard open_clip blocks."""
        return (self.can_truncate and self.pool_type in ("argmax", "eos")
                and all(type(b) is ResidualAttentionBlock and type(b.attn) is nn.MultiheadAttention
                        and b.attn.batch_first and b.attn._qkv_same_embed_dim
                        for b in self.transformer.resblocks))

    def forward_packed(self, prefix: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor, pool_index: torch.Tensor) -> torch.Tensor:
        """Raw text features [C, D] of C prompts sharing a prefix, with their suffixes packed end to end.

        ``prefix`` [P, W]; ``packed`` [T, W] holds every prompt's tokens after the prefix up to and
        including its end-of-text token, with no padding; ``positions`` [T] their positions in
        their own prompt; ``mask`` [T, P+T] (bool, True = may attend) lets a token see the prefix
        and the earlier tokens of its own prompt; ``pool_index`` [C] is each prompt's end-of-text
        token in ``packed``. Equal to ``forward`` on the padded prompts, with no work on padding.
        """
        P, W = prefix.shape
        dt = self.dtype
        xp = (prefix.to(dt) + self.positional_embedding[:P].to(dt)).unsqueeze(0)  # 1, P, W
        xs = (packed.to(dt) + self.positional_embedding[positions].to(dt)).unsqueeze(0)  # 1, T, W
        causal_p = torch.ones(P, P, dtype=torch.bool, device=xp.device).tril()
        for blk in self.transformer.resblocks:
            xp, xs = _block_shared(blk, xp, xs, causal_p, mask)
        pooled = self.ln_final(xs[0, pool_index])  # LayerNorm is per token: pool first, then normalise
        if self.text_projection is not None:
            pooled = self.text_projection(pooled) if isinstance(self.text_projection, nn.Linear) \
                else pooled @ self.text_projection
        return pooled.float()

    def forward_rows(self, prefix: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor, pool_index: torch.Tensor) -> torch.Tensor:
        """Raw text features [B, C, D] of C prompts per image, each image's prompts sharing a prefix (CoCoOp:
        the start token and the image-conditioned context), with the classes' suffixes packed in rows.

        ``prefix`` [B, P, W]; ``packed`` [R, S, W] (the same for every image) or [B, R, S, W], the rows of
        ``packed_suffix_rows`` with ``positions`` [R, S] (in each token's own prompt), ``mask`` [R, S, P+S]
        and ``pool_index`` [C] (into the R * S slots). Each row runs as one sequence: its image's prefix
        (causal), then its packed tokens; the prefix is computed once per row, a few tokens, rather than
        once per class. Equal to ``forward`` on every image's padded prompts, with no work on padding.
        """
        B, P, W = prefix.shape
        R, S = positions.shape
        dt = self.dtype
        xp = (prefix.to(dt) + self.positional_embedding[:P].to(dt)).unsqueeze(1).expand(B, R, P, W)
        xs = (packed.to(dt) + self.positional_embedding[positions].to(dt)).expand(B, R, S, W)
        x = torch.cat([xp, xs], dim=2).reshape(B * R, P + S, W)
        top = torch.cat([torch.ones(P, P, dtype=torch.bool, device=x.device).tril(),
                         torch.zeros(P, S, dtype=torch.bool, device=x.device)], dim=1)
        full = torch.cat([top.expand(R, P, P + S), mask], dim=1)  # R, P+S, P+S
        full = full.unsqueeze(1) if B == 1 else full.unsqueeze(1).repeat(B, 1, 1, 1)  # B*R, 1, L, L
        for blk in self.transformer.resblocks:
            x = _block_masked(blk, x, full)
        # LayerNorm is per token: pool first, then normalise
        pooled = self.ln_final(x[:, P:].reshape(B, R * S, W)[:, pool_index])  # B, C, W
        if self.text_projection is not None:
            pooled = self.text_projection(pooled) if isinstance(self.text_projection, nn.Linear) \
                else pooled @ self.text_projection
        return pooled.float()


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    B, L, W = x.shape
    return x.view(B, L, h, W // h).transpose(1, 2)  # B, h, L, W/h


def _block_shared(blk: ResidualAttentionBlock, xp: torch.Tensor, xs: torch.Tensor, mask_p: torch.Tensor,
                  mask_s: torch.Tensor):
    """One pre-LN residual block on a shared prefix [1,P,W] and per-prompt suffixes [C,S,W]."""
    attn = blk.attn
    h = attn.num_heads
    C, S, W = xs.shape
    qp, kp, vp = F.linear(blk.ln_1(xp), attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    qs, ks, vs = F.linear(blk.ln_1(xs), attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    qp, kp, vp = _heads(qp, h), _heads(kp, h), _heads(vp, h)  # 1, h, P, d
    qs, ks, vs = _heads(qs, h), _heads(ks, h), _heads(vs, h)  # C, h, S, d
    ap = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask_p)
    k_all = torch.cat([kp.expand(C, -1, -1, -1), ks], dim=2)  # C, h, P+S, d
    v_all = torch.cat([vp.expand(C, -1, -1, -1), vs], dim=2)
    as_ = F.scaled_dot_product_attention(qs, k_all, v_all, attn_mask=mask_s)
    ap = ap.transpose(1, 2).reshape(1, -1, W)
    as_ = as_.transpose(1, 2).reshape(C, S, W)
    xp = xp + blk.ls_1(attn.out_proj(ap))
    xs = xs + blk.ls_1(attn.out_proj(as_))
    xp = xp + blk.ls_2(blk.mlp(blk.ln_2(xp)))
    xs = xs + blk.ls_2(blk.mlp(blk.ln_2(xs)))
    return xp, xs


def _block_masked(blk: ResidualAttentionBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One pre-LN residual block of a standard open_clip tower on [N, L, W] with a boolean mask [N, 1, L, L]
    (True = may attend), through ``scaled_dot_product_attention``."""
    attn = blk.attn
    N, L, W = x.shape
    q, k, v = F.linear(blk.ln_1(x), attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    h = attn.num_heads
    a = F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h), attn_mask=mask)
    x = x + blk.ls_1(attn.out_proj(a.transpose(1, 2).reshape(N, L, W)))
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


def class_prompts(tower: TextTower, classnames: Sequence[str], ctx_ids: Sequence[int], position: str,
                  backbone_name: str, suffix: str = ".") -> PromptLayout:
    """Each class's prompt ``[start] ctx name suffix [end]`` (``assemble_prompts`` at ``position``) as the
    tower's tokenizer gives it, with the checks every prompt method needs, each a one-line error naming
    the fix: every class name gives tokens, the longest prompt fits the tower's context (two classes may
    give the same prompt: the command reports them once, ``fewclip.data.class_names``)."""
    ends = tower.prompt_ends()
    names = []
    for name in classnames:
        names.append(tower.encode_words(name))
        if not names[-1]:
            raise AdapterError(f"class name {name!r} gives no tokens with the tokenizer of backbone "
                               f"{backbone_name!r} (no word it can encode); rename the class with words, e.g. in "
                               f"the dataset's folder names or split file")
    layout = assemble_prompts(names, ctx_ids, position, start=ends.start, end=ends.end,
                              suffix=tower.encode_words(suffix))
    # Two classes may give the same prompt (CLIP's ImageNet names repeat 'missile'): they run as they are, as
    # the authors' CoOp runs them; the command reports them once, before any run (fewclip.data.class_names).
    longest = max(len(s) for s in layout.tokens)
    if longest > tower.context_length:
        worst = classnames[max(range(len(classnames)), key=lambda i: len(layout.tokens[i]))]
        raise AdapterError(f"the prompt for class {worst!r} has {longest} tokens, more than the text tower's "
                           f"context length {tower.context_length}; use fewer context tokens (adapter.n_ctx) "
                           f"or a shorter class name")
    return layout


def pad_sequences(seqs: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> torch.Tensor:
    out = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"prompt of {len(s)} tokens exceeds the context length {length}")
        out[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out

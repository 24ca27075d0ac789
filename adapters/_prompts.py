"""Prompt assembly for prompt-learning methods, as pure functions of token ids (shared plumbing).

CoOp (and the methods built on its prompts: CoCoOp, KgCoOp, MaPLe) put
learned context vectors around each class name. Which token goes where is a
function of numbers only, written once here and tested with a few numbers::

    end     [start] ctx_1 .. ctx_n  name  suffix [end]
    middle  [start] ctx_1 .. ctx_h  name  ctx_h+1 .. ctx_n  suffix [end]      h = n // 2
    front   [start] name  ctx_1 .. ctx_n  suffix [end]

``start`` and ``end`` are the tokenizer's own special ids (``start=()`` for
tokenizers without a start token, such as SigLIP's Hugging Face tokenizers). The context slots hold ``ctx`` ids: the
words of a word init, or any placeholder id for a random init (the slots'
embeddings are replaced by the learned vectors, but the id must not be one the
pooling looks for, e.g. not the end-of-text id of an ``argmax``-pooled tower).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

POSITIONS = ("end", "middle", "front")


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of each class prompt (no padding) and where its context vectors go."""

    tokens: list[list[int]]  # [C][L_c]
    ctx_positions: list[list[int]]  # [C][n_ctx], in context order


def assemble_prompts(names: Sequence[Sequence[int]], ctx: Sequence[int], position: str, *,
                     start: Sequence[int], end: Sequence[int], suffix: Sequence[int] = ()) -> PromptLayout:
    """Lay out one prompt per class name (module docstring): ``names`` [C][*] token ids of the class names,
    ``ctx`` [n_ctx] the ids in the context slots, ``start``/``end`` the tokenizer's special ids around
    every text, ``suffix`` ids after the name (e.g. the full stop)."""
    if position not in POSITIONS:
        raise ValueError(f"class token position must be one of {POSITIONS}, got {position!r}")
    n = len(ctx)
    head = list(start)
    s = len(head)
    half = n // 2
    tokens, positions = [], []
    for name in names:
        name, m = list(name), len(name)
        if position == "end":
            body = list(ctx) + name
            pos = list(range(s, s + n))
        elif position == "front":
            body = name + list(ctx)
            pos = list(range(s + m, s + m + n))
        else:  # middle
            body = list(ctx[:half]) + name + list(ctx[half:])
            pos = list(range(s, s + half)) + list(range(s + half + m, s + n + m))
        tokens.append(head + body + list(suffix) + list(end))
        positions.append(pos)
    return PromptLayout(tokens, positions)


def shared_prefix_length(n_ctx: int, position: str, *, n_start: int, csc: bool) -> int:
    """How many leading positions hold the same embedding in every class prompt: the start token and,
    with one context shared by all classes, the context before the name (``end``: all of it; ``middle``:
    its first half; ``front``: none)."""
    if csc:
        return n_start
    return n_start + {"end": n_ctx, "middle": n_ctx // 2, "front": 0}[position]


def packed_suffixes(tokens: Sequence[Sequence[int]], prefix: int) -> tuple[torch.Tensor, ...]:
    """Index tensors for running prompts that share their first ``prefix`` positions with their
    suffixes packed end to end (``TextTower.forward_packed``).

    Every prompt's tokens after the prefix, up to its end-of-text token (its last token here), are
    concatenated: T tokens in all. Returns ``cls`` [T] (the prompt of each packed token), ``pos`` [T] (its
    position in its own prompt), ``mask`` [T, prefix + T] (True where a packed token may attend: the
    prefix and the earlier tokens of its own prompt) and ``pool`` [C] (each prompt's last token in the
    packing). Under a causal mask nothing after the end-of-text token reaches the pooled feature, so no
    work is spent on padding.
    """
    cls_idx, pos_idx, pool = [], [], []
    for c, seq in enumerate(tokens):
        for j in range(prefix, len(seq)):
            cls_idx.append(c)
            pos_idx.append(j)
        pool.append(len(cls_idx) - 1)
    cls_t, pos_t = torch.tensor(cls_idx, dtype=torch.long), torch.tensor(pos_idx, dtype=torch.long)
    same = cls_t[:, None] == cls_t[None, :]
    earlier = pos_t[None, :] <= pos_t[:, None]
    mask = torch.cat([torch.ones(len(cls_idx), prefix, dtype=torch.bool), same & earlier], dim=1)  # T, P+T
    return cls_t, pos_t, mask, torch.tensor(pool, dtype=torch.long)


def packed_suffix_rows(tokens: Sequence[Sequence[int]], prefix: int, row_tokens: int) -> tuple[torch.Tensor, ...]:
    """``packed_suffixes`` in rows of about ``row_tokens`` tokens (balanced, at least the longest suffix): every
    prompt's suffix lies whole in one row, rows are filled in class order, the last slots of a row are padding.

    One row holding all C suffixes costs attention quadratic in C (ImageNet's 1000 classes make a row of
    about 5000 tokens); rows of a few hundred tokens keep the attention cost linear in C, with the prefix
    attended by every row. Returns ``cls`` [R, S] (-1 at padding), ``pos`` [R, S] (0 at padding), ``mask``
    [R, S, prefix + S] (a packed token sees the prefix and the earlier tokens of its own prompt; a padding
    slot sees only itself, so that no row of the attention is empty) and ``pool`` [C] (each prompt's last
    token, as an index into the R * S flattened slots). ``TextTower.forward_rows`` runs them.
    """
    lengths = [len(seq) - prefix for seq in tokens]
    if min(lengths) < 1:
        raise ValueError(f"every prompt needs at least one token after the {prefix}-token prefix")
    total, longest = sum(lengths), max(lengths)
    # As many rows as row_tokens asks for, balanced: the shortest row length that fills them greedily
    # (at most total / R + the longest suffix, which always fits in R rows).
    n_rows = max(1, -(-total // max(row_tokens, longest)))
    S = max(-(-total // n_rows), longest)
    while True:
        rows: list[list[int]] = [[]]  # prompt indices per row
        used = 0
        for c, n in enumerate(lengths):
            if used + n > S:
                rows.append([])
                used = 0
            rows[-1].append(c)
            used += n
        if len(rows) <= n_rows:
            break
        S += 1
    R = len(rows)
    cls_t = torch.full((R, S), -1, dtype=torch.long)
    pos_t = torch.zeros(R, S, dtype=torch.long)
    pool = [0] * len(tokens)
    for r, members in enumerate(rows):
        j = 0
        for c in members:
            n = lengths[c]
            cls_t[r, j : j + n] = c
            pos_t[r, j : j + n] = torch.arange(prefix, prefix + n)
            j += n
            pool[c] = r * S + j - 1
    real = cls_t >= 0
    same = (cls_t[:, :, None] == cls_t[:, None, :]) & real[:, :, None]
    earlier = pos_t[:, None, :] <= pos_t[:, :, None]
    own = (same & earlier) | (torch.eye(S, dtype=torch.bool)[None] & ~real[:, :, None])
    mask = torch.cat([real[:, :, None].expand(R, S, prefix), own], dim=2)  # R, S, P+S
    return cls_t, pos_t, mask, torch.tensor(pool, dtype=torch.long)

"""A word-level tokenizer with open_clip's tokenizer interface.

The reference backbones are trained on toy-world captions whose vocabulary is a
few hundred words, so a word-level tokenizer is all they need. It follows the
interface of ``open_clip.tokenizer.SimpleTokenizer`` where fewclip relies on it:
``tok(texts, context_length=None) -> LongTensor[N, L]``, ``sot_token_id``,
``eot_token_id``, ``context_length``, ``encoder`` / ``decoder`` (word <-> id),
``encode(text) -> list[int]`` without the special tokens, and ``decode(ids)``.

Ids: 0 pad, 1 start-of-text, 2 unknown word, then the vocabulary, and the
end-of-text token LAST, so that it is the largest id in every sequence and
open_clip's ``argmax`` text pooling finds it, exactly as with CLIP's BPE.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Sequence, Union

import torch

PAD, SOT, UNK = "<pad>", "<start_of_text>", "<unk>"
EOT = "<end_of_text>"
_WORD = re.compile(r"[a-z0-9]+")


class WordTokenizer:
    def __init__(self, vocab: Sequence[str], context_length: int = 24):
        words = list(dict.fromkeys(w.lower() for w in vocab))
        for w in words:
            if not _WORD.fullmatch(w):
                raise ValueError(f"vocabulary word {w!r} is not a lowercase alphanumeric word")
        self.words = words
        tokens = [PAD, SOT, UNK] + words + [EOT]
        self.encoder: Dict[str, int] = {t: i for i, t in enumerate(tokens)}
        self.decoder: Dict[int, str] = {i: t for t, i in self.encoder.items()}
        self.pad_token_id = 0
        self.sot_token_id = 1
        self.unk_token_id = 2
        self.eot_token_id = len(tokens) - 1
        self.vocab_size = len(tokens)
        self.context_length = context_length

    def encode(self, text: str) -> List[int]:
        return [self.encoder.get(w, self.unk_token_id) for w in _WORD.findall(text.lower())]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (self.pad_token_id, self.sot_token_id):
                continue
            if i == self.eot_token_id:
                break
            out.append(self.decoder.get(i, UNK))
        return " ".join(out)

    def unknown_words(self, text: str) -> List[str]:
        return [w for w in _WORD.findall(text.lower()) if w not in self.encoder]

    def __call__(self, texts: Union[str, Sequence[str]], context_length: int | None = None) -> torch.LongTensor:
        if isinstance(texts, str):
            texts = [texts]
        L = context_length or self.context_length
        result = torch.zeros(len(texts), L, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = [self.sot_token_id] + self.encode(text) + [self.eot_token_id]
            if len(ids) > L:  # truncate, keeping the end-of-text token (as open_clip does)
                ids = ids[:L]
                ids[-1] = self.eot_token_id
            result[i, : len(ids)] = torch.tensor(ids)
        return result

    # -- persistence --------------------------------------------------------
    def to_dict(self) -> dict:
        return {"type": "word", "context_length": self.context_length, "vocab": self.words}

    def save(self, path: Union[str, Path]) -> None:
        from .io import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Union[str, Path]) -> "WordTokenizer":
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("type") != "word" or "vocab" not in d:
            raise ValueError(f"{path} is not a fewclip word-tokenizer file (expected keys 'type': 'word', 'vocab')")
        return cls(d["vocab"], int(d.get("context_length", 24)))

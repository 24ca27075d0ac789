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

A word outside the vocabulary becomes the unknown token, with a warning naming it (once per word and
tokenizer), not an error: the vocabulary is the toy world's caption words, so a dataset of one's own or a
benchmark's templates ("a photo of a {}, a type of pet.") always have some, and an error would make the
reference backbones unusable for a smoke test on real data; but a class name the model cannot read must
never pass unnoticed (its accuracy is chance at best), so the log says which words it did not know.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Union

import torch
from open_clip.tokenizer import HFTokenizer

from fewclip.utils.io import atomic_write_json

PAD, SOT, UNK = "<pad>", "<start_of_text>", "<unk>"
EOT = "<end_of_text>"
_WORD = re.compile(r"[a-z0-9]+")
log = logging.getLogger(__name__)


class WordTokenizer:
    def __init__(self, vocab: Sequence[str], context_length: int = 24):
        words = list(dict.fromkeys(w.lower() for w in vocab))
        for w in words:
            if not _WORD.fullmatch(w):
                raise ValueError(f"vocabulary word {w!r} is not a lowercase alphanumeric word")
        self.words = words
        tokens = [PAD, SOT, UNK] + words + [EOT]
        self.encoder: dict[str, int] = {t: i for i, t in enumerate(tokens)}
        self.decoder: dict[int, str] = {i: t for t, i in self.encoder.items()}
        self.pad_token_id = 0
        self.sot_token_id = 1
        self.unk_token_id = 2
        self.eot_token_id = len(tokens) - 1
        self.vocab_size = len(tokens)
        self.context_length = context_length
        self._warned: set = set()  # unknown words already named in the log

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``'s words (no special tokens); an unknown word is the unknown token, and the first
        time a word is met that way the log names it (module docstring)."""
        words = _WORD.findall(text.lower())
        new = [w for w in dict.fromkeys(words) if w not in self.encoder and w not in self._warned]
        if new:
            self._warned.update(new)
            log.warning("word-level tokenizer (%d words): %s not in its vocabulary, read as %s (in %r); results on "
                        "text that needs them are not meaningful", len(self.words), ", ".join(map(repr, new)),
                        UNK, text)
        return [self.encoder.get(w, self.unk_token_id) for w in words]

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

    def unknown_words(self, text: str) -> list[str]:
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

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Union[str, Path]) -> WordTokenizer:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("type") != "word" or "vocab" not in d:
            raise ValueError(f"{path} is not a fewclip word-tokenizer file (expected keys 'type': 'word', 'vocab')")
        return cls(d["vocab"], int(d.get("context_length", 24)))


# ---------------------------------------------------------------------------
# Hugging Face tokenizers (SigLIP and other open_clip models that name one)
# ---------------------------------------------------------------------------


class HFTextTokenizer:
    """open_clip's ``HFTokenizer`` with the interface prompt learning needs.

    ``__call__`` is open_clip's (its text cleaning, padding to the context length, truncation).
    ``encode`` gives the ids of a text without special tokens, after the same cleaning;
    ``start_ids`` / ``end_ids`` are the special tokens the tokenizer puts around every text (an
    empty ``start_ids`` for tokenizers without a start token, such as SigLIP's);
    ``pad_token_id`` is what it pads with. ``sot_token_id`` / ``eot_token_id`` are the single
    start / end ids where there is exactly one, else ``None``.
    """

    def __init__(self, oc_tokenizer, name: str):
        self.oc = oc_tokenizer
        self.hf = oc_tokenizer.tokenizer
        self.name = name
        self.context_length = oc_tokenizer.context_length
        if getattr(oc_tokenizer, "tokenizer_mode", "") == "clips":
            raise ValueError(f"tokenizer {name}: open_clip's 'clips' tokenizer mode is not supported")
        probe = self.oc.clean_fn("a photo")
        bare = list(self.hf(probe, add_special_tokens=False)["input_ids"])
        full = list(self.hf(probe, add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if not bare or at is None:
            raise ValueError(f"tokenizer {name}: cannot tell its special tokens from the words "
                             f"({full} with them, {bare} without)")
        sep = self.hf.sep_token_id if getattr(oc_tokenizer, "strip_sep_token", False) else None
        def swap(i):
            return (0 if sep is not None and i == sep else i)  # open_clip turns stripped sep tokens into 0
        self.start_ids = [swap(i) for i in full[:at]]
        self.end_ids = [swap(i) for i in full[at + len(bare):]]
        self.pad_token_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else 0
        self.sot_token_id = self.start_ids[0] if len(self.start_ids) == 1 else None
        self.eot_token_id = self.end_ids[0] if len(self.end_ids) == 1 else None
        self.vocab_size = len(self.hf)

    def __call__(self, texts: Union[str, Sequence[str]], context_length: int | None = None) -> torch.LongTensor:
        return self.oc(texts, context_length=context_length)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(self.oc.clean_fn(text), add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)


class TokenizerNotFound(ValueError):
    """A Hugging Face tokenizer that is neither in the given folder nor in the local cache, or that cannot be read
    there (a missing optional dependency); the message says what to do."""


SENTENCEPIECE_HINT = "pip install sentencepiece  (or: pip install 'fewclip[sentencepiece]')"


def _has_sentencepiece() -> bool:
    return importlib.util.find_spec("sentencepiece") is not None


def tokenizer_files_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot give a Hugging Face tokenizer, from the files it holds ("" when it can, as far as the
    files tell): no tokenizer files at all, or only a SentencePiece model without the ``sentencepiece`` package."""
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if "tokenizer.json" in names:  # a fast tokenizer: everything is in it
        return ""
    spm = sorted(n for n in names if n.endswith(".model"))
    if spm:
        if not _has_sentencepiece():
            return (f"{folder} holds a SentencePiece model ({spm[0]}) and no tokenizer.json; reading it needs the "
                    f"sentencepiece package: {SENTENCEPIECE_HINT}")
        if "tokenizer_config.json" not in names:
            return (f"{folder} holds a SentencePiece model ({spm[0]}) but no tokenizer_config.json naming its "
                    f"tokenizer class (save_pretrained writes both)")
        return ""
    if {"vocab.json", "merges.txt"} <= names or "vocab.txt" in names:
        return ""
    return (f"{folder} holds no tokenizer files (tokenizer.json, a SentencePiece *.model, vocab.json + merges.txt, "
            f"or vocab.txt); it has {sorted(names)[:8] or 'nothing'}")


def _open_clip_hf(path: Path, context_length: int, tokenizer_mode, kwargs):
    """open_clip's HFTokenizer on a local folder; transformers' Python warnings are dropped (fewclip reports)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HFTokenizer(str(path), context_length=context_length, tokenizer_mode=tokenizer_mode, **kwargs)


def load_hf_tokenizer(hub_id: str, folder: Union[str, Path, None], context_length: int,
                      tokenizer_kwargs: dict | None = None, tokenizer_mode: str | None = None) -> HFTextTokenizer:
    """The Hugging Face tokenizer ``hub_id`` from ``folder``, or else from the local Hugging Face cache.

    Never goes online: a tokenizer that is not on this machine is a ``TokenizerNotFound``
    naming ``hub_id`` and how to save it to a folder, raised at once (no download retries).
    Either place is first checked for the files the tokenizer needs: a SentencePiece model
    without the ``sentencepiece`` package is an error naming the pip command, wherever it lies.
    """

    kwargs = dict(tokenizer_kwargs or {})
    if folder is not None:
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerNotFound(f"tokenizer folder {folder} does not exist (it should hold the files that "
                                    f"AutoTokenizer.from_pretrained('{hub_id}').save_pretrained(FOLDER) writes)")
        problem = tokenizer_files_problem(folder)
        if problem:
            raise TokenizerNotFound(f"cannot load the Hugging Face tokenizer {hub_id}: {problem}")
        try:
            oc = _open_clip_hf(folder, context_length, tokenizer_mode, kwargs)
        except Exception as e:  # transformers' AutoTokenizer raises OSError, ValueError, KeyError... for a bad folder
            raise TokenizerNotFound(f"cannot load a Hugging Face tokenizer from {folder}: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from None
        return HFTextTokenizer(oc, hub_id)
    cached = _cached_snapshot(hub_id)
    cache_note = ""
    if cached is not None:
        problem = tokenizer_files_problem(Path(cached))
        if problem and "sentencepiece" in problem:  # the files are here: say what is missing to read them
            raise TokenizerNotFound(f"the Hugging Face tokenizer {hub_id} is in the local cache, but {problem}")
        if not problem:
            try:
                oc = _open_clip_hf(Path(cached), context_length, tokenizer_mode, kwargs)
            except Exception as e:  # transformers' errors for a damaged cache entry (any type): named, with the fix
                raise TokenizerNotFound(
                    f"the Hugging Face tokenizer {hub_id} is in the local cache ({cached}) but cannot be loaded: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
            return HFTextTokenizer(oc, hub_id)
        cache_note = f" (the local cache holds {hub_id}, but not its tokenizer files)"
    raise TokenizerNotFound(
        f"this model uses the Hugging Face tokenizer '{hub_id}', which is not on this machine{cache_note} (fewclip "
        f"looks in the local Hugging Face cache only and never downloads). Save it once where there is network: "
        f"python -c \"from transformers import AutoTokenizer; "
        f"AutoTokenizer.from_pretrained('{hub_id}').save_pretrained('tokenizer-dir')\", "
        f"copy tokenizer-dir here and pass backbone.tokenizer=tokenizer-dir")


def _cached_snapshot(hub_id: str) -> str | None:
    """The local Hugging Face cache folder of ``hub_id``, looked up offline; ``None`` when absent."""
    try:
        from huggingface_hub import snapshot_download  # only for a tokenizer in the Hugging Face cache

        return snapshot_download(hub_id, local_files_only=True)
    except Exception:  # huggingface_hub absent (ImportError) or not cached (LocalEntryNotFoundError...): none
        return None

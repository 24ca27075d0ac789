"""Close matches for a mistyped backbone name, without loading any model (the command line answers a typo before
torch is imported, ``fewclip.cli.early_check``; ``load_backbone`` gives the same hint)."""
from __future__ import annotations

import difflib
from collections.abc import Sequence


def backbone_hint(name: str, cards: Sequence[str], archs: Sequence[str]) -> str:
    """"did you mean ...? " for a backbone name that is none of ``cards`` and ``archs``, or ""."""
    known = list(cards) + list(archs)
    spelled = name.replace("/", "-")  # OpenAI's ViT-B/32 is open_clip's ViT-B-32
    if spelled != name and spelled in known:
        return f"did you mean {spelled!r} (open_clip's spelling of OpenAI's {name})? "
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(spelled.lower(), list(by_lower), n=3, cutoff=0.75)
    return f"did you mean {' or '.join(repr(by_lower[c]) for c in close)}? " if close else ""

"""fewclip: few-shot adaptation of frozen CLIP-family models of any embedding geometry."""
__version__ = "0.1.0"

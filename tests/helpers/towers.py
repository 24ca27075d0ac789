"""Shared by several test files (from tests/parity/test_dept_mmrl_coprompt_parity.py)."""
import open_clip
import pytest
from open_clip.model import build_model_from_openai_state_dict

from fewclip.backbones.backbone import OPENAI_EXTRA_KEYS, Backbone
from fewclip.backbones.geometry import make_geometry
from fewclip.training.engine import TrainConfig, cosine_lr, make_optimizer
from helpers.tiny_clip import state_sha256, tiny_openai_state_dict


@pytest.fixture(scope="module")
def tiny():
    """The tiny OpenAI-layout CLIP as a fewclip backbone in exact float32 (as tests/parity/test_deep_parity.py)."""
    sd = tiny_openai_state_dict(0)
    model = build_model_from_openai_state_dict(dict(sd)).float().eval()
    model.load_state_dict({k: v for k, v in sd.items() if k not in OPENAI_EXTRA_KEYS})
    scale = float(model.logit_scale.detach().exp())
    bb = Backbone(model, open_clip.get_tokenizer("ViT-B-32"), make_geometry("clip", logit_scale=scale),
                  name="tiny-openai", image_size=32, mean=(0, 0, 0), std=(1, 1, 1))
    return bb, state_sha256(sd)

def one_step(adapter, features, labels, lr, optimizer="sgd", **extra):
    """One step as fewclip's engine takes it at the base learning rate (no warm-up): its optimiser over the
    adapter's parameter groups, each at lr x its lr_scale."""
    opt = make_optimizer(adapter.param_groups() or adapter.trainable_parameters(), TrainConfig(lr=lr, optimizer=optimizer))
    for g in opt.param_groups:
        g["lr"] = cosine_lr(0, 10, 0, lr * g.get("lr_scale", 1.0), 1e-5)
    terms = adapter.training_loss(features, labels, **extra)
    opt.zero_grad()
    adapter.backward(terms)
    grads = {n: p.grad.clone() for n, p in adapter.named_parameters() if p.requires_grad}
    opt.step()
    return terms, grads

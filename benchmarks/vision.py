"""Vision models (torchvision, Hugging Face, timm) built from their constructors or configs, cut at their stages,
trained as the unsplit model.

    .venv/bin/python benchmarks/vision.py                    # every model below
    .venv/bin/python benchmarks/vision.py swin_t hf_beit     # some of them
    .venv/bin/python benchmarks/vision.py --microbatches 1   # one micro-batch: the gradients summed as unsplit

For each model: 8 images of 32 x 32, 10 classes (a segmentation head: a class per pixel), cross-entropy on the
logits, ``SplitAt`` at two of its blocks on 4 processes (the master and three owners), ``schedule="gpipe"`` at
M = 4 (BatchNorm keeps whole batches: such a model runs each batch as one micro-batch), one step of SGD with
momentum, a re-cut at another block, two more steps, then eval-mode predictions; losses, every parameter and
the predictions against the unsplit model trained on the same batches in this process. Stochastic depth and
dropout are off (a layer draws from its own process's generator). The tolerance is float32's over three steps
of gradients summed micro-batch by micro-batch, in another order than the whole batch's: 2e-5 (torchvision's
Swin moves a logit by 1.4e-5 of 1.6 at M = 4, by nothing at M = 1). AdamW, whose first steps divide each
gradient by its own size, moves an element whose gradient is near zero by up to a rounding's share of the
learning rate: a 4e-5 difference there, in Swin, says nothing of the split.
This file is also the job each launch loads (``VISION`` in the environment says which).
"""
from __future__ import annotations

import os

import click
import torch
import torch.nn.functional as F
from torch import nn

import rpcmp
import unsplit


def _torchvision(name: str, **kwargs):
    def make():
        import torchvision
        model = getattr(torchvision.models, name)(num_classes=10, **kwargs)
        for module in model.modules():  # stochastic depth off (swin_t takes no argument for it)
            if type(module).__name__ == "StochasticDepth":
                module.p = 0.0
        return model
    return make


def _hugging_face(config: str, model: str, **kwargs):
    def make():
        import transformers as T
        return getattr(T, model)(getattr(T, config)(**kwargs))
    return make


def _timm(name: str, **kwargs):
    def make():
        import timm
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    return make


_VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10)
_STAGES = dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10)


def _at(prefix: str, a: int = 1, b: int = 3, recut: int = 2) -> tuple:
    """Cuts before blocks ``a`` and ``b`` of ``prefix``, the re-cut's before ``recut`` and ``b``."""
    return (f"{prefix}{a}", f"{prefix}{b}"), (f"{prefix}{recut}", f"{prefix}{b}")


MODELS = {  # name: (factory, (the cuts, the re-cut's))
    "resnet18": (_torchvision("resnet18"), (("layer2", "layer4"), ("layer3", "layer4"))),
    "densenet121": (_torchvision("densenet121"), _at("features.denseblock", 2, 4, 3)),
    "mobilenet_v3_small": (_torchvision("mobilenet_v3_small"), _at("features.", 4, 9, 5)),
    "efficientnet_b0": (_torchvision("efficientnet_b0"), _at("features.", 3, 6, 4)),
    "convnext_tiny": (_torchvision("convnext_tiny"), _at("features.", 3, 5, 4)),
    "swin_t": (_torchvision("swin_t"), _at("features.", 3, 5, 4)),  # its attention mask: filled with Python numbers
    "vit": (lambda: __import__("torchvision").models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10),
        _at("encoder.layers.encoder_layer_")),
    "hf_vit": (_hugging_face("ViTConfig", "ViTForImageClassification", **_VIT, intermediate_size=64), _at("m.vit.layers.")),
    "hf_beit": (_hugging_face("BeitConfig", "BeitForImageClassification", **_VIT, intermediate_size=64,  # its relative
                              use_relative_position_bias=True, drop_path_rate=0.0),  # position index: Python numbers
                _at("m.beit.layers.")),
    "hf_dinov2": (_hugging_face("Dinov2Config", "Dinov2ForImageClassification", **_VIT), _at("m.dinov2.encoder.layer.")),
    "hf_convnext": (_hugging_face("ConvNextConfig", "ConvNextForImageClassification", **_STAGES),
                    _at("m.convnext.encoder.stages.")),
    "hf_resnet": (_hugging_face("ResNetConfig", "ResNetForImageClassification", embedding_size=8, **_STAGES),
                  _at("m.resnet.encoder.stages.")),
    "hf_swin": (_hugging_face("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=2, embed_dim=16,
                              depths=[1, 1, 2, 1], num_heads=[1, 2, 2, 4], window_size=2, num_labels=10,
                              drop_path_rate=0.0), _at("m.swin.encoder.layers.")),
    "hf_deit": (_hugging_face("DeiTConfig", "DeiTForImageClassification", **_VIT, intermediate_size=64),
                _at("m.deit.layers.")),
    "hf_data2vec": (_hugging_face("Data2VecVisionConfig", "Data2VecVisionForImageClassification", **_VIT,
                                  intermediate_size=64, use_relative_position_bias=True, drop_path_rate=0.0),
                    _at("m.data2vec_vision.encoder.layer.")),
    "hf_mobilevit": (_hugging_face("MobileViTConfig", "MobileViTForImageClassification", image_size=32, patch_size=2,
                                   hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                                   num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   classifier_dropout_prob=0.0, num_labels=10), _at("m.mobilevit.encoder.layer.", 1, 4)),
    "hf_poolformer": (_hugging_face("PoolFormerConfig", "PoolFormerForImageClassification", drop_path_rate=0.0,
                                    **_STAGES), (("m.poolformer.encoder.block.1.0", "m.poolformer.encoder.block.3.0"),
                                                 ("m.poolformer.encoder.block.2.0", "m.poolformer.encoder.block.3.0"))),
    "hf_segformer": (_hugging_face("SegformerConfig", "SegformerForSemanticSegmentation", num_encoder_blocks=4,
                                   num_attention_heads=[1, 1, 2, 2], decoder_hidden_size=32, drop_path_rate=0.0,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   classifier_dropout_prob=0.0, **_STAGES),
                     (("m.segformer.stages.1", "m.decode_head"), ("m.segformer.stages.2", "m.decode_head"))),
    "timm_vit": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=32, num_heads=4),
                 _at("blocks.")),
    "timm_deit": (_timm("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=32, num_heads=4),
                  _at("blocks.")),
    "timm_swin": (_timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16,
                        depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), drop_path_rate=0.0), _at("layers.")),
    "timm_convnext": (_timm("convnext_atto"), _at("stages.")),
    "timm_efficientnet": (_timm("efficientnet_b0"), _at("blocks.", 2, 5, 3)),
    "timm_regnet": (_timm("regnetx_002"), (("s2", "s4"), ("s3", "s4"))),
}
NAME = os.environ.get("VISION", "resnet18")
MICROBATCHES = int(os.environ.get("VISION_MICROBATCHES", "4"))
(_CUT, _RECUT) = MODELS[NAME][1]


class Model(nn.Module):
    """A Hugging Face model as its users call it: ``self.m(pixel_values=x)``."""

    def __init__(self):
        super().__init__()
        self.m = MODELS[NAME][0]()

    def forward(self, x):
        return self.m(pixel_values=x)


def make() -> nn.Module:
    return Model() if NAME.startswith("hf_") else MODELS[NAME][0]()


def batches(steps: int = 3, size: int = 8) -> list:
    g = torch.Generator().manual_seed(0)
    labels = (size, 32, 32) if "segformer" in NAME else (size,)
    return [(torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, labels, generator=g)) for _ in range(steps)]


def logits(out):
    return getattr(out, "logits", out)


def loss(out, y):
    z = logits(out)
    if z.dim() == 4:  # a class per pixel, at a quarter of the image's side
        z = F.interpolate(z, size=y.shape[-2:], mode="bilinear", align_corners=False)
    return F.cross_entropy(z, y)


job = rpcmp.Job(model=make, stages=rpcmp.SplitAt(*_CUT), batch_size=8, microbatches=MICROBATCHES, schedule="gpipe",
                loss=loss, optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), threads=1)


def _split_run(job, world):
    return unsplit.split_run(job, world, batches(), _RECUT, logits)


def _unsplit_run():
    return unsplit.train(job, make, lambda m: torch.optim.SGD(m.parameters(), **job.optimizer[1]), batches(), loss,
                         logits)


@click.command()
@click.argument("names", nargs=-1)
@click.option("--microbatches", type=int, default=4, show_default=True)
@click.option("--one", is_flag=True, hidden=True, help="this process runs VISION's comparison")
def main(names, microbatches, one):
    """Check each model in NAMES (every one by default) against the unsplit model, each in a fresh interpreter."""
    if one:
        print("RESULT " + unsplit.compare(__file__, _split_run, _unsplit_run, rtol=2e-5, atol=2e-5), flush=True)
        return
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise click.BadParameter(f"unknown models {unknown}; known: {', '.join(MODELS)}", param_hint="NAMES")
    unsplit.each(__file__, names or list(MODELS), lambda name: {"VISION": name,
                                                                "VISION_MICROBATCHES": str(microbatches)})

if __name__ == "__main__":
    main()

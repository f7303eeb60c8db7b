"""relayinfer.cloud.patho: pathology split screening, cloud side (torch).

``vit.py`` ViT-L/16 tile encoder (timm-compatible state dicts), ``encoder.py`` the encoder
interface, ``mil.py`` attention-based MIL (ABMIL), ``effnet.py`` the device's EfficientNet-Lite0
coarse-screen model and its ONNX export, ``service.py`` the websocket slide service.
"""

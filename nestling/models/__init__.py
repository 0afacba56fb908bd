"""Model zoo with step sizes and exits; `build(spec)` makes any nested submodel."""

from nestling.models.config import ModelConfig
from nestling.models.layers import kept_channels, set_active_width
from nestling.models.net import BlockInfo, ScalableNet
from nestling.models.zoo import CONV_FAMILIES, block_infos, build, known_models

__all__ = [
    "BlockInfo", "CONV_FAMILIES", "ModelConfig", "ScalableNet", "block_infos", "build",
    "kept_channels", "known_models", "set_active_width",
]

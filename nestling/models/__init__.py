"""Model zoo with step sizes and exits; `build(spec)` makes any nested submodel of any registered family."""

from nestling.models.config import ModelConfig
from nestling.models.family import ModelFamily, family_of, register_family, registered_families
from nestling.models.layers import kept_channels, set_active_width
from nestling.models.net import BlockInfo, ScalableNet
from nestling.models.zoo import block_infos, build, class_logit_keys, known_models

__all__ = [
    "BlockInfo",
    "ModelConfig",
    "ModelFamily",
    "ScalableNet",
    "block_infos",
    "build",
    "class_logit_keys",
    "family_of",
    "kept_channels",
    "known_models",
    "register_family",
    "registered_families",
    "set_active_width",
]

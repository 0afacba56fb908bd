"""The tiny CNN: two one-block stages, for tests and quick demos."""

from nestling.models.family import register_family
from nestling.models.resnet_family import ResNetFamily


@register_family
def tinycnn() -> ResNetFamily:
    return ResNetFamily("tinycnn", 8, (8, 16), (1, 1), preact=False, paper="(test model)")

"""CIFAR ResNets (He et al. 2016: three stages of 16/32/64 channels), FeDepth's PreResNet-20 and the CIFAR
ResNet-18 (no max-pool) FjORD and DepthFL train.

NeFL's published submodels (METHODS §2.a.8) for ResNet-56/110 keep the first n blocks of every stage.
"""

from nestling.models.family import first_n_per_stage, register_family
from nestling.models.resnet_family import ResNetFamily

_WIDTHS = (16, 32, 64)


def _first_n(depths: tuple[int, ...], per_stage: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    return tuple(first_n_per_stage(depths, n) for n in per_stage)


def _wd(
    depths: tuple[int, ...], gammas: tuple[float, ...], per_stage: tuple[int, ...]
) -> tuple[tuple[float, tuple[int, ...] | None], ...]:
    return tuple(
        (g, first_n_per_stage(depths, (n,) * len(depths)) if n < max(depths) else None)
        for g, n in zip(gammas, per_stage)
    )


@register_family
def resnet20() -> ResNetFamily:
    return ResNetFamily("resnet20", 16, _WIDTHS, (3, 3, 3), preact=False, paper="He et al. 2016")


@register_family
def resnet56() -> ResNetFamily:
    depths = (9, 9, 9)
    return ResNetFamily(
        "resnet56",
        16,
        _WIDTHS,
        depths,
        preact=False,
        paper="NeFL ResNet_c_WD",
        nefl_depth_masks=_first_n(depths, [(2, 2, 2), (3, 3, 4), (4, 4, 6), (9, 8, 7)]),
        nefl_wd=_wd(depths, (0.464938, 0.607812, 0.777136, 0.902901, 1.0), (4, 6, 7, 8, 9)),
    )


@register_family
def resnet110() -> ResNetFamily:
    depths = (18, 18, 18)
    return ResNetFamily(
        "resnet110",
        16,
        _WIDTHS,
        depths,
        preact=False,
        paper="NeFL / ScaleFL",
        nefl_depth_masks=_first_n(depths, [(16, 4, 3), (14, 7, 7), (17, 13, 10), (16, 16, 14)]),
        nefl_wd=_wd(depths, (0.457253, 0.603831, 0.774235, 0.901430, 1.0), (8, 12, 14, 16, 18)),
    )


@register_family
def preresnet20() -> ResNetFamily:
    return ResNetFamily("preresnet20", 16, _WIDTHS, (3, 3, 3), preact=True, paper="FeDepth PreResNet-20")


@register_family
def resnet18_cifar() -> ResNetFamily:
    """kuangliu's CIFAR ResNet-18, FjORD's and DepthFL's model (METHODS §1.5): NeFL's ResNet-18 widths and
    option-B shortcuts, but a 3×3 stride-1 stem with no max-pool, so the 32×32 image reaches layer 1 whole."""
    return ResNetFamily(
        "resnet18-cifar",
        64,
        (64, 128, 256, 512),
        (2, 2, 2, 2),
        preact=False,
        paper="FjORD / DepthFL CIFAR ResNet-18",
    )

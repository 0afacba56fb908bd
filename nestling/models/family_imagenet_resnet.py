"""ResNet-18/34 as NeFL trains them (ResNet_WD): 64-channel stem with a 3×3 max-pool, four stages.

The NeFL-D and NeFL-WD kept-block masks are the paper's (METHODS §2.a.8), one 0/1 list per stage.
"""

from nestling.models.family import kept_from_stage_masks, register_family
from nestling.models.resnet_family import ResNetFamily

_WIDTHS = (64, 128, 256, 512)


def _masks(masks: list[list[list[int]]]) -> tuple[tuple[int, ...], ...]:
    return tuple(kept_from_stage_masks(m) for m in masks)


def _wd(
    gammas: tuple[float, ...], masks: list[list[list[int]]]
) -> tuple[tuple[float, tuple[int, ...] | None], ...]:
    kept: list[tuple[int, ...] | None] = [*_masks(masks)]
    kept += [None] * (len(gammas) - len(kept))
    return tuple(zip(gammas, kept))


@register_family
def resnet18() -> ResNetFamily:
    return ResNetFamily(
        "resnet18",
        64,
        _WIDTHS,
        (2, 2, 2, 2),
        preact=False,
        max_pool=True,
        paper="NeFL ResNet_WD",
        nefl_depth_masks=_masks(
            [
                [[1, 1], [0, 0], [1, 1], [0, 0]],
                [[1, 1], [1, 1], [0, 0], [1, 0]],
                [[1, 1], [1, 1], [1, 1], [1, 0]],
                [[1, 0], [1, 1], [0, 0], [1, 1]],
            ]
        ),
        nefl_wd=_wd((0.34, 0.4, 0.6, 0.8, 1.0), [[[1, 1], [1, 1], [1, 1], [1, 0]]]),
    )


@register_family
def resnet34() -> ResNetFamily:
    return ResNetFamily(
        "resnet34",
        64,
        _WIDTHS,
        (3, 4, 6, 3),
        preact=False,
        max_pool=True,
        paper="NeFL ResNet_WD",
        nefl_depth_masks=_masks(
            [
                [[1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 0]],
                [[1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0, 0, 1], [1, 0, 0]],
                [[1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0, 0, 1], [1, 0, 1]],
                [[1, 1, 1], [1, 0, 0, 1], [1, 1, 0, 0, 0, 1], [1, 1, 1]],
            ]
        ),
        nefl_wd=_wd(
            (0.378296, 0.625390, 0.770943, 0.899801, 1.0),
            [
                [[1, 1, 1], [1, 0, 0, 1], [1, 0, 0, 0, 0, 1], [1, 0, 1]],
                [[1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0, 0, 1], [1, 0, 1]],
                [[1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1, 0, 1], [1, 0, 1]],
                [[1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0, 0, 1], [1, 1, 1]],
            ],
        ),
    )

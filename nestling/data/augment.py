"""Batch-wise training augmentation on normalised tensors: the standard CIFAR crop + flip as one gather."""

from __future__ import annotations

import torch

from nestling.errors import ConfigError

CIFAR_PAD = 4  # pixels of padding before the random crop (the usual CIFAR recipe: pad 4, crop back, flip)
AUGMENT_KINDS = ("cifar", "none")


def augment_batch(
    x: torch.Tensor,
    kind: str,
    generator: torch.Generator,
    *,
    fill: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """Augment a batch (N,C,H,W) with per-image randomness drawn from `generator`; "none" returns `x`.

    "cifar": pad by 4 pixels, crop a random HxW window, flip horizontally with probability 1/2. The
    padding value is `fill` in normalised units: 0 (the dataset mean colour) by default; pass
    `-mean/std` per channel to reproduce torchvision's black padding exactly. The whole batch is one
    index gather, not a loop over images.
    """
    if kind == "none":
        return x
    if kind != "cifar":
        raise ConfigError(f"[data] unknown augmentation {kind!r} (known: {', '.join(AUGMENT_KINDS)})")
    if x.dim() != 4:
        raise ConfigError(f"[data] augment_batch needs a (N,C,H,W) batch, got shape {tuple(x.shape)}")
    n, c, h, w = x.shape
    pad = CIFAR_PAD
    fill_t = torch.as_tensor(fill, dtype=x.dtype, device=x.device).reshape(-1)
    if fill_t.numel() not in (1, c):
        raise ConfigError(
            f"[data] augmentation fill must be one value or one per channel ({c}), got {fill_t.numel()}"
        )
    padded = fill_t.reshape(1, -1, 1, 1).expand(n, c, h + 2 * pad, w + 2 * pad).clone()
    padded[:, :, pad : pad + h, pad : pad + w] = x

    rand_device = generator.device
    top = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=rand_device).to(x.device)
    left = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=rand_device).to(x.device)
    flip = torch.rand((n,), generator=generator, device=rand_device).to(x.device) < 0.5

    rows = top[:, None] + torch.arange(h, device=x.device)[None, :]  # (N, H)
    col_offsets = torch.arange(w, device=x.device)
    col_offsets = torch.where(flip[:, None], (w - 1) - col_offsets[None, :], col_offsets[None, :])
    cols = left[:, None] + col_offsets  # (N, W): the flip is folded into the column order
    batch_idx = torch.arange(n, device=x.device)[:, None, None, None]
    chan_idx = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch_idx, chan_idx, rows[:, None, :, None], cols[:, None, None, :]]

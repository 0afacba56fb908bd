"""The symbolic walk of each zoo module: residual blocks, exit heads and final heads (see profiler/walk.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nestling.models.net import BlockInfo

if TYPE_CHECKING:
    from nestling.profiler.walk import Sym, Walk


def conv_block(w: Walk, x: Sym, info: BlockInfo, *, skipped: bool, preact: bool, hidden: float | None) -> Sym:
    """BasicBlock / PreActBlock (nestling/models/blocks.py), skipped blocks running only their shortcut."""
    c_h, c_out = w.ch(info.global_out, hidden), w.ch(info.global_out)
    projection = info.stride != 1 or info.global_in != info.global_out
    if preact:
        if skipped and not projection:
            return x
        h = w.relu(w.bn(x, info.global_in))
        skip = w.conv(w.scaler(h), c_out, 1, info.stride) if projection else x
        if skipped:
            return skip
        out = w.conv(w.scaler(h), c_h, 3, info.stride)
        out = w.conv(w.relu(w.bn(w.scaler(out), info.global_out, hidden)), c_out, 3)
        return w.fresh(w.step(out))
    skip = w.bn(w.scaler(w.conv(x, c_out, 1, info.stride)), info.global_out) if projection else x
    if skipped:
        return w.relu(skip)
    out = w.relu(w.bn(w.scaler(w.conv(x, c_h, 3, info.stride)), info.global_out, hidden))
    out = w.bn(w.scaler(w.conv(out, c_out, 3)), info.global_out)
    return w.relu(w.fresh(w.step(out)))


def pool_head(w: Walk, x: Sym, global_channels: int, *, with_norm: bool, relu: bool = True) -> Sym:
    """[BN [→ ReLU]] → global average pool → linear over every class (PoolClassifier)."""
    if with_norm:
        x = w.bn(x, global_channels)
        if relu:
            x = w.relu(x)
    return w.linear(w.pool(x), w.model.num_classes)


def _sep_conv(w: Walk, x: Sym, global_in: int, global_out: int, stride: int) -> Sym:
    c_in, c_out = w.ch(global_in), w.ch(global_out)
    x = w.conv(x, c_in, 3, stride, groups=c_in)
    x = w.relu(w.bn(w.conv(x, c_in, 1), global_in))
    x = w.conv(x, c_in, 3, groups=c_in)
    return w.relu(w.bn(w.conv(x, c_out, 1), global_out))


def conv_exit(w: Walk, x: Sym, global_channels: int, final_channels: int) -> Sym:
    """The exit head of the model's exit_kind after a block emitting `global_channels` (heads.make_exit)."""
    kind = w.model.exit_kind
    if kind == "scalefl":
        for _ in range(3):
            x = w.relu(w.bn(w.scaler(w.conv(x, w.ch(global_channels), 3)), global_channels))
        return w.linear(w.pool(x), w.model.num_classes)
    if kind == "depthfl":
        gate = _sep_conv(w, x, global_channels, global_channels, 2)
        c, h, wd = gate.shape
        gate = w.relu(w.new((c, 2 * h, 2 * wd)))  # sigmoid keeps its output like a ReLU
        w.save(x)
        feature = w.new(x.shape)
        channels = global_channels
        while channels < final_channels:
            feature = _sep_conv(w, feature, channels, channels * 2, 2)
            channels *= 2
        return w.linear(w.pool(feature), w.model.num_classes)
    return pool_head(w, x, global_channels, with_norm=True, relu=kind != "fedepth")


def encoder_block(w: Walk, x: Sym, cfg: dict[str, Any], *, hidden: float | None) -> Sym:
    """Pre-norm ViT block with step sizes; attention keeps q, k, v, its output and log-sum-exp (CPU kernel)."""
    tokens, _ = x.shape
    ratio = w.spec.width if hidden is None else hidden
    heads = w.ch(cfg["heads"], ratio)
    inner = heads * (cfg["dim"] // cfg["heads"])
    mlp = w.ch(cfg["mlp_dim"], ratio)
    dim = x.shape[1]
    h = w.layer_norm(x)
    q, k, v = (w.linear(h, inner) for _ in range(3))
    attended = w.new((tokens, inner))
    w.save(q, k, v, attended, w.new((heads, tokens)))
    w.cur.macs += 2 * tokens * tokens * inner
    x = w.fresh(w.step(w.linear(attended, dim)))
    hidden_units = w.linear(w.layer_norm(x), mlp)
    w.save(hidden_units)  # GELU keeps its input; fc2 then keeps GELU's output
    return w.fresh(w.step(w.linear(w.fresh(hidden_units), dim)))


def token_head(w: Walk, x: Sym) -> Sym:
    """LayerNorm → class token → linear; the linear keeps a view of the whole normalised sequence."""
    normed = w.layer_norm(x)
    return w.linear(w.new((x.shape[1],)), w.model.num_classes, saved=normed)

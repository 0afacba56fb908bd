"""Which convs of a model may grow into DBBs, expanding them in place, and fusing every DBB back (METHODS §5.a).

A conv is a *site* when it can be expanded and later fused back into exactly the plain architecture:
a square K×K kernel with K > 1, no dilation, zero padding, and a place for the fused bias, which the
plain conv may not have. That place is the conv's own bias, or the BatchNorm that is the sole consumer
of the conv's output: running statistics absorb the bias exactly (μ ← μ − b, METHODS §5.a.6 DECISION,
AMBIG-16), and a BN that always normalises with batch statistics removes a constant shift by itself.
The sole-consumer test reads the autograd graph of one training-mode forward pass, so it holds for any
model family without knowing its forward code (a scaler that is not the identity, a residual sum or a
ReLU between the conv and the BN makes the conv ineligible).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nestling.methods.dynamicfl.dbb import ConvGeometry, DiverseBranchBlock
from nestling.methods.dynamicfl.expansion import RECALIBRATION_ITERATIONS, absorb, expand_conv, recalibrate

SINK_KINDS = ("conv_bias", "bn_running_mean", "bn_batch_stats")


@dataclass(frozen=True)
class ConvSite:
    """One expandable conv: where it is, its geometry and sizes, and where its fused bias goes on fusion."""

    name: str  # qualified module name in the model it was found in
    order: int  # position in the forward pass (0 = nearest the input: "bottom")
    geometry: ConvGeometry
    input_size: tuple[int, int]
    output_size: tuple[int, int]
    bias_sink: str  # the BN module absorbing the fused bias; "" when the conv keeps its own bias
    sink_kind: str  # one of SINK_KINDS

    def to_dict(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "name": self.name,
            "order": self.order,
            "geometry": [g.in_channels, g.out_channels, g.kernel_size, g.stride, g.padding, g.groups],
            "input_size": list(self.input_size),
            "output_size": list(self.output_size),
            "bias_sink": self.bias_sink,
            "sink_kind": self.sink_kind,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConvSite:
        try:
            return cls(
                str(data["name"]),
                int(data["order"]),
                ConvGeometry(*(int(v) for v in data["geometry"])),
                (int(data["input_size"][0]), int(data["input_size"][1])),
                (int(data["output_size"][0]), int(data["output_size"][1])),
                str(data["bias_sink"]),
                str(data["sink_kind"]),
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"malformed conv site record {dict(data)!r}: {exc}") from None


def _batch_norm_sink_kind(bn: nn.Module) -> str | None:
    """How a BN absorbs a constant added to its input, or None when it cannot (per-width statistics)."""
    if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
        return None
    stats = getattr(bn, "stats", "running")
    if stats == "per_width":
        return None
    if stats == "batch" or not bn.track_running_stats:
        return "bn_batch_stats"
    return "bn_running_mean" if bn.running_mean is not None else None


def _is_candidate(conv: nn.Conv2d) -> bool:
    if getattr(conv, "active_out", None) is not None:  # a slimmable conv narrowed at run time
        return False
    try:
        ConvGeometry.of(conv)
    except ValueError:
        return False
    return True


def find_sites(model: nn.Module, input_shape: Sequence[int]) -> list[ConvSite]:
    """Every expandable conv of a plain `model` in forward order (one probe pass on a copy; `model` is untouched).

    `input_shape` is one sample's shape, e.g. (3, 32, 32).
    """
    if any(isinstance(m, DiverseBranchBlock) for m in model.modules()):
        raise ValueError(
            "find_sites needs the plain model: fuse its Diverse Branch Blocks first (fuse_model)"
        )
    probe = copy.deepcopy(model).train()
    conv_nodes: dict[str, Any] = {}
    sizes: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
    bn_inputs: dict[str, Any] = {}
    order: list[str] = []
    handles = []

    def on_conv(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if name not in conv_nodes:
                order.append(name)
                conv_nodes[name] = output.grad_fn
                sizes[name] = (tuple(inputs[0].shape[2:]), tuple(output.shape[2:]))  # type: ignore[assignment]

        return hook

    def on_bn(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            bn_inputs.setdefault(name, inputs[0].grad_fn)

        return hook

    convs: dict[str, nn.Conv2d] = {}
    for name, module in probe.named_modules():
        if isinstance(module, nn.Conv2d) and _is_candidate(module):
            convs[name] = module
            handles.append(module.register_forward_hook(on_conv(name)))
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            handles.append(module.register_forward_pre_hook(on_bn(name)))
    reference = next(probe.parameters(), None)
    dtype = reference.dtype if reference is not None else torch.get_default_dtype()
    device = reference.device if reference is not None else None
    x = torch.randn(2, *input_shape, dtype=dtype, device=device, requires_grad=True)
    try:
        output = probe(x)
    finally:
        for handle in handles:
            handle.remove()
    consumers = _consumer_counts(output)
    bn_modules = dict(probe.named_modules())
    sites: list[ConvSite] = []
    for name in order:
        node = conv_nodes[name]
        conv = convs[name]
        if conv.bias is not None:
            sink, kind = "", "conv_bias"
        else:
            owners = [bn for bn, source in bn_inputs.items() if source is node]
            if len(owners) != 1 or consumers.get(id(node), 0) != 1:
                continue
            sink = owners[0]
            found = _batch_norm_sink_kind(bn_modules[sink])
            if found is None:
                continue
            kind = found
        (h_in, w_in), (h_out, w_out) = sizes[name]
        sites.append(
            ConvSite(name, len(sites), ConvGeometry.of(conv), (h_in, w_in), (h_out, w_out), sink, kind)
        )
    return sites


def _consumer_counts(output: Any) -> dict[int, int]:
    """For every autograd node reachable from `output`, how many edges lead into it (its consumers)."""
    roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    counts: dict[int, int] = {}
    seen: dict[int, Any] = {id(node): node for node in roots}  # holds the nodes so ids stay unique
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            counts[id(child)] = counts.get(id(child), 0) + 1
            if id(child) not in seen:
                seen[id(child)] = child
                stack.append(child)
    return counts


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def _split(name: str) -> tuple[str, str]:
    parent, _, child = name.rpartition(".")
    return parent, child


def expanded_blocks(model: nn.Module) -> dict[str, DiverseBranchBlock]:
    """Every DBB in `model`, by qualified name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, DiverseBranchBlock)}


def expand_model(
    model: nn.Module,
    sites: Sequence[ConvSite],
    structure: Mapping[str, Iterable[str] | None],
    *,
    batches: Iterable[torch.Tensor] | None = None,
    iterations: int = RECALIBRATION_ITERATIONS,
    inner_width: int | None = None,
    generator: torch.Generator | None = None,
    branch_states: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, DiverseBranchBlock]:
    """REP in place: each conv named in `structure` becomes a DBB with those branches (None: all available).

    The model's eval-mode function is unchanged. `branch_states` (from `branch_state`) restores a block's
    non-original branches as a board last trained them (the paper's REP(ω_g, ζ_i), METHODS §5.a.6);
    otherwise new branches start random. With `batches`, the blocks' BNs are recalibrated first (§5.a.3).
    """
    by_name = {site.name: site for site in sites}
    unknown = sorted(set(structure) - set(by_name))
    if unknown:
        raise ValueError(
            f"not expandable convs of this model: {unknown} (sites: {', '.join(by_name) or 'none'})"
        )
    blocks: dict[str, DiverseBranchBlock] = {}
    targets = []
    for site in sorted((by_name[name] for name in structure), key=lambda s: s.order):
        conv = model.get_submodule(site.name)
        if not isinstance(conv, nn.Conv2d) or isinstance(conv, DiverseBranchBlock):
            raise ValueError(
                f"'{site.name}' is a {type(conv).__name__}, not a plain conv: fuse the model first"
            )
        if ConvGeometry.of(conv) != site.geometry:
            raise ValueError(
                f"'{site.name}' has geometry {ConvGeometry.of(conv)}, the site record says {site.geometry}"
            )
        dbb = expand_conv(conv, structure[site.name], inner_width=inner_width, generator=generator)
        weight = conv.weight.detach().clone()
        bias = conv.bias.detach().clone() if conv.bias is not None else torch.zeros_like(weight[:, 0, 0, 0])
        if branch_states is not None and site.name in branch_states:
            _load_branch_state(dbb, branch_states[site.name], site.name)
            absorb(dbb, weight, bias)
        dbb.site = site
        object.__setattr__(dbb, "plain_template", copy.deepcopy(conv).to("meta"))
        parent, child = _split(site.name)
        setattr(model.get_submodule(parent), child, dbb)
        blocks[site.name] = dbb
        targets.append((weight, bias))
    if batches is not None and blocks:
        recalibrate(model, list(blocks.values()), batches, iterations=iterations, targets=targets)
    return blocks


def branch_state(dbb: DiverseBranchBlock) -> dict[str, torch.Tensor]:
    """The non-original branches' parameters and statistics (what a board keeps of its structure ζ_i)."""
    return {
        key: value.detach().clone()
        for key, value in dbb.state_dict().items()
        if not key.startswith("branches.kxk.")
    }


def _load_branch_state(dbb: DiverseBranchBlock, state: Mapping[str, torch.Tensor], name: str) -> None:
    own = dbb.state_dict()
    expected = {key for key in own if not key.startswith("branches.kxk.")}
    if set(state) != expected:
        raise ValueError(
            f"stored branches of '{name}' do not match its structure: "
            f"missing {sorted(expected - set(state))}, unexpected {sorted(set(state) - expected)}"
        )
    merged = {**own, **{key: value.to(own[key]) for key, value in state.items()}}
    dbb.load_state_dict(merged)


def fuse_block(model: nn.Module, name: str) -> nn.Conv2d:
    """Replace the DBB `name` by the plain conv it came from, its fused bias moved into the site's sink."""
    dbb = model.get_submodule(name)
    if not isinstance(dbb, DiverseBranchBlock):
        raise ValueError(f"'{name}' is a {type(dbb).__name__}, not a Diverse Branch Block")
    site: ConvSite | None = dbb.site
    template = dbb.plain_template
    if site is None or not isinstance(template, nn.Conv2d):
        raise ValueError(
            f"the DBB '{name}' was not made by expand_model: fuse it with DiverseBranchBlock.equivalent()"
        )
    kernel, bias = dbb.equivalent()
    plain = copy.deepcopy(template).to_empty(device=kernel.device)
    requires_grad = template.weight.requires_grad
    plain.weight = nn.Parameter(kernel.detach().clone(), requires_grad=requires_grad)
    with torch.no_grad():
        if site.sink_kind == "conv_bias":
            plain.bias = nn.Parameter(bias.detach().clone(), requires_grad=requires_grad)
        else:
            sink = model.get_submodule(site.bias_sink)
            if site.sink_kind == "bn_running_mean":
                # BN_eval(y + b) with mean μ equals BN_eval(y) with mean μ − b; in train mode the batch mean
                # absorbs b, and the running mean stays shifted by exactly b from then on (METHODS §5.a.6).
                assert isinstance(sink, nn.modules.batchnorm._BatchNorm) and sink.running_mean is not None
                sink.running_mean.sub_(bias.to(sink.running_mean))
            # bn_batch_stats: a constant per channel is removed by the batch mean itself; nothing to keep.
    parent, child = _split(name)
    setattr(model.get_submodule(parent), child, plain)
    return plain


def fuse_model(model: nn.Module) -> list[str]:
    """Fuse every DBB of `model` back into its plain conv (same state-dict keys and shapes as before expansion)."""
    names = list(expanded_blocks(model))
    for name in names:
        fuse_block(model, name)
    return names

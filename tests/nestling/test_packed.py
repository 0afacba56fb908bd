"""Packed states: a dict to every reader, one buffer underneath, never a buffer that disagrees with its tensors."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from nestling.models import ModelConfig, build, family_of, registered_families
from nestling.packed import PackedTensors, layout_for, pack, packing
from nestling.slicing import extract
from nestling.spec import SubmodelSpec


def a_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "conv.weight": torch.randn(4, 3, 3, 3, generator=generator),
        "bn.weight": torch.rand(4, generator=generator),
        "bn.running_mean": torch.randn(4, generator=generator),
        "bn.running_var": torch.rand(4, generator=generator) + 0.5,
        "bn.num_batches_tracked": torch.tensor(7),
        "fc.weight": torch.randn(10, 4, generator=generator),
    }


def test_a_packed_state_reads_as_the_state_it_was_made_from() -> None:
    state = a_state()
    packed = pack(state)
    assert list(packed) == list(state)  # the dict's own order is kept
    for key, value in state.items():
        assert torch.equal(packed[key], value) and packed[key].dtype == value.dtype
    buffer, layout = packed.buffer, packed.layout
    assert buffer is not None and layout is not None and layout.complete
    # trained tensors first (by name), then the statistics with the running variances last; ints stay apart
    assert layout.keys == ("bn.weight", "conv.weight", "fc.weight", "bn.running_mean", "bn.running_var")
    assert (
        layout.trained == 3 and layout.trained_size == 4 + 108 + 40 and layout.size == layout.trained_size + 8
    )
    assert packed["conv.weight"].data_ptr() == buffer[4:].data_ptr()  # a view of the buffer, not a copy
    assert packed["bn.num_batches_tracked"] is not state["bn.num_batches_tracked"]
    packed["fc.weight"].mul_(2.0)  # in-place writes reach the buffer
    assert packed.trained is not None and torch.equal(
        packed.trained[112:152], 2.0 * state["fc.weight"].reshape(-1)
    )


def test_layouts_are_interned_so_same_layout_is_an_identity_test() -> None:
    first, second = pack(a_state()), pack({k: v.clone() for k, v in a_state().items()})
    assert first.layout is second.layout
    assert first.layout is layout_for(first.layout.keys, first.layout.shapes, 3, True)  # type: ignore[union-attr]
    narrower = pack({**a_state(), "fc.weight": torch.zeros(10, 2)})
    assert narrower.layout is not first.layout


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.__setitem__("fc.weight", torch.zeros(10, 4)),
        lambda s: s.__delitem__("fc.weight"),
        lambda s: s.update({"fc.weight": torch.zeros(10, 4)}),
        lambda s: s.__ior__({"fc.weight": torch.zeros(10, 4)}),
        lambda s: s.pop("fc.weight"),
        lambda s: s.popitem(),
        lambda s: s.setdefault("extra", torch.zeros(1)),
        lambda s: s.clear(),
    ],
)
def test_any_change_to_the_mapping_drops_the_packing(change) -> None:
    """Otherwise the buffer would claim values the dict no longer holds, and the screen would read them."""
    packed = pack(a_state())
    change(packed)
    assert packing(packed) is None and packed.buffer is None and packed.trained is None


def test_a_plain_dict_or_a_copy_is_not_packed() -> None:
    packed = pack(a_state())
    assert packing(packed) is packed
    assert packing(dict(packed)) is None and packing(a_state()) is None
    assert packing(packed.copy()) is None  # dict.copy gives a plain dict


def test_pickling_keeps_the_packing_and_the_views() -> None:
    """Results cross process pools and Ray pickled: the other side gets a packed state, views of one buffer."""
    packed = pack(a_state())
    for again in (pickle.loads(pickle.dumps(packed)), copy.deepcopy(packed)):
        assert isinstance(again, PackedTensors) and again.layout is packed.layout
        assert list(again) == list(packed) and all(torch.equal(again[k], packed[k]) for k in packed)
        assert again["fc.weight"].data_ptr() != packed["fc.weight"].data_ptr()
        again["fc.weight"].add_(1.0)
        assert again.trained is not None and torch.equal(
            again.trained[112:152], packed["fc.weight"].reshape(-1) + 1.0
        )
    changed = pack(a_state())
    changed["fc.weight"] = torch.zeros(10, 4)
    plain = pickle.loads(pickle.dumps(changed))
    assert type(plain) is dict and torch.equal(plain["fc.weight"], torch.zeros(10, 4))


def test_a_state_with_other_floating_dtypes_is_packed_incomplete() -> None:
    """A bf16 tensor is not in the float32 buffer: the layout says so, and the screen reads such results per
    tensor."""
    state = {**a_state(), "head.weight": torch.ones(3, dtype=torch.bfloat16)}
    packed = pack(state)
    assert packed.layout is not None and not packed.layout.complete
    assert torch.equal(packed["head.weight"], state["head.weight"])


def test_a_packed_state_shares_no_tensor_with_its_source_and_saves_with_safetensors(tmp_path) -> None:
    """A task is a copy: training it (BN increments num_batches_tracked in place) must not touch the global
    model; and checkpoints, which safetensors refuses for tensors that overlap, save it as any state."""
    state = a_state()
    packed = pack(state)
    packed["bn.num_batches_tracked"].add_(1)
    assert int(state["bn.num_batches_tracked"]) == 7
    save_file(
        {**dict(packed), **{f"source/{k}": v for k, v in state.items()}}, str(tmp_path / "s.safetensors")
    )
    loaded = load_file(str(tmp_path / "s.safetensors"))
    assert all(torch.equal(loaded[k], packed[k]) for k in packed)


@pytest.mark.parametrize("arch", sorted(registered_families()))
def test_tasks_and_results_of_every_model_family_are_packed_alike(arch: str) -> None:
    """`extract` (what every task carries) packs every family's submodels completely, and the trainer's result of
    the same submodel gets the same layout object: the update screen's one-operation path, for every family."""
    model = ModelConfig(arch, num_classes=7, image_size=16)
    count = len(family_of(arch).block_infos(16, {}))
    global_state = build(SubmodelSpec.full(model)).state_dict()
    for spec in (SubmodelSpec(model), SubmodelSpec(model, width=0.5, blocks=tuple(range(0, count, 2)))):
        task = extract(global_state, spec)
        assert packing(task) is not None and task.layout is not None and task.layout.complete, spec
        trained = build(spec).state_dict()
        assert pack(trained).layout is task.layout, spec

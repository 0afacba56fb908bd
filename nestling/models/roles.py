"""Parameter roles, declared by the module that creates a tensor, never inferred from the tensor's name.

A role tells aggregation how a global tensor is shared (METHODS §1.2, §2.a.3): NeFL keeps one copy of every
`step` and `norm` tensor per submodel and averages `weight` and `layer_norm` tensors across all of them. A
module declares its own tensors' roles where it builds them (`declare_role(self, STEP, "step")`); anything
undeclared is a `weight`, whatever it is called, so renaming a tensor cannot silently change how it is averaged.
"""

from __future__ import annotations

from torch import nn

from nestling.errors import SpecError

WEIGHT = "weight"  # shared by every submodel: nested-averaged (the default)
NORM = "norm"  # BatchNorm affine parameters and running statistics
LAYER_NORM = "layer_norm"  # LayerNorm affine parameters
STEP = "step"  # NeFL's learnable step size of a residual branch (x + s·f(x))
ROLES = (WEIGHT, NORM, LAYER_NORM, STEP)

_DECLARED = "_declared_roles"  # the module attribute holding {own tensor name: role}


def declare_role(module: nn.Module, role: str, *names: str) -> None:
    """Declare that `module`'s own parameters or buffers `names` have `role` (call it where they are created)."""
    if role not in ROLES:
        raise ValueError(f"unknown parameter role {role!r} (known: {', '.join(ROLES)})")
    declared = dict(getattr(module, _DECLARED, {}))
    for name in names:
        if not isinstance(name, str) or "." in name or not name:
            raise ValueError(f"a role is declared for one of the module's own tensors by name, got {name!r}")
        declared[name] = role
    setattr(module, _DECLARED, declared)


def own_tensor_names(module: nn.Module) -> list[str]:
    """Names of the parameters and (non-None) buffers `module` holds itself, not through its children."""
    return [name for name, _ in module.named_parameters(recurse=False)] + [
        name for name, _ in module.named_buffers(recurse=False)
    ]


def roles_of(net: nn.Module) -> dict[str, str]:
    """The declared role of every state-dict tensor of `net` (undeclared: WEIGHT).

    A declaration naming a tensor the module does not hold (one renamed without its declaration) is an error,
    never a silent fallback to WEIGHT.
    """
    roles: dict[str, str] = {}
    for module_name, module in net.named_modules():
        prefix = f"{module_name}." if module_name else ""
        declared: dict[str, str] = getattr(module, _DECLARED, {})
        own = own_tensor_names(module)
        stray = sorted(set(declared) - set(own))
        if stray:
            raise SpecError(
                f"{type(module).__name__} at '{module_name or 'the root'}' declares roles for {stray}, "
                f"which it does not hold (it holds {own})"
            )
        for name in own:
            roles[prefix + name] = declared.get(name, WEIGHT)
    return roles

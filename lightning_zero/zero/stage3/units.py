"""ZeRO-3 units: which submodules gather their parameters together, and which unit owns each parameter.

Pure planning over the module tree (no processes, no data: meta-device modules work), tested in
``tests/zero/stage3/test_units.py``.

[Note: units] A *unit* is a submodule whose parameters are gathered as a whole just before its forward and freed
after it. Which submodules become units:

- ``auto_wrap_policy={Block, ...}``: every submodule that is an instance of one of the classes;
- ``min_num_params=k``: bottom-up, every submodule whose parameters not already in a deeper unit number at least ``k``
  (the rule of FSDP's size-based policy);
- neither (the default): every child of the outermost ``nn.ModuleList``/``nn.Sequential`` containers
  (transformer blocks, layers).

Units may nest; a parameter belongs to the innermost unit that contains every module using it, so a weight tied
between two units (a GPT's token embedding and LM head) belongs to their common ancestor unit, or to the *root unit*:
everything no other unit owns, gathered on first use in a step and kept until its gradients are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

ROOT = ""
"""Name of the root unit (the module itself)."""


@dataclass(frozen=True)
class UnitPlan:
    """One unit: its module's qualified name (``ROOT`` for the root) and the names of the parameters it owns."""

    name: str
    param_names: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.name or "<root>"


def _within(name: str, unit: str) -> bool:
    return unit == ROOT or name == unit or name.startswith(f"{unit}.")


def _unit_modules(module: nn.Module, auto_wrap_policy: set[type] | None, min_num_params: int | None) -> list[str]:
    named = [(name, m) for name, m in module.named_modules() if name != ROOT]
    if auto_wrap_policy is not None:
        return [name for name, m in named if isinstance(m, tuple(auto_wrap_policy))]
    if min_num_params is not None:
        chosen: list[str] = []
        # named_modules is pre-order, so its reverse visits every module after all of its descendants.
        for name, m in reversed(named):
            deeper = [module.get_submodule(unit) for unit in chosen if unit.startswith(f"{name}.")]
            taken = {id(p) for unit in deeper for p in unit.parameters()}
            free = sum(p.numel() for p in m.parameters() if id(p) not in taken)
            if free >= min_num_params:
                chosen.append(name)
        return sorted(chosen, key=[name for name, _ in named].index)
    chosen = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and not any(_within(name, u) for u in chosen):
            chosen += [f"{name}.{child}" if name else child for child, _ in m.named_children()]
    return chosen


def plan_units(
    module: nn.Module, auto_wrap_policy: set[type] | None = None, min_num_params: int | None = None
) -> list[UnitPlan]:
    """The units of ``module`` in pre-order, the root unit first; units that would own no parameter are dropped."""
    if auto_wrap_policy is not None and min_num_params is not None:
        raise ValueError("auto_wrap_policy and min_num_params are exclusive: pass one of them (or neither)")
    if min_num_params is not None and (isinstance(min_num_params, bool) or min_num_params < 1):
        raise ValueError(f"min_num_params={min_num_params!r} is invalid: expected an integer >= 1")
    unit_names = _unit_modules(module, auto_wrap_policy, min_num_params)

    def innermost(module_name: str) -> str:
        inside = [u for u in unit_names if _within(module_name, u)]
        return max(inside, key=len, default=ROOT)

    # Every module that uses each parameter (a tied weight is listed under several modules).
    users: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    for module_name, m in module.named_modules():
        for param_name, p in m.named_parameters(recurse=False):
            users.setdefault(id(p), []).append(module_name)
            first_name.setdefault(id(p), f"{module_name}.{param_name}" if module_name else param_name)
    owned: dict[str, list[str]] = {ROOT: [], **{u: [] for u in unit_names}}
    for name, p in module.named_parameters():
        owners = [innermost(m) for m in users[id(p)]]
        common = owners[0]
        while not all(_within(o, common) for o in owners):
            common = max((u for u in unit_names if common.startswith(f"{u}.")), key=len, default=ROOT)
        owned[common].append(name)
    return [UnitPlan(name, tuple(params)) for name, params in owned.items() if params or name == ROOT]


def root_owners(module: nn.Module, plans: list[UnitPlan]) -> list[tuple[str, nn.Module]]:
    """The modules that hold a root-unit parameter directly (each once): the root unit's pre-forward hooks sit on
    them, since its parameters are used at both ends of the model."""
    root = {id(p) for plan in plans if plan.name == ROOT for p in map(module.get_parameter, plan.param_names)}
    return [(name, m) for name, m in module.named_modules() if any(id(p) in root for p in m._parameters.values())]

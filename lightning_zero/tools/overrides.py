"""Command-line overrides checked before Hydra composes anything: a misspelt name gets "did you mean".

Hydra's own answers to a typo lead astray: ``strategy=zero3_scrach`` lists every option of every group's search path,
and ``trainer.max_step=10`` (a key the trainer config does not hold) suggests appending it with ``+``, which then
adds a key that nothing takes. :func:`check_overrides` looks at the overrides of ``lightning-zero-train`` first:

- ``<group>=<option>`` (``strategy=``, ``trainer=``, ``model=``, ...): each option (comma-separated under ``-m``) must
  be one of the group's configs in ``lightning_zero.conf`` (or ``null``);
- ``trainer.<key>=`` (without ``+``): ``key`` must be an argument of ``lightning.pytorch.Trainer``;
- ``strategy.<key>=`` (without ``+``), for one of our strategies chosen on the command line (or the default): ``key``
  must be a setting of its schema (:mod:`lightning_zero.tools.config_schema`).

Sweep expressions (``choice(...)``, ``range(...)``, globs) and anything else are left to Hydra. Nothing here creates a
run directory: a rejected command leaves nothing behind.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import fields
from importlib import resources

import yaml

from lightning_zero.tools.config_schema import SCHEMAS

DEFAULT_CONFIG = "train"


class OverrideError(ValueError):
    """A command-line override that names nothing: the message says what was meant."""


def did_you_mean(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean <prefix><closest>?"`` or ``""`` when nothing is close."""
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _conf() -> resources.abc.Traversable:
    return resources.files("lightning_zero.conf")


def group_options(group: str) -> list[str]:
    """The configs of config group ``group`` (``[]`` if it is no group)."""
    folder = _conf() / group
    if not folder.is_dir():
        return []
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _defaults() -> dict[str, str]:
    """The group choices of the primary config (``strategy: zero3_scratch``, ...)."""
    config = yaml.safe_load((_conf() / f"{DEFAULT_CONFIG}.yaml").read_text())
    return {k: v for entry in config.get("defaults", []) if isinstance(entry, dict) for k, v in entry.items()}


def _trainer_arguments() -> set[str]:
    from lightning.pytorch import Trainer

    return {name for name in inspect.signature(Trainer.__init__).parameters if name != "self"}


def _strategy_settings(option: str) -> set[str] | None:
    """The settings of strategy config ``option`` from its schema, or ``None`` if it has none (Lightning's)."""
    config = yaml.safe_load((_conf() / "strategy" / f"{option}.yaml").read_text()) or {}
    for entry in config.get("defaults", []):
        name = entry.split("@")[0].lstrip("/") if isinstance(entry, str) else ""
        if name in SCHEMAS:
            return {f.name for f in fields(SCHEMAS[name])} | set(config) - {"defaults"}
    return None


def _sweep_expression(value: str) -> bool:
    return any(c in value for c in "()*[]{}$")


def check_overrides(args: Sequence[str]) -> None:
    """Raise :class:`OverrideError` for the first override of ``args`` (a ``lightning-zero-train`` command line) that
    names no config option, Trainer argument or strategy setting (see the module docstring)."""
    overrides = [a for a in args if "=" in a and not a.startswith(("-", "+", "~"))]
    chosen = {key: value for key, value in (o.split("=", 1) for o in overrides) if "." not in key}
    for key, value in chosen.items():
        options = group_options(key)
        if not options or _sweep_expression(value):
            continue
        for option in value.split(","):
            if option not in options and option != "null":
                raise OverrideError(
                    f"{key}={option} is not an option of {key}{did_you_mean(option, options)} (options:"
                    f" {', '.join(options)})"
                )
    strategy = chosen.get("strategy", _defaults().get("strategy", ""))
    for override in overrides:
        key = override.split("=", 1)[0]
        section, _, name = key.partition(".")
        if not name or "." in name:
            continue
        if section == "trainer":
            allowed = _trainer_arguments()
            owner = "an argument of lightning.pytorch.Trainer"
        elif section == "strategy" and "experiment" not in chosen and "," not in strategy:
            allowed = _strategy_settings(strategy) if strategy in group_options("strategy") else None
            owner = f"a setting of strategy={strategy}"
        else:
            continue
        if allowed is not None and name not in allowed:
            raise OverrideError(f"{key} is not {owner}{did_you_mean(name, allowed, f'{section}.')}")

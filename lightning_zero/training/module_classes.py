"""Settings that name a set of classes: module classes (``auto_wrap_policy``, ``activation_checkpointing_policy``),
optimizer classes (``elementwise_optimizers``).

Python callers pass the classes (``{Block}``); a Hydra config passes their import paths
(``["torch.nn.TransformerEncoderLayer"]``), which :func:`module_classes` / :func:`optimizer_classes` import.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

EXAMPLE = "torch.nn.TransformerEncoderLayer"


def _import_class(path: str) -> Any:
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path")
    return getattr(importlib.import_module(module_name), name)


def module_classes(setting: str, value: Any) -> set[type[nn.Module]] | None:
    """``None``, or a non-empty set of ``nn.Module`` subclasses given as classes or import paths; anything else
    raises one error naming ``setting``."""
    return _classes(setting, value, nn.Module, "nn.Module", "{Block}", EXAMPLE)


def optimizer_classes(setting: str, value: Any) -> set[type[torch.optim.Optimizer]] | None:
    """As :func:`module_classes`, for ``torch.optim.Optimizer`` subclasses."""
    return _classes(setting, value, torch.optim.Optimizer, "torch.optim.Optimizer", "{MyOptimizer}", "my_pkg.MyOpt")


def _classes(setting: str, value: Any, base: type, kind: str, example: str, path_example: str) -> set[type] | None:
    if value is None:
        return None
    expected = f"expected a set of {kind} classes (e.g. {example}) or of their import paths (e.g. {path_example!r})"
    if isinstance(value, (str, bytes, type)) or not isinstance(value, Iterable):
        raise ValueError(f"{setting}={value!r} is invalid: {expected}")
    classes = set()
    for item in value:
        if isinstance(item, str):
            try:
                item = _import_class(item)
            except (ImportError, AttributeError) as err:
                raise ValueError(f"{setting}: cannot import {item!r} ({err}): {expected}") from None
        if not (isinstance(item, type) and issubclass(item, base)):
            raise ValueError(f"{setting}={value!r} is invalid: {item!r} is not a {kind} class; {expected}")
        classes.add(item)
    if not classes:
        raise ValueError(f"{setting}={value!r} is invalid: it is empty (pass None for none); {expected}")
    return classes

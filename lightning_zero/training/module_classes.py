"""Settings that name a set of module classes (``auto_wrap_policy``, ``activation_checkpointing_policy``).

Python callers pass the classes (``{Block}``); a Hydra config passes their import paths
(``["torch.nn.TransformerEncoderLayer"]``), which :func:`module_classes` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

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
    if value is None:
        return None
    expected = f"expected a set of nn.Module classes (e.g. {{Block}}) or of their import paths (e.g. {EXAMPLE!r})"
    if isinstance(value, (str, bytes, type)) or not isinstance(value, Iterable):
        raise ValueError(f"{setting}={value!r} is invalid: {expected}")
    classes = set()
    for item in value:
        if isinstance(item, str):
            try:
                item = _import_class(item)
            except (ImportError, AttributeError) as err:
                raise ValueError(f"{setting}: cannot import {item!r} ({err}): {expected}") from None
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise ValueError(f"{setting}={value!r} is invalid: {item!r} is not an nn.Module class; {expected}")
        classes.add(item)
    if not classes:
        raise ValueError(f"{setting}={value!r} is invalid: it is empty (pass None for none); {expected}")
    return classes

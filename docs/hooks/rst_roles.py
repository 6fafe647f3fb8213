"""A griffe extension for the API reference: the docstrings' reStructuredText roles as Markdown code.

The package's docstrings are Google style with Sphinx roles (``:class:`~lightning_zero.dp.reducer.GradientReducer```)
and double-backtick literals, which read well in ``help()``. mkdocstrings renders Markdown, where a role would show as
its raw text: this turns ``:role:`~a.b.C``` into `` `C` `` and ``:role:`a.b.C``` into `` `a.b.C` ``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)

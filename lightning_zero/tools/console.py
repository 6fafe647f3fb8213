"""What a ``lightning-zero-train`` run shows on the console, kept in a file of its run dir as well.

Lightning writes its messages through a ``StreamHandler`` of its own (made when it is imported, bound to the
``sys.stderr`` of that moment), the progress bar to ``sys.stdout``/``sys.stderr``, and warnings to ``sys.stderr``;
none of it reaches Hydra's ``train.log``. :class:`ConsoleLog` copies every write to the console into a file for the
duration of a run: it wraps ``sys.stdout`` and ``sys.stderr``, and points the console handlers of every logger at the
wrappers, then puts everything back.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class _Tee:
    """A text stream that writes to ``stream`` and to ``copy``."""

    def __init__(self, stream: IO[str], copy: IO[str]) -> None:
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        self._copy.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._copy.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the console's
        return getattr(self._stream, name)


class ConsoleLog:
    """Within the ``with`` block, every console write also goes to ``path`` (appended, line-buffered)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, old value)

    def __enter__(self) -> ConsoleLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        tees = {id(sys.stdout): _Tee(sys.stdout, self._file), id(sys.stderr): _Tee(sys.stderr, self._file)}
        handlers = [h for logger in _loggers() for h in logger.handlers if type(h) is logging.StreamHandler]
        for handler in handlers:
            if id(handler.stream) in tees:
                self._saved.append((handler, "stream", handler.stream))
                handler.stream = tees[id(handler.stream)]
        for name in ("stdout", "stderr"):
            self._saved.append((sys, name, getattr(sys, name)))
            setattr(sys, name, tees[id(getattr(sys, name))])
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved = []
        if self._file is not None:
            self._file.close()
            self._file = None


def _loggers() -> list[logging.Logger]:
    manager = logging.Logger.manager
    return [logging.getLogger()] + [v for v in manager.loggerDict.values() if isinstance(v, logging.Logger)]

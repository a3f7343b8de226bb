"""``--format``: renderers by name, or your own by import path (pyinstrument's ``-r module.Class``).

A renderer turns a :class:`~rlprof.analysis.document.Document` into text: ``render(document) -> str``. The built-in
ones are registered here (``rich`` writes to the terminal itself, with its colours and width); yours is
``--format package.module:function`` (a function of that shape), or :func:`register_renderer` in code that runs
before :func:`~rlprof.cli.common.emit`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rich.console import Console

    from rlprof.analysis.document import Document

TextRenderer = Callable[["Document"], str]


@dataclass(frozen=True)
class Renderer:
    """A named renderer: ``to_text`` formats a document; ``to_console`` (the terminal's) prints it itself."""

    name: str
    help: str
    to_text: Optional[TextRenderer] = None
    to_console: Optional[Callable[[Document, Console], None]] = None

    def write(self, document: Document, console: Console) -> None:
        """Show ``document``: on the console, or its text as it is (no markup, no wrapping)."""
        if self.to_console is not None:
            self.to_console(document, console)
            return
        assert self.to_text is not None
        text = self.to_text(document)
        console.file.write(text if text.endswith("\n") else text + "\n")
        console.file.flush()


def _console(document: Document, console: Console) -> None:
    from rlprof.analysis.render import console as terminal

    terminal.render(document, console)


def _markdown(document: Document) -> str:
    from rlprof.analysis.render import markdown

    return markdown.render(document)


def _json(document: Document) -> str:
    from rlprof.analysis.render import jsonout

    return jsonout.render(document)


_RENDERERS: dict[str, Renderer] = {
    "rich": Renderer("rich", "the terminal (the default)", to_console=_console),
    "md": Renderer("md", "Markdown", to_text=_markdown),
    "json": Renderer("json", "the documented JSON (rlprof/analysis/*.schema.json)", to_text=_json),
}


def register_renderer(name: str, help: str) -> Callable[[TextRenderer], TextRenderer]:
    """Decorator: ``render(document) -> str`` becomes ``--format name`` (a name taken already is an error)."""

    def add(render: TextRenderer) -> TextRenderer:
        if name in _RENDERERS:
            raise ValueError(f"a renderer named {name!r} is registered already")
        _RENDERERS[name] = Renderer(name, help, to_text=render)
        return render

    return add


def renderer_names() -> list[str]:
    return list(_RENDERERS)


def find_renderer(spec: str) -> Renderer:
    """The renderer ``spec`` names: a registered name, or ``package.module:function`` (imported: your own code, as
    you asked). A ``ValueError`` says what exists otherwise."""
    if spec in _RENDERERS:
        return _RENDERERS[spec]
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(
            f"{spec!r}: not a renderer; choose one of {', '.join(_RENDERERS)} or give module:function "
            "(a function of a document returning its text)"
        )
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(found):
        raise ValueError(f"{spec!r}: {attribute} is not a function of a document")
    return Renderer(spec, f"{spec} (your own)", to_text=found)

"""How file names are shown to people and in JSON, losslessly.

On POSIX a name is bytes: anything but ``/`` and NUL. Inside metasync a path is
the ``str`` Python gives for those bytes (``os.fsdecode``: bytes that are not
UTF-8 become lone surrogates U+DC80..U+DCFF, PEP 383), and it is written back
with ``os.fsencode``, so every name round-trips. Such a string cannot be printed
or put in JSON as it is, so every name that reaches a person or a program goes
through this module (docs/design.md, "File names"):

- :func:`display_path`, for text output, quotes like git (``core.quotePath=false``):
  a name that is valid UTF-8, printable and holds no ``"`` or ``\\`` is shown as
  it is; any other is shown in double quotes with C escapes (``\\n``, ``\\t``,
  ``\\"``, ``\\\\``, ...) and every other unprintable character or byte that is not
  UTF-8 as ``\\`` and three octal digits: ``caf\\xe9.txt`` shows as
  ``"caf\\351.txt"``. An unquoted name never starts with ``"``, so
  :func:`parse_display_path` gives back the exact bytes.
- :func:`json_path` for JSON: the name itself when it is valid UTF-8 (JSON
  escapes control characters on its own), else its quoted display form together
  with the exact bytes in base64 under ``<key>_base64``.
"""

from __future__ import annotations

import base64
import os
from typing import Any

_NAMED = {"\a": "a", "\b": "b", "\t": "t", "\n": "n", "\v": "v", "\f": "f", "\r": "r",
          '"': '"', "\\": "\\"}
_UNNAMED = {v: k for k, v in _NAMED.items()}


def _bytes_of(char: str) -> bytes:
    """The file-system bytes of one character of a decoded path."""
    return os.fsencode(char) if "\udc80" <= char <= "\udcff" else char.encode("utf-8", "surrogatepass")


def needs_quoting(path: str) -> bool:
    """True if :func:`display_path` quotes ``path``."""
    return not path.isprintable() or '"' in path or "\\" in path


def display_path(path: str) -> str:
    """``path`` as text output shows it (see the module docstring): printable and
    valid UTF-8 as it is, anything else quoted with C and octal escapes."""
    if not needs_quoting(path):
        return path
    out = ['"']
    for char in path:
        if char in _NAMED:
            out.append("\\" + _NAMED[char])
        elif char.isprintable():
            out.append(char)
        else:
            out.extend(f"\\{b:03o}" for b in _bytes_of(char))
    out.append('"')
    return "".join(out)


def parse_display_path(text: str) -> bytes:
    """The exact file-system bytes of a name shown by :func:`display_path`.
    Raises ValueError on text that function never gives."""
    if not text.startswith('"'):
        return os.fsencode(text)
    if len(text) < 2 or not text.endswith('"'):
        raise ValueError(f"unterminated quoted name: {text!r}")
    body, out, i = text[1:-1], bytearray(), 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out += char.encode("utf-8")
            i += 1
        elif body[i + 1:i + 2] in _UNNAMED:
            out += _UNNAMED[body[i + 1]].encode()
            i += 2
        elif len(body) >= i + 4 and all(c in "01234567" for c in body[i + 1:i + 4]):
            out.append(int(body[i + 1:i + 4], 8))
            i += 4
        else:
            raise ValueError(f"bad escape in quoted name: {text!r}")
    return bytes(out)


def is_utf8(path: str) -> bool:
    """True if ``path`` is valid Unicode text (its name's bytes were valid UTF-8)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_only(doc: Any) -> Any:
    """``doc`` (JSON-ready) with every string that is not valid UTF-8 (a file name's
    raw bytes) in its quoted display form, which :func:`parse_display_path` turns
    back into the bytes: JSON output never carries a lone surrogate."""
    if isinstance(doc, str):
        return doc if is_utf8(doc) else display_path(doc)
    if isinstance(doc, dict):
        return {text_only(k): text_only(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [text_only(v) for v in doc]
    return doc


def json_path(path: str, key: str = "path") -> dict[str, Any]:
    """The JSON fields for one name under ``key``: ``{key: name}`` if the name is
    valid UTF-8, else ``{key: display form, key + "_base64": exact bytes}`` (a JSON
    string cannot hold bytes that are not text, and parsers disagree on lone
    surrogates, so none is ever emitted)."""
    if is_utf8(path):
        return {key: path}
    return {key: display_path(path), f"{key}_base64": base64.b64encode(os.fsencode(path)).decode()}

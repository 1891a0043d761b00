"""The report's JSON Schema, made from the dataclasses in core/report.py, and shipped in the package as
`tfmem_magic/report.schema.json` for readers in other languages (the JupyterLab renderer, a CI job reading saved
reports). The dataclasses are the source of truth; the shipped file is checked against them by the tests, and every
report the test suite publishes is validated against it (tests/conftest.py).

    python -m tfmem_magic.core.schema > tfmem_magic/report.schema.json   # after changing a report dataclass
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tfmem_magic.core.report import MIME_TYPE, SCHEMA, Report

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "report.schema.json"
_SCALARS = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"}, bool: {"type": "boolean"}}


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `Report.to_dict()`: every key, its type, and which may be null. Extra keys
    are refused, so that the schema lists everything a report holds."""
    defs: dict[str, Any] = {}
    root = _object(Report, defs)
    root["properties"]["schema"] = {"const": SCHEMA}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:{MIME_TYPE}",
        "title": f"tfmem report ({SCHEMA})",
        "description": "One measured cell (or block, or saved trace): what every surface of tfmem renders. "
        "Bytes are integers and times seconds; keys are added freely and never renamed without "
        "a new schema id (docs/design.md, 'Report contract').",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def _object(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties = {f.name: _type(hints[f.name], defs) for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(cls.__name__ + "("):  # a docstring of ours, not the dataclass's signature
        out = {"description": " ".join(doc.split()), **out}
    return out


def _type(hint: object, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_type(a, defs) for a in typing.get_args(hint) if a is not type(None)]
        nullable = type(None) in typing.get_args(hint)
        return (
            {"anyOf": options + ([{"type": "null"}] if nullable else [])}
            if len(options) > 1 or nullable
            else options[0]
        )
    if origin is list:
        (item,) = typing.get_args(hint)
        return {"type": "array", "items": _type(item, defs)}
    if origin is dict:
        _, item = typing.get_args(hint)
        return {"type": "object", "additionalProperties": _type(item, defs)}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        name = hint.__name__
        if name not in defs:
            defs[name] = {}  # a placeholder first: a dataclass that refers to itself ends here
            defs[name] = _object(hint, defs)
        return {"$ref": f"#/$defs/{name}"}
    if hint is Any:
        return {}
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    raise TypeError(f"no JSON Schema type for {hint!r}")


def shipped_schema() -> dict[str, Any]:
    """The schema file the package ships."""
    schema: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return schema


if __name__ == "__main__":
    json.dump(report_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")

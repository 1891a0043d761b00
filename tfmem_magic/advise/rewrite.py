"""Find and change the batch size in a cell's source, touching nothing else (comments, strings, formatting).

The batch size is a literal integer in one of three places: a `batch_size=N` argument (or any `*batch_size = N`
assignment), a `BATCH_SIZE = N` / `batch = N` / `bs = N` assignment, or a `.batch(N)` call on a tf.data pipeline.
Python's own tokenizer finds them, so a "batch_size" inside a string or a comment is never touched.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass

_BATCH_NAME = re.compile(r"^(?:[a-z_]*batch_size|batch|batchsize|bs)$", re.IGNORECASE)


@dataclass
class BatchLiteral:
    kind: str  # "argument/assignment" | "tf.data .batch()"
    name: str  # the name it is bound to, or ".batch"
    value: int
    line: int  # 1-based
    start: int  # offsets into the source of the number
    end: int


@dataclass
class BatchRewrite:
    source: str | None  # the rewritten cell, or None when the batch size could not be located
    message: str  # what was changed, or why nothing was
    changed: list[BatchLiteral]


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def find_batch_literals(source: str) -> tuple[list[BatchLiteral], list[str]]:
    """Integer literals that set a batch size, and the names of non-literal ones (`batch_size=BS`)."""
    try:
        tokens = [
            t
            for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
        ]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [], []
    starts = _offsets(source)
    found, indirect = [], []
    for i, tok in enumerate(tokens[:-2]):
        nxt, val = tokens[i + 1], tokens[i + 2]
        if tok.type == tokenize.NAME and _BATCH_NAME.match(tok.string) and nxt.string == "=":
            if val.type == tokenize.NUMBER and val.string.isdigit():
                kind, name = "argument/assignment", tok.string
            elif val.type == tokenize.NAME and i + 3 < len(tokens) and tokens[i + 3].string in (",", ")"):
                indirect.append(val.string)
                continue
            else:
                continue
        elif (
            tok.string == "."
            and nxt.type == tokenize.NAME
            and nxt.string == "batch"
            and val.string == "("
            and i + 3 < len(tokens)
            and tokens[i + 3].type == tokenize.NUMBER
            and tokens[i + 3].string.isdigit()
        ):
            kind, name, val = "tf.data .batch()", ".batch", tokens[i + 3]
        else:
            continue
        (row, col), (erow, ecol) = val.start, val.end
        found.append(BatchLiteral(kind, name, int(val.string), row, starts[row - 1] + col, starts[erow - 1] + ecol))
    return found, indirect


def rewrite_batch(source: str, measured: int | None, new: int) -> BatchRewrite:
    """The cell with its batch size set to `new`. Among several literals, those equal to the batch the cell
    actually ran with are changed; a lone literal is changed whatever its value."""
    found, indirect = find_batch_literals(source)
    chosen = [f for f in found if measured is not None and f.value == measured] or (found if len(found) == 1 else [])
    if not chosen:
        if indirect:
            return BatchRewrite(
                None,
                f"the batch size comes from `{indirect[0]}`, set outside this cell: set "
                f"{indirect[0]} = {new} where it is defined",
                [],
            )
        if found:
            listed = ", ".join(f"{f.name}={f.value} (line {f.line})" for f in found)
            return BatchRewrite(
                None,
                f"several batch sizes in this cell ({listed}) and none is the {measured} the "
                f"cell ran with: set the training batch to {new} by hand",
                [],
            )
        return BatchRewrite(
            None,
            "the batch size is not written in this cell (no batch_size=N argument, .batch(N) "
            f"call or BATCH_SIZE = N assignment): set it to {new} by hand",
            [],
        )
    out, last = [], 0
    for f in sorted(chosen, key=lambda f: f.start):
        out.append(source[last : f.start])
        out.append(str(new))
        last = f.end
    out.append(source[last:])
    where = ", ".join(f"{f.name} on line {f.line}" for f in chosen)
    return BatchRewrite("".join(out), f"batch size {chosen[0].value} → {new} ({where})", chosen)


def call_arguments(source: str, call: str) -> dict[str, str] | None:
    """The source text of the data arguments (`x`, `y`, `sample_weight`, by position or keyword) of the cell's first
    `<something>.<call>(...)`; None when the cell does not parse or makes no such call. IPython's `%` and `!` lines
    are left out before parsing."""
    plain = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        tree = ast.parse(plain)
    except SyntaxError:
        return None
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == call
    ]
    if not calls:
        return None
    first = min(calls, key=lambda node: (node.lineno, node.col_offset))
    found: dict[str, str] = {}
    for role, node in zip(("x", "y", "batch_size"), first.args, strict=False):
        if role != "batch_size":
            found[role] = ast.get_source_segment(plain, node) or ""
    for keyword in first.keywords:
        if keyword.arg in ("x", "y", "sample_weight"):
            found[keyword.arg] = ast.get_source_segment(plain, keyword.value) or ""
    return {role: text for role, text in found.items() if text} or None

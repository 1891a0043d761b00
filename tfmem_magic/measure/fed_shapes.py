"""The shapes a call will really feed, where its inputs' spec leaves a dimension open.

A `padded_batch` (or ragged, or variable-length) tf.data pipeline has `None` for every dimension besides the batch in
its element_spec: each batch is padded to its own longest element. The pre-flight's probes must run at the lengths
the call will feed (a Transformer's attention grows with the length squared), so those dimensions are read from the
pipeline's batches themselves: a bounded scan that takes, dimension by dimension, the largest seen. A scan that
reached the pipeline's end knows the longest batch; one that stopped early has a lower bound only, and a prediction
on it can refuse a call but never let it through as "fits" (docs/preflight.md, 'Open dimensions').
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tfmem_magic.core.types import Dataset, ParsedJSON
from tfmem_magic.measure.feeding import LEAF, split_batch, structure_leaves

SCAN_SECONDS = 2.0  # a pipeline that reads files can be slow: the scan stops here, with a lower bound
SCAN_BATCHES = 512


@dataclass
class FedShapes:
    """The structure (feeding.spec_of's form) with its open dimensions filled, and how far that can be trusted."""

    structure: ParsedJSON
    batches: int  # batches read
    exact: bool  # the scan reached the pipeline's end: the dimensions are the longest it feeds
    longest: list[int]  # the filled dimensions, in the order of the structure's leaves


def has_open_dims(node: ParsedJSON) -> bool:
    """Whether a structure (spec_of's form) has a dimension besides the batch that is not known (None)."""
    return any(d is None for dims, _ in structure_leaves(node) for d in dims)


def widest(a: ParsedJSON, b: ParsedJSON) -> ParsedJSON:
    """Two structures of one pipeline (spec_of's form), dimension by dimension the larger (None where either lacks
    it): the shape that holds both batches."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, dict) and LEAF in a and isinstance(b, dict) and LEAF in b:
        da, db = a[LEAF][0], b[LEAF][0]
        if len(da) != len(db):
            return {LEAF: [[None] * max(len(da), len(db)), a[LEAF][1]]}
        dims = [None if x is None or y is None else max(int(x), int(y)) for x, y in zip(da, db, strict=True)]
        return {LEAF: [dims, a[LEAF][1]]}
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: widest(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [widest(x, y) for x, y in zip(a, b, strict=True)]
    return a


def filled(spec: ParsedJSON, seen: ParsedJSON) -> ParsedJSON:
    """`spec` with its open dimensions taken from `seen` (the widest batch read); known ones stay as they are."""
    if isinstance(spec, dict) and LEAF in spec:
        dims, dtype = spec[LEAF]
        got = seen[LEAF][0] if isinstance(seen, dict) and LEAF in seen and len(seen[LEAF][0]) == len(dims) else None
        return {LEAF: [[d if d is not None or got is None else got[i] for i, d in enumerate(dims)], dtype]}
    if isinstance(spec, dict):
        return {k: filled(v, seen.get(k) if isinstance(seen, dict) else None) for k, v in spec.items()}
    if isinstance(spec, list):
        others = seen if isinstance(seen, list) and len(seen) == len(spec) else [None] * len(spec)
        return [filled(v, o) for v, o in zip(spec, others, strict=True)]
    return spec


def scan(
    dataset: Dataset, structure: ParsedJSON, seconds: float = SCAN_SECONDS, limit: int = SCAN_BATCHES
) -> FedShapes:
    """Read the pipeline's batches (at most `limit`, for at most `seconds`) and fill `structure`'s open dimensions
    with the largest each took. The pipeline is iterated anew, as fit will iterate it again: a dataset is a
    description, each iteration starts from its beginning."""
    started = time.perf_counter()
    seen: ParsedJSON = None
    count, exact = 0, False
    iterator = iter(dataset)
    while True:
        if count >= limit or time.perf_counter() - started > seconds:
            break
        try:
            item = next(iterator)
        except StopIteration:
            exact = True
            break
        seen = widest(seen, split_batch(item))
        count += 1
    out = filled(structure, seen) if seen is not None else structure
    return FedShapes(
        out,
        count,
        exact and count > 0,
        [int(d) for dims, _ in structure_leaves(out) for d in dims if d is not None] if seen is not None else [],
    )

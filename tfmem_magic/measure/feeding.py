"""What one fit/evaluate/predict call was fed: the batch, the samples, the arrays Keras copies, the targets, the
validation data. Read from the call's own arguments, bound by name (so any argument style Keras accepts reads the
same), without consuming or changing anything the user passed. No TensorFlow import: duck typing only.

Where the batch comes from, in order of trust:
- `batch_size=` (arrays and tensors), else Keras' default of 32 for arrays;
- a tf.data pipeline: its element_spec's leading dimension when static, else the `.batch()` anywhere upstream
  (keras.io pipelines end in `.prefetch()` or `.map()` after the batch, so the last step rarely knows it);
- a Python generator: the first batch it yields (recorded as Keras takes it; see `spy_generator`);
- a PyDataset: its `batch_size` attribute when it has one.
Unknown stays unknown (None): a prediction around "batch 1" would be wrong and look right.

What one batch holds (`Feed.structure`): the per-sample shapes and dtypes of its features, targets and sample
weights, nested as the user nested them (dict inputs, several outputs), from the arrays, the dataset's element_spec,
a generator's first batch or a PyDataset's first item. Calibration probes build their synthetic batches from it, and
the analytic prior reads the sequence length a variable-length model was fed.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.types import Dataset, JSONValue, NotebookValue, ParsedJSON, TFTensor

_log = logging.getLogger(__name__)

KERAS_DEFAULT_BATCH = 32
# how a custom loop's batch is read: under a tf.distribute strategy it is one replica's share (see modelinfo)
DIRECT_CALL_BATCH = "the largest batch the model was called on"
_ROLES = ("x", "y", "sample_weight")


@dataclass
class InputArray:
    """A numpy array handed to the call. Keras copies it into a tensor: `copy_bytes` is that copy's size (only the
    training rows with validation_split)."""

    id: int
    nbytes: int
    role: str  # "x" | "y" | "sample_weight" | "validation x" | ...
    copy_bytes: int

    @property
    def validation(self) -> bool:
        return self.role.startswith("validation")


@dataclass
class Feed:
    kind: str = "none"  # "arrays" | "tensors" | "dataset" | "generator" | "pydataset" | "none"
    batch_size: int | None = None
    batch_source: str | None = None  # how the batch was read, in words
    samples: int | None = None  # rows of the training (or evaluated) arrays
    input_shape: tuple[int | None, ...] | None = None  # the first input's shape, batch dimension included
    arrays: list[InputArray] = field(default_factory=list)
    # what one batch holds: {"x": ..., "y": ..., "sample_weight": ...} (see spec_of)
    structure: dict[str, Any] | None = None
    validation: str | None = None  # what the call validated on, in words
    validation_samples: int | None = None
    # the tf.data pipeline itself, for the pre-flight to read the lengths its spec leaves open (measure/fed_shapes.py);
    # held for the call only: the report never keeps it
    dataset: Any = None


def bind(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (self excluded); {} when they do not bind (Keras will say why)."""
    try:
        signature = inspect.signature(function)
        bound = signature.bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return {}
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)), None)  # self
    extra = named.pop("kwargs", None)
    if isinstance(extra, dict):
        named.update(extra)
    return named


def leaves(value: NotebookValue, depth: int = 0) -> Iterator[NotebookValue]:
    """The leaves of a nested structure of dicts, lists and tuples (Keras accepts all three for inputs)."""
    if depth > 8:
        return
    if isinstance(value, dict):
        for item in value.values():
            yield from leaves(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves(item, depth + 1)
    elif value is not None:
        yield value


def _is_numpy(value: NotebookValue) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "nbytes") and hasattr(value, "shape")


def _dims(shape: TFTensor) -> tuple[int | None, ...] | None:
    if shape is None:
        return None
    try:
        return tuple(None if d is None else int(d) for d in shape)
    except (TypeError, ValueError):  # an unknown rank
        return None


def _rows(value: NotebookValue) -> int | None:
    dims = _dims(getattr(value, "shape", None))
    return dims[0] if dims else None


def is_dataset(value: NotebookValue) -> bool:
    return hasattr(value, "element_spec") and hasattr(value, "_variant_tensor")


def is_pydataset(value: NotebookValue) -> bool:
    return any(c.__name__ in ("PyDataset", "Sequence") and "keras" in c.__module__ for c in type(value).__mro__)


def dataset_batch(dataset: Dataset) -> tuple[int | None, str | None]:
    """A tf.data pipeline's batch size: the element_spec's leading dimension, else the nearest `.batch()` upstream."""
    first = next(leaves(getattr(dataset, "element_spec", None)), None)
    dims = _dims(getattr(first, "shape", None))
    if dims and dims[0] is not None:
        return dims[0], "the dataset's element_spec"
    node = dataset
    for _ in range(64):  # batch → map → prefetch → ...: walk up to the batch (private: see capabilities.py)
        size = getattr(node, "_batch_size", None)
        if size is not None:
            try:
                return int(size.numpy() if hasattr(size, "numpy") else size), "the dataset's .batch()"
            except (TypeError, ValueError):
                return None, None
        node = getattr(node, "_input_dataset", None)
        if node is None:
            break
    return None, None


LEAF = "__tfmem_leaf__"  # marks a leaf in a structure: {LEAF: [per-sample dims (None when unknown), dtype]}


def spec_of(value: NotebookValue, depth: int = 0) -> JSONValue:
    """Per-sample shapes and dtypes of a nested structure of arrays, tensors or TensorSpecs, JSON-ready: dicts and
    lists as the user nested them, each leaf as {LEAF: [dims without the batch, dtype name]}; None where a leaf has
    no shape (a Python list, a scalar) or the nesting is deeper than Keras goes."""
    if depth > 8 or value is None:
        return None
    if isinstance(value, dict):
        return {str(k): spec_of(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [spec_of(v, depth + 1) for v in value]
    dims = _dims(getattr(value, "shape", None))
    dtype = getattr(value, "dtype", None)
    if not dims or dtype is None:
        return None
    return {LEAF: [list(dims[1:]), str(getattr(dtype, "name", dtype))]}


def split_batch(item: NotebookValue) -> dict[str, JSONValue]:
    """One batch as Keras unpacks it, (x,), (x, y) or (x, y, sample_weight), as a structure (see spec_of)."""
    parts = item if isinstance(item, tuple) else (item,)
    return {role: spec_of(part) for role, part in zip(_ROLES, parts[:3], strict=False)}


def pack_batch(x: TFTensor, y: TFTensor = None, sample_weight: TFTensor = None) -> TFTensor:
    """One batch as Keras hands it to `train_step` (its data_adapter_utils.pack_x_y_sample_weight): x alone, (x,)
    for a tuple of inputs, (x, y), (x, y, sample_weight). The saved step's signature and its probes' batches are
    both packed here (advise/step_export.py, the probe script in advise/probe_runs.py)."""
    if y is None:
        return (x,) if isinstance(x, tuple) else x
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def structure_leaves(node: ParsedJSON) -> list[tuple[list[int | None], str]]:
    """The (per-sample dims, dtype) leaves of a structure, in order."""
    if isinstance(node, dict) and LEAF in node:
        return [tuple(node[LEAF])]
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return [leaf for value in values for leaf in structure_leaves(value)]


def complete(node: ParsedJSON) -> bool:
    """Whether every leaf of a structure has a shape (a Python list of labels has none): the probes can make it."""
    if node is None:
        return False
    if isinstance(node, dict) and LEAF in node:
        return True
    values = list(node.values()) if isinstance(node, dict) else list(node) if isinstance(node, list) else []
    return bool(values) and all(complete(v) for v in values)


def batch_of(item: NotebookValue) -> tuple[int | None, dict[str, JSONValue], tuple[int | None, ...] | None]:
    """Batch size, structure (see split_batch) and first input's shape of one batch as a generator yields it."""
    parts = item if isinstance(item, tuple) else (item,)
    first = next(leaves(parts[0]), None)
    return _rows(first), split_batch(item), _dims(getattr(first, "shape", None))


def pydataset_first(dataset: Dataset) -> NotebookValue:
    """A PyDataset's first batch (its `__getitem__(0)`: Keras asks for it too, before the first epoch, to learn the
    batch's structure), or None when it will not give one without error."""
    try:
        return dataset[0]
    except Exception as exc:  # noqa: BLE001 - an empty PyDataset, or one that needs its epoch started
        fallback(_log, "a PyDataset's first batch could not be read: its batch is unknown", exc)
        return None


def spy_generator(
    generator: Iterator[NotebookValue], on_first: Callable[[NotebookValue], None]
) -> Iterator[NotebookValue]:
    """Yields what `generator` yields, telling `on_first` about the first batch (a generator cannot be peeked
    without consuming it, and Keras takes it only once)."""
    first = True
    for item in generator:
        if first:
            first = False
            try:
                on_first(item)
            except Exception as exc:  # noqa: BLE001 - describing the batch must never break the user's training
                fallback(_log, "a fed batch could not be described", exc)
                pass
        yield item


def describe_feed(call: str, named: dict[str, Any]) -> Feed:
    """What the call was fed, from its arguments bound by name."""
    x = named.get("x")
    feed = Feed()
    if x is None:
        return feed
    if is_dataset(x):
        feed.kind, feed.dataset = "dataset", x
        feed.batch_size, feed.batch_source = dataset_batch(x)
        feed.structure = split_batch(getattr(x, "element_spec", None))
        first = next(leaves(getattr(x, "element_spec", None)), None)
        feed.input_shape = _dims(getattr(first, "shape", None))
    elif inspect.isgenerator(x):
        feed.kind = "generator"
    elif is_pydataset(x):
        feed.kind = "pydataset"
        size = getattr(x, "batch_size", None)
        if isinstance(size, int) and size > 0:
            feed.batch_size, feed.batch_source = size, "the PyDataset's batch_size"
        first = pydataset_first(x)
        if first is not None:
            rows, feed.structure, feed.input_shape = batch_of(first)
            if feed.batch_size is None and rows is not None:
                feed.batch_size, feed.batch_source = rows, "the PyDataset's first batch"
    else:
        _describe_arrays(call, named, feed)
    _describe_validation(named, feed)
    return feed


def _describe_arrays(call: str, named: dict[str, Any], feed: Feed) -> None:
    x = named.get("x")
    first = next(leaves(x), None)
    if first is None or getattr(first, "shape", None) is None:
        return
    feed.kind = "arrays" if _is_numpy(first) else "tensors"
    feed.input_shape = _dims(first.shape)
    rows = _rows(first)
    if call.endswith("_on_batch"):
        feed.batch_size, feed.batch_source, feed.samples = rows, "the batch handed in", rows
    else:
        given = named.get("batch_size")
        feed.batch_size, feed.batch_source = (
            (int(given), "batch_size argument") if given else (KERAS_DEFAULT_BATCH, "Keras' default for arrays (32)")
        )
    split = (
        float(named.get("validation_split") or 0.0) if call == "fit" and named.get("validation_data") is None else 0.0
    )
    train_rows = rows
    if rows is not None and split > 0:
        train_rows = int(math.floor(rows * (1.0 - split)))
        feed.validation = f"validation_split={split:g}: the last {rows - train_rows} of {rows} rows"
        feed.validation_samples = rows - train_rows
    if train_rows is not None and not call.endswith("_on_batch"):
        feed.samples = train_rows
        if feed.batch_size is not None:
            feed.batch_size = max(1, min(feed.batch_size, train_rows))  # fewer rows than the batch: one batch
    feed.structure = {role: spec_of(named.get(role)) for role in _ROLES}
    for role in _ROLES:
        for value in leaves(named.get(role)):
            if not _is_numpy(value):
                continue
            n = _rows(value)
            nbytes = int(value.nbytes)
            if split > 0 and n:
                keep = int(math.floor(n * (1.0 - split)))
                feed.arrays.append(InputArray(id(value), nbytes, role, nbytes // n * keep))
                feed.arrays.append(InputArray(id(value), nbytes, "validation " + role, nbytes // n * (n - keep)))
            else:
                feed.arrays.append(InputArray(id(value), nbytes, role, nbytes))


def _describe_validation(named: dict[str, Any], feed: Feed) -> None:
    data = named.get("validation_data")
    if data is None:
        return
    if is_dataset(data):
        feed.validation = "validation_data: a tf.data pipeline"
        return
    if inspect.isgenerator(data) or is_pydataset(data):
        feed.validation = "validation_data: batches from a generator"
        return
    parts = data if isinstance(data, tuple) else (data,)
    rows = None
    for role, part in zip(_ROLES, parts, strict=False):
        for value in leaves(part):
            rows = rows if rows is not None else _rows(value)
            if _is_numpy(value):
                feed.arrays.append(InputArray(id(value), int(value.nbytes), "validation " + role, int(value.nbytes)))
    feed.validation_samples = rows
    feed.validation = f"validation_data: {rows} rows" if rows is not None else "validation_data"

"""Names for the values tfmem handles that carry no type information, each with why it is `Any`.

TensorFlow, Keras, tf_keras, protobuf's generated messages and IPython's shell ship no types that mypy can use (see
pyproject's [tool.mypy]), and a notebook's namespace holds anything. A signature that names one of these aliases says
what the value is, where a bare `Any` said nothing; mypy still treats each as `Any` (but for one thing: an overloaded
call given an alias of Any picks its first overload, so `vars(shell)` reads as a class's mappingproxy). Where a
real type exists (a `Report`, `str | os.PathLike[str]`, a TypedDict of knobs), the signature uses it instead. A string
choice passed as a parameter is a `Literal` alias next to its constants (`core.options.Mode`,
`core.session.CalibrateMode`); the report's dataclasses keep `str`, as core/schema.py writes the JSON Schema from them.

Core layer: this module imports nothing of tfmem_magic and no third-party package.
"""

from __future__ import annotations

from typing import Any, TypeAlias

# --- untyped third-party objects -------------------------------------------------------------------------------
KerasModel: TypeAlias = Any  # a Keras 3 or tf_keras Model: neither ships type information
KerasLayer: TypeAlias = Any  # a Keras 3 or tf_keras Layer (a Model is one too): untyped, as above
KerasOptimizer: TypeAlias = Any  # a Keras 3 or tf_keras optimizer (or a loss-scale wrapper around one): untyped
# a tensor, variable, TensorSpec, TensorShape, dtype or a numpy array standing in for one: TensorFlow is untyped and
# the code reads them by duck typing (`.shape`, `.dtype`), so one name covers them
TFTensor: TypeAlias = Any
TFGraph: TypeAlias = Any  # a tf.Graph or FuncGraph: TensorFlow is untyped
# a tf.function, its concrete functions, or what tracing one passes around (function types, tracing options):
# TensorFlow is untyped
TFFunction: TypeAlias = Any
Dataset: TypeAlias = Any  # a tf.data.Dataset, Keras PyDataset or tf_keras Sequence: untyped, told apart at run time
ProtoMessage: TypeAlias = Any  # a protobuf message (XSpace, XPlane, a RunMetadata): generated classes carry no types
# IPython's InteractiveShell (or ipykernel's), where tfmem patches its methods on the instance (which the typed
# class refuses) or reads what only a kernel's shell has (`.kernel`)
IPythonShell: TypeAlias = Any

# --- values of the user's -----------------------------------------------------------------------------------------
# any object the user's namespace or code holds, or passes through us to Keras (fit's x, y, *args, **kwargs): there
# is no narrower type to say
NotebookValue: TypeAlias = Any

# --- JSON --------------------------------------------------------------------------------------------------------
# a value json.dumps writes as it is: the recursive union, so that mypy checks what goes into a report's JSON
JSONValue: TypeAlias = "dict[str, JSONValue] | list[JSONValue] | str | int | float | bool | None"
# JSON read back and consumed by the keys and shapes it is known to have (a batch structure of feeding.spec_of's, a
# saved report, a probe's answer): the recursive union above would need a cast at every index, so it is Any
ParsedJSON: TypeAlias = Any

"""The Report: one plain, JSON-serializable object that every surface renders (schema `tfmem.report/1`).

Bytes are ints and times are seconds. Keys named in docs/design.md, 'Report contract' are a contract: add freely,
never rename without bumping SCHEMA.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tfmem_magic.core.types import ParsedJSON

SCHEMA = "tfmem.report/1"
MIME_TYPE = "application/vnd.tfmem.report+json"


@dataclass
class ErrorSite:
    """The line of the user's code that made an OOM's failing request (analyze/lines.py `error_site`,
    docs/lines.md). A graph op is named from the stack TensorFlow kept for its node, as the by-line view names it; an
    eager op (or a graph op whose node was not found) from the innermost frame of the user's code in the error's
    traceback (`via`)."""

    label: str = ""  # "In [3] line 2" (a notebook cell: the cell the code is in), "train.py:12"
    code: str | None = None  # the line's text
    file: str | None = None
    line: int | None = None
    # "graph node" (the failing node's stack), "traceback" (the error's traceback: for a graph op not found, the
    # line that called the function, not the op's own line)
    via: str = "graph node"
    layer: str | None = None  # the layer whose op it was, where its path names one
    made_by: str | None = None  # the line that made that layer (a built-in layer's op is named by it)


@dataclass
class ErrorInfo:
    type: str
    message: str
    request: dict[str, Any] | None = None  # an OOM's failed request: shape, dtype, bytes, device, allocator, op
    site: ErrorSite | None = None  # an OOM's: the line of the user's code that made the failing request


@dataclass
class GuardInfo:
    """The memory limit in force for the cell, and what enforced it (see guard.py)."""

    limit_bytes: int
    source: str  # "--limit" | "%tfmem limit"
    layers: list[str] = field(default_factory=list)  # "allocator", "batch-end check", "watchdog"
    allocator_limit_bytes: int | None = None
    # the layer that stopped the cell; "allocator" for TF's own OOM error ("GPU_0_bfc allocator (the GPU's own
    # memory)" when a GPU's allocator refused)
    tripped_by: str | None = None
    tripped_rss_bytes: int | None = None


@dataclass
class EnvInfo:
    tensorflow: str | None = None
    keras: str | None = None  # the version of the Keras `tf.keras` is (keras_package)
    keras_package: str = "keras"  # "keras" (Keras 3) | "tf_keras" (Keras 2, TF_USE_LEGACY_KERAS=1)
    python: str = ""
    platform: str = ""
    allocator: str = "none"
    allocator_complete: bool = False
    allocator_note: str | None = None
    devices: list[str] = field(default_factory=list)
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    cgroup_limit_bytes: int | None = None
    budget_bytes: int = 0
    budget_source: str = "ram"  # "cgroup" | "ram" | "user"
    mixed_precision_policy: str | None = None
    # the most TensorFlow's allocator of each GPU may hand out (its BFC limit, from the trace's events: in use +
    # available): a GPU's budget, separate from the host's (budget_bytes, which process memory counts against)
    device_limit_bytes: dict[str, int] = field(default_factory=dict)
    tensorflow_started_in_cell: bool = False  # TF's runtime (~0.5 GiB of RSS) came up during this cell

    @property
    def keras_text(self) -> str:
        """ "3.15.1", "2.21.0 (tf_keras)" or "-"."""
        if not self.keras:
            return "-"
        return f"{self.keras} (tf_keras)" if self.keras_package == "tf_keras" else self.keras

    @property
    def partial_allocator(self) -> bool:
        """TensorFlow's CPU allocator was not BFC: part of its memory is invisible ("none"/"unknown": no
        allocator to speak of)."""
        return not self.allocator_complete and self.allocator not in ("none", "unknown")

    @property
    def allocator_misses(self) -> str:
        """What a partial allocator does not show, in words."""
        return "keeps no statistics at all" if self.allocator == "cpu" else "tracks only allocations of 256 KiB or more"


@dataclass
class RssInfo:
    baseline_bytes: int = 0
    peak_bytes: int = 0  # exact kernel high-water mark (VmHWM) where Linux allows resetting it, else sampled
    end_bytes: int = 0
    peak_source: str = "sampled"  # "hwm" | "sampled"
    samples: list[list[float]] = field(default_factory=list)  # [[t, bytes], ...], at most a few thousand


@dataclass
class DeviceMemory:
    baseline_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    samples: list[list[float]] = field(default_factory=list)  # [[t, live bytes], ...] sampled with RSS
    # TensorFlow's own peak counter (get_memory_info) before tfmem reset it for this cell; TF cannot set it back
    peak_before_bytes: int | None = None
    # a saved trace's: the allocator's peak since its process started (or its stats were last reset), as the trace's
    # events state it (BFC's peak_bytes_in_use); above peak_bytes where a moment before the trace (a first step's
    # autotuning, on a GPU) held more. None: not recorded, or not a saved trace (docs/gpu.md, "The first step")
    lifetime_peak_bytes: int | None = None


@dataclass
class LiveGroup:
    """Bytes live at the peak moment, grouped by one or more keys (op, layer, phase, dtype, shape)."""

    op: str | None = None
    layer: str | None = None
    phase: str | None = None
    bytes: int = 0
    requested_bytes: int = 0
    count: int = 0
    dtype: str | None = None
    shape: str | None = None


@dataclass
class LineTensor:
    """One of the largest tensors a line of code had live at the peak."""

    bytes: int = 0
    shape: str | None = None
    dtype: str | None = None
    op: str | None = None  # the op type that made it ("MatMul", "Tile")
    phase: str | None = None  # "forward", "backward", ...


@dataclass
class LineGroup:
    """Bytes live at the peak (or still live when the trace ended: `TraceInfo.held_at_end_by_line`), grouped by the
    line of the user's code that made them (analyze/lines.py, docs/lines.md). Bytes no line made are grouped under
    what they are (`kind`), never under a guessed line."""

    # "In [3] line 5" (a notebook cell: the cell the code is in), "train.py:12"; for the other kinds what the bytes
    # are: "Keras internals", "tf.data and the input pipeline", "eager ops", "XLA buffers", ...
    label: str = ""
    # "line" (a line of code made them: `code` is its text), "layer" (a built-in layer whose creation line was not
    # noted), "keras" (Keras' own step: loss, metrics, optimizer), "tf.data", "eager" (eager ops carry no stack in
    # the trace), "xla" (XLA's buffers carry no op names), "function" (a tf.function's own runtime allocations: its
    # folded constants, arguments), "unresolved" (a graph op not found in the functions that ran), "untagged" (an
    # allocation with no op name)
    kind: str = "line"
    code: str | None = None  # the line's text
    file: str | None = None  # the source file (a cell's file for a notebook line)
    line: int | None = None
    bytes: int = 0  # allocator chunk bytes
    requested_bytes: int = 0
    forward_bytes: int = 0  # of `bytes`, in the forward pass
    backward_bytes: int = 0  # of `bytes`, gradients of the same line's forward ops
    count: int = 0  # tensors
    layer: str | None = None  # the layer(s) whose tensors these are ("dense_1", "dense, dense_1")
    # the line that made that layer (a layer's tensors: for a built-in layer it is the group's own line), and its text
    made_by: str | None = None
    made_by_code: str | None = None
    tensors: list[LineTensor] = field(default_factory=list)  # the largest few, largest first


@dataclass
class InputCopy:
    """A whole array handed to fit/evaluate/predict, copied into a tensor (Keras does this for numpy inputs)."""

    bytes: int
    requested_bytes: int
    start_s: float
    end_s: float | None  # None: still held when the trace ended
    live_at_peak: bool
    role: str = "training"  # "training" | "validation" (fit's validation_split rows or validation_data arrays)


@dataclass
class AllocatorUse:
    """One of the trace's allocators (a GPU trace has one per GPU, plus pinned host memory): the breakdown is about
    the first, the main device's; the others are listed, never mixed in."""

    name: str = ""
    device: str | None = None  # "GPU:4" for GPU_4_bfc, "CPU:0"; None: pinned host memory (gpu_host_bfc)
    events: int = 0
    peak_bytes: int = 0
    # in use + available + reserved (BFC's bytes_available leaves its reserved bytes out): the most it may hand out
    # (a GPU's memory for TensorFlow)
    limit_bytes: int | None = None
    timeline: list[list[float]] = field(default_factory=list)  # [[t, in use], ...]: a second series, downsampled


@dataclass
class TraceInfo:
    events: int = 0  # memory events analysed
    peak_live_bytes: int = 0  # allocator bytes in use at the trace's peak (pre-existing bytes included)
    peak_requested_bytes: int = 0  # peak of the bytes requested by the cell's own allocations (pre-existing excluded)
    peak_time_s: float = 0.0
    timeline: list[list[float]] = field(default_factory=list)  # [[t, live_bytes], ...], downsampled, peak kept
    preexisting_bytes: int = 0  # live before the trace began (weights and slots from earlier cells, ...)
    allocated_at_peak_bytes: int = 0  # allocator chunk bytes of the cell's own allocations live at the peak
    requested_at_peak_bytes: int = 0  # the same allocations' requested bytes: the gap is fragmentation/rounding
    at_peak: list[LiveGroup] = field(default_factory=list)
    by_layer: list[LiveGroup] = field(default_factory=list)
    by_op: list[LiveGroup] = field(default_factory=list)
    by_phase: list[LiveGroup] = field(default_factory=list)
    input_copies: list[InputCopy] = field(default_factory=list)
    allocator: str | None = None
    allocators: list[AllocatorUse] = field(default_factory=list)  # every allocator traced, `allocator` first
    covered_s: float = 0.0  # seconds of the cell the trace covers
    windows: list[list[float]] = field(default_factory=list)  # [[start, end], ...] traced, seconds from the start
    complete: bool = True  # False when the trace was bounded (see note)
    budget_spent: bool = False  # the trace stopped for its memory budget: later steps' insides were never seen
    # the profiler's own memory: xplane bytes it recorded, and the process memory that costs at its high-water mark
    # (TensorFlow's recorder and export hold ~22-27x the xplane: tracer.py). Never the cell's memory.
    profiler_bytes: int = 0
    profiler_rss_bytes: int = 0
    # requested bytes live at the peak in tensors with the batch dimension, and that dimension: one replica's batch
    # (ModelInfo.replica_batch), named apart from ModelInfo.batch_size, the global batch
    batch_bytes_at_peak: int | None = None
    replica_batch_size: int | None = None
    # ... and the most such bytes live at any one moment of the trace (the peak can come while few are live)
    batch_bytes_most: int | None = None
    # the allocator's bytes in use at that moment (pre-existing included, as peak_live_bytes): the gap to the peak is
    # what that moment's line starts below the peak's at the cell's batch (prediction.analytic_basis, moment_gap)
    live_at_batch_most_bytes: int | None = None
    # the moments that would be the step's peak at smaller batches (analysis._moments_below): [[requested bytes in
    # tensors with the batch dimension, allocator bytes in use], ...]; a line each below the cell's batch
    moments_below: list[list[int]] = field(default_factory=list)
    # XLA: runs of compiled computations in the trace (a jit_compile step, an auto-clustered launch; 0: none seen),
    # and the bytes their buffers (op "XLA computation", in no layer) held at the peak
    xla_runs: int = 0
    xla_at_peak_bytes: int = 0
    # the cell's own allocations still live when the trace ended (never freed in the cell), grouped by op, layer,
    # phase, dtype and shape as `at_peak` is; an allocation made while the trace was paused is in no group
    held_at_end: list[LiveGroup] = field(default_factory=list)
    held_at_end_bytes: int = 0
    note: str | None = None
    # the cell's traced bytes live at the peak grouped by the line of code that made them (analyze/lines.py), largest
    # first; the bytes of them that a line of code named; what could not be named and why. Empty without a trace of
    # graph ops, or where TensorFlow's stacks cannot be read
    by_line: list[LineGroup] = field(default_factory=list)
    by_line_named_bytes: int = 0
    by_line_note: str | None = None
    # `held_at_end` grouped by the line of code that made it, as `by_line` groups the peak (the leak findings name
    # these lines where the trace covered the whole cell)
    held_at_end_by_line: list[LineGroup] = field(default_factory=list)


@dataclass
class GpuPreflight:
    """The pre-flight's judgement of the GPU a call's steps run on: its probes ran on the CPU (they never need the
    GPU the kernel holds), and their step is modelled for the GPU as `predict(report, gpu=...)` models a CPU report
    (advise/gpu_target.py): the step's tensors, and a whole cuDNN workspace cap beside them for "fits"."""

    device: str  # "GPU:0"
    limit_bytes: int  # its allocator's limit
    in_use_bytes: int  # TF's bytes in use on it when the call began: the step's tensors come on top
    workspace_cap_bytes: int = 0  # what one cuDNN workspace may take (TF_CUDNN_WORKSPACE_LIMIT_IN_MB, 0 allowed)
    # whether the step may run a cuDNN convolution (gpu_target.step_convolves; unknown: it may): the first step's
    # allowance applies, its output copy and redzones too where the user set the cap to 0
    convolves: bool = True
    # the largest input + output per sample of a layer that is or may hold a convolution (where none may, of any
    # layer): the first step's autotuner holds a copy of a convolution's output beside its trial workspace
    conv_io_bytes_per_sample: int = 0
    extra_bytes: int = 0  # what the call adds on the GPU besides its step: slots it builds that the step does not hold
    model_known: bool = True  # False: the model's layers could not be read; never "fits" (its convolutions unknown)
    step_bytes: int = 0  # the step's tensors at the call's batch (the probes' replay)
    verdict: str = ""  # "fits" | "refused" | "uncertain", the GPU's alone
    largest_batch: int | None = None  # the largest batch whose tensors' upper estimate and the cap fit, as typed

    @property
    def room(self) -> int:
        """What the step may take on the GPU: its limit less what TensorFlow held there when the call began."""
        return max(0, self.limit_bytes - self.in_use_bytes)


@dataclass
class PreflightInfo:
    """The pre-flight of a fit/evaluate/predict under a memory limit: a clone of the model ran its steps at two small
    batches in another process, and the step replay of their allocations (or, where it could not be used, the line
    through their peaks) predicted the call's step at its own batch."""

    call: str  # "fit" | "evaluate" | "predict"
    batch_size: int
    probe_batches: list[int] = field(default_factory=list)
    step_bytes: int = 0  # the TF allocator's growth one step needs at batch_size (predicted, chunk bytes)
    extra_bytes: int = 0  # what the call adds besides its steps: weights or slots it builds, fit's copy of arrays
    rss_bytes: int = 0  # the process memory at the start of the call
    predicted_rss_bytes: int = 0  # rss_bytes + step_bytes + extra_bytes
    threshold_bytes: int = 0  # what the guard lets the process reach (the limit, or the cell's start + margin)
    band: float = 0.0  # how far over the prediction the process may grow: its high end ("fits", the largest batch)
    # how far under it (its low end, which must pass the threshold for a refusal); 0: `band` both ways
    band_below: float = 0.0
    verdict: str = ""  # "fits" | "refused" | "uncertain" (within the band: the call runs, the guard watches)
    # "replay" (two probe traces of a clone replayed through the BFC simulator at the call's batch), "probes" (the
    # line through two probe steps' peaks), or "model" (the model's own parts showed it fits with room to spare: no
    # probes were run)
    basis: str = "probes"
    replay_note: str = ""  # why the replay was not used, where the probes' line stood in
    # how the inputs' open dimensions (a padded or ragged pipeline's lengths) were read for the probes: "" where none
    fed_note: str = ""
    kept: bool = False  # judged from the replay kept from an earlier refusal of this model and inputs (no probes)
    # the model's own step the probes ran, where a clone's fit would not train it ("GAN.train_step"); "": a clone's
    own_step: str = ""
    largest_batch: int | None = None  # the largest batch whose upper estimate fits, as people type it
    # a refusal's largest batch as it would be judged without the regions TF's allocator holds beyond its bytes in
    # use (a kernel restart gives them back), where that is larger: docs/preflight.md, "After a restart"
    restart_batch: int | None = None
    seconds: float = 0.0  # what the pre-flight cost (the probe process, TensorFlow's start-up included)
    tf_bytes: int = 0  # TF's allocator in use (its main device) when the call began: the step's growth starts there
    reusable_bytes: int = 0  # TF's regions held then beyond that (its peak so far): filled before the process grows
    # the least the step holds by the model's own layer outputs at batch_size (advise/preflight.parts_floor): "fits"
    # and largest_batch never count less, where a prediction is below it (0: the model could not be described)
    floor_bytes: int = 0
    # a refused call's step replay, at the batches replayed (advise/preflight.refused_basis: the report's what-if)
    replay: ReplayCurve | None = None
    # a refusal's replayed peak at batch_size, by the line of code that made it (docs/lines.md, "The lines of a
    # refusal"): a layer's tensors by the line that made the layer; the rest by what they are. Empty where the
    # replay was not used, or it was kept from an earlier refusal
    by_line: list[LineGroup] = field(default_factory=list)
    # on a GPU: the GPU's own judgement (the verdict and the largest batch above are the stricter of it and the
    # process's); None on a CPU
    gpu: GpuPreflight | None = None


@dataclass
class LayerInfo:
    name: str
    type: str
    params: int = 0
    output_shape: str | None = None
    activation_bytes_per_sample: int = 0
    # what the layer keeps per sample for its backward pass beyond its output, training only (a recurrent layer's
    # gates and states of every time step): measured per layer kind, counted once (see analyze.modelinfo)
    kept_bytes_per_sample: int = 0
    input_bytes_per_sample: int = 0  # its (first) input's bytes per sample: a convolution's workspace is sized on both


@dataclass
class ModelInfo:
    name: str
    params: int = 0
    trainable_params: int = 0
    param_bytes: int = 0
    optimizer: str | None = None
    optimizer_slots: int = 0  # variables the optimizer holds per trainable variable (Adam: 2)
    optimizer_bytes: int = 0
    batch_size: int | None = None
    input_shape: str | None = None
    dtype_policy: str | None = None
    calls: list[str] = field(default_factory=list)  # "fit", "predict", "__call__", ...
    layers: list[LayerInfo] = field(default_factory=list)
    trainable_bytes: int = 0  # bytes of the trainable variables: the size of one set of gradients
    samples: int | None = None  # rows of the numpy arrays handed to fit/evaluate/predict
    input_array_bytes: int = 0  # their bytes (x and y): fit copies them whole into tensors
    new_weight_bytes: int = 0  # bytes of the model's weights created during the cell (part of its peak)
    optimizer_built_in_cell: bool = False  # the optimizer's slots were created during the cell
    batch_source: str | None = None  # how the batch was read ("batch_size argument", "the dataset's .batch()", ...)
    feed: str = "none"  # what the training (or main) call was fed: "arrays", "tensors", "dataset", "generator", ...
    validation: str | None = None  # what fit validated on, in words; None: no validation
    input_copy_bytes: int = 0  # the tensor copy Keras makes of the training arrays (training rows only)
    validation_copy_bytes: int = 0  # the same for the validation arrays (or the validation_split rows)
    other_models: list[str] = field(default_factory=list)  # other models the cell used, in words
    keras_package: str = "keras"  # the Keras that made the model: "keras" (Keras 3) | "tf_keras" (Keras 2)
    jit_compile: bool = False  # its train/test/predict steps run as XLA computations (Keras' jit_compile)
    # replicas of a tf.distribute strategy the model trained under (this process runs one of them, or several
    # GPUs' worth): `batch_size` is the global batch, each replica runs batch_size / replicas
    replicas: int = 1
    # several optimizers that update the model's weights (a GAN's train_step with d_optimizer and g_optimizer):
    # "d_optimizer: Adam", ...; empty when one optimizer (or none) trains it. `optimizer` is then their common class
    # (or "Adam + SGD"), and optimizer_slots / optimizer_bytes count all of them
    optimizers: list[str] = field(default_factory=list)

    @property
    def optimizer_text(self) -> str:
        """ "Adam", "Adam ×2 (d_optimizer, g_optimizer)" when several train the model, or "none"."""
        if len(self.optimizers) > 1:
            labels = ", ".join(o.split(":", 1)[0] for o in self.optimizers)
            return f"{self.optimizer} ×{len(self.optimizers)} ({labels})"
        return self.optimizer or "none"

    @property
    def legacy_keras(self) -> bool:
        return self.keras_package == "tf_keras"

    @property
    def batch_text(self) -> str:
        """'256', or '256 (128 per replica of 2)' under a tf.distribute strategy; '?' when unknown."""
        if not self.batch_size:
            return "?"
        return f"{self.batch_size}" + (
            f" ({self.replica_batch} per replica of {self.replicas})" if self.replicas > 1 else ""
        )

    @property
    def replica_batch(self) -> int | None:
        """The samples one replica runs per step: the batch its tensors carry."""
        if not self.batch_size:
            return self.batch_size
        return max(1, self.batch_size // max(1, self.replicas))

    @property
    def training(self) -> bool:
        """fit/train_on_batch, or a custom loop whose optimizer updated this model's weights."""
        return any(c in ("fit", "train_on_batch", "optimizer.apply") for c in self.calls)

    @property
    def copy_bytes(self) -> int:
        """The tensor copy Keras makes of the training arrays (the arrays' size in reports from before the copy's
        own size was recorded)."""
        return self.input_copy_bytes or self.input_array_bytes

    @property
    def fed_arrays(self) -> bool:
        """fit/evaluate/predict ran on the cell's data: Keras' input pipeline (a copy of numpy arrays, prefetched
        batches) is part of the peak."""
        return any(c in ("fit", "evaluate", "predict") for c in self.calls)

    @property
    def activation_bytes_per_sample(self) -> int:
        return sum(layer.activation_bytes_per_sample for layer in self.layers)


@dataclass
class Finding:
    id: str
    title: str
    severity: str  # "info" | "warn" | "critical"
    evidence: str
    bytes: int | None = None
    fixes: list[str] = field(default_factory=list)
    holders: list[str] = field(default_factory=list)  # the names it says hold memory (their fix drops them)


@dataclass
class Fix:
    id: str
    title: str
    why: str
    code: str
    predicted_peak_bytes: int | None = None
    needs_restart: bool = False
    placement: str = "below"  # "below" the profiled cell, or "top" of the notebook (fixes that need a restart)


@dataclass
class BeforeAfter:
    """A fix cell's report compared with the report it fixes (`%%tfmem --before N --fix ID`)."""

    number: int  # the earlier report's history number
    label: str
    status: str
    tf_peak_bytes: int | None
    rss_peak_bytes: int
    wall_s: float
    fix_id: str | None = None
    predicted_peak_bytes: int | None = None  # what the earlier report's fix predicted for this cell
    error_band: float | None = None
    held: bool | None = None  # the measured peak came within the band of the prediction
    # why the prediction was not judged: the kernel changed since the earlier report (another fix ran, weights or
    # optimizer slots built since now sit in the baseline), so the two cells do not start from the same state
    kernel_changed: str | None = None


@dataclass
class Prediction:
    basis: str  # "replay" | "measured" | "analytic"
    static_bytes: int
    per_sample_bytes: int
    fragmentation_ratio: float
    error_band: float


@dataclass
class Knobs:
    """The settings a what-if changes (advise/prediction.py, predict)."""

    batch_size: int
    policy: str = "float32"
    optimizer: str | None = None  # lowercase name in OPTIMIZER_SLOTS
    accumulation_steps: int = 1
    input_scale: float = 1.0  # times the input elements per sample (2 = twice the pixels)
    # data-parallel replicas (tf.distribute: GPUs or workers) sharing the batch: the prediction is one replica's
    replicas: int = 1

    @property
    def split(self) -> int:
        """How many parts one batch is cut into: accumulation steps times replicas."""
        return max(1, self.accumulation_steps) * max(1, self.replicas)


@dataclass
class ReplayCurve:
    """The step replay (analyze/step_replay.py): the model's allocation sequence, traced from a fresh allocator at two
    odd probe batches, replayed through the BFC simulator at a grid of batches. Stored with the basis, so a saved
    report predicts as the live one; advise/prediction.py interpolates it and anchors it on the cell's peak."""

    probes: list[int]  # the two probe batches (one step each, after a first one); a saved trace's: its one batch
    events: int  # probe one's memory events
    allocations: int
    aligned: int  # of which found their match in probe two's trace
    own_error: float  # the larger of the probes' sequences replayed as traced, against their traced peaks
    # the larger of: one probe's sequence at the other's sizes, against the other's traced peak (the op order's part)
    cross_error: float
    traced_peaks: list[int]  # each probe's traced peak (bytes in use, from its allocator's start)
    batches: list[int] = field(default_factory=list)  # the grid (one step's batch: a micro-batch)
    peaks: list[int] = field(default_factory=list)  # the simulated allocator peak (bytes in use) at each, probe one's
    second_peaks: list[int] = field(default_factory=list)  # ... and in probe two's op order (its sequence)
    region_peaks: list[int] = field(default_factory=list)  # the simulated bytes held in regions (what RSS sees)
    passed: bool = False  # the self-check passed: the curve is used
    why_not: str = ""  # why not, when it did not
    seconds: float = 0.0  # the probe processes' and the replays' time
    retried: bool = False  # the first probes' self-check failed, and the probes ran once more
    # "probes" (two fresh-process probe traces of a clone, aligned), "step" (the same, of the cell's own training
    # step: advise/step_export.py) or "trace" (one saved trace, its batch-shaped allocations scaled:
    # `step_replay.trace_curve`)
    source: str = "probes"
    scaled: int = 0  # a saved trace's allocations whose shape carries the batch (the ones that were scaled)
    # of probe one's unmatched allocations, those the alignment's share leaves out (step_replay.Lines.negligible)
    negligible: int = 0
    # ... and those whose size at any batch is known all the same, counted as matched in the share (no batch in their
    # shape, or a matched allocation of their op, dtype and shape: step_replay.Lines.sized)
    sized: int = 0
    # a saved trace that begins mid-run, whose sequence the simulator could not give back: its chunks summed over the
    # bytes in use at its start instead, without the allocator's placement (step_replay.SummedTrace)
    summed: bool = False
    # whether the probes' graphs hold a convolution's op (gpu_target.types_convolve of `traced_op_types`): what a
    # GPU's what-if judges its workspace by, before the report's layers (None: not read, or not the call's step)
    convolves: bool | None = None


@dataclass
class Basis:
    """How the cell's peak splits, in requested bytes, at the cell's own settings: what the what-if predicts from
    (advise/prediction.py). Stored on the report (`Report.whatif_basis`), so a saved report predicts as the live one."""

    name: str  # "analytic" | "measured" (calibrated) | "replay" (calibrated, its step replay passed)
    weights: int
    gradients: int
    optimizer: int
    input_copy: int
    activations_per_sample: float  # the slope at and above the cell's batch
    input_per_sample: float
    other: int  # the measured peak that the parts above do not explain (can be negative: they over-explain)
    fragmentation: float
    measured_peak: int | None  # the anchor (TF peak over baseline), None when TF's allocator was not measured
    knobs: Knobs
    calibration: dict[str, Any] = field(default_factory=dict)
    activations_per_sample_below: float | None = None  # the slope below the cell's batch, when not the one above
    # the analytic basis, when its slope above is the trace's busiest moment's (not the peak's): how far below the
    # peak that moment was at the cell's batch (requested bytes). Above the batch the peak is the higher of the two
    # moments' lines, the peak's (slope below) and the busiest one's (slope above) from this much lower. 0: one line
    moment_gap: int = 0
    # the analytic basis: other moments of the step whose lines may be higher than the peak's below the cell's batch,
    # each [its slope (requested bytes per sample), how far below the peak it stood at the cell's batch (requested)]
    lines_below: list[list[float]] = field(default_factory=list)
    slope_source: str = "layer outputs"  # how the analytic slope was chosen (shown in notes)
    copy_missing: int = 0  # fit's copy of the arrays that this cell had freed before its peak (usually it is not)
    # allocator chunk bytes per requested byte for what a knob adds or removes (measured by the probes over their
    # span: large tensors get closer-fitting chunks than the cell's mix); None: the cell's own fragmentation
    increment_fragmentation: float | None = None
    # the analytic basis' ratio for what a knob adds (GROWTH_FRAGMENTATION, when the cell's trace measured a higher
    # ratio of its own); None: the cell's own fragmentation
    growth_fragmentation: float | None = None
    # the step replay (calibration's two fresh-process probes): the peak at any batch where its self-check passed
    replay: ReplayCurve | None = None
    # what `measured_peak` is: "cell", the cell's TF peak as measured; "preflight", the pre-flight's prediction of a
    # call it refused (TF in use as the call began plus the replayed step: nothing of the step ran to measure)
    anchor: str = "cell"


@dataclass
class Holder:
    """A name in the user's namespace that keeps TensorFlow memory alive (measure/holders.py)."""

    name: str  # as the user typed it: "models", "results", "Out"
    kind: str  # what the name is: "list", "dict", "History", "Keras model", "tensor", "function", a class's name
    bytes: int  # TensorFlow memory it reaches (variables, tensors, models' weights and slots), each buffer once
    new_bytes: int = 0  # of which this cell made
    models: list[str] = field(default_factory=list)  # the Keras models it reaches, by name
    model_bytes: list[int] = field(default_factory=list)  # each of those models' weights and optimizer variables
    tensors: int = 0  # eager tensors it reaches
    variables: int = 0  # variables it reaches outside any model
    paths: list[str] = field(default_factory=list)  # a path to each of the first things it holds: "results[4].model"
    shared_with: list[str] = field(default_factory=list)  # other names that reach some of the same memory


@dataclass
class HeldInfo:
    """What TensorFlow still held when the cell ended, and who holds it."""

    left_bytes: int | None = None  # the allocator's bytes in use at the end minus at the start (None: no statistics)
    holders: list[Holder] = field(default_factory=list)  # names that reach TensorFlow memory, largest first
    # variables kept alive only by TensorFlow's gradient registry (traced train steps of models that no name
    # reaches any more: docs/held-memory.md): their bytes, and the registry entries that hold them
    runtime_bytes: int = 0
    runtime_entries: int = 0
    runtime_new_bytes: int = 0  # how much of runtime_bytes became held only by the registry during this cell
    complete: bool = True  # False: the walk of the namespace ran out of time (a holder may be missing)


@dataclass
class CallRecord:
    """One fit/evaluate/predict/…_on_batch call of the cell (not the calls Keras nests in it), with what it left."""

    call: str
    model: str | None = None
    start_s: float = 0.0  # seconds from the cell's start
    end_s: float = 0.0
    tf_before_bytes: int | None = None  # TensorFlow's allocator in use at the call's start and end (None: no stats)
    tf_after_bytes: int | None = None
    rss_before_bytes: int = 0
    rss_after_bytes: int = 0
    output_bytes: int = 0  # the numpy arrays the call returned (predict's outputs): the user's, not a leak


@dataclass
class Report:
    label: str = ""
    # "ok" | "error" | "oom" | "refused" (the pre-flight stopped a call before its first step) | "interrupted"
    status: str = "ok"
    error: ErrorInfo | None = None
    mode: str = "trace"  # "quick" | "trace"
    wall_s: float = 0.0
    env: EnvInfo = field(default_factory=EnvInfo)
    rss: RssInfo = field(default_factory=RssInfo)
    tf: dict[str, DeviceMemory] = field(default_factory=dict)
    trace: TraceInfo | None = None
    model: ModelInfo | None = None
    findings: list[Finding] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    prediction: Prediction | None = None
    # what the what-if predicts from: the analytic basis when the report was built, the measured one once calibrated
    # (advise/calibration.py); None: derived from the report when asked (a report saved before it was stored)
    whatif_basis: Basis | None = None
    guard: GuardInfo | None = None
    preflight: PreflightInfo | None = None  # the last pre-flight of the cell (see advise/preflight.py)
    held: HeldInfo | None = None  # what TensorFlow still held at the cell's end, and who holds it
    calls: list[CallRecord] = field(default_factory=list)  # the cell's Keras calls, in order
    before: BeforeAfter | None = None  # set when this cell ran a fix: the report it is compared with
    number: int = 0  # position in this session's history (1 = first report), stable while the kernel lives
    cell_key: str | None = None  # the same cell across re-runs (Jupyter's cell id, else a hash of its source)
    run: int = 1  # how many times this cell has been profiled, this one included
    tf_function_traces: dict[str, int] = field(default_factory=dict)  # tf.function name -> graphs traced
    # tf.function name -> input signatures that grow with the calls (a variable-creating first call's second trace
    # and a partial last batch are not growth: measure/instrument.py, growing_signatures)
    tf_function_signatures: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was degraded or skipped, in plain words
    started_at: float = 0.0  # time.time() when the cell started
    schema: str = SCHEMA

    # -- convenient views -------------------------------------------------------------------------------------
    @property
    def main_device(self) -> DeviceMemory | None:
        """The TF device the headline numbers are about (see main_device_name)."""
        name = main_device_name(self.tf)
        return self.tf[name] if name is not None else None

    @property
    def main_device_name(self) -> str | None:
        return main_device_name(self.tf)

    @property
    def on_gpu(self) -> bool:
        """The report is about a GPU (its budget, the guard's layers and the fixes differ from a CPU's)."""
        return (self.main_device_name or "").startswith("GPU:")

    @property
    def sampled_device(self) -> tuple[str, DeviceMemory] | None:
        """The device whose live bytes were sampled over time: the main one, else the one the sampler chose before
        the cell (the first GPU, when another GPU turned out the busiest)."""
        name = self.main_device_name
        if name is not None and self.tf[name].samples:
            return name, self.tf[name]
        return next(((n, m) for n, m in self.tf.items() if m.samples), None)

    @property
    def device_budget(self) -> tuple[str, int] | None:
        """(main device, its allocator's limit) when the main device has a budget of its own (a GPU, traced)."""
        name = self.main_device_name
        if name is None:
            return None
        limit = self.env.device_limit_bytes.get(name)
        return (name, limit) if limit else None

    @property
    def stopped_for_memory(self) -> bool:
        """The cell ran out of memory, or its pre-flight refused a call that would have: both want less memory."""
        return self.status in ("oom", "refused")

    @property
    def tf_peak_bytes(self) -> int | None:
        """Peak over the cell's baseline on the main TF device, the quantity predictions target."""
        mem = self.main_device
        return None if mem is None else mem.peak_bytes - mem.baseline_bytes

    # -- serialization ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        # schema first: readers dispatch on it
        return {"schema": out.pop("schema"), **out}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(indent=1))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        schema = data.get("schema")
        if schema != SCHEMA:
            raise ValueError(f"not a {SCHEMA} report (schema is {schema!r})")
        trace = data.get("trace")
        if isinstance(trace, dict) and "batch_size" in trace:  # saved before it was named replica_batch_size
            data = {**data, "trace": {"replica_batch_size": trace["batch_size"], **trace}}
        return _build(cls, data)

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> Report:
        return cls.from_json(Path(path).read_text())


COMPACTED_NOTE = (
    "The history keeps this report without its time series (the timelines and the RSS and allocator samples): "
    "it is older than the newest reports, which keep theirs. Every number, breakdown, finding, fix and the what-if "
    "are whole."
)


def compacted(report: Report) -> Report:
    """A copy of `report` for the history once newer reports have come (core/session.py, WHOLE_REPORTS): the same
    report without its time series, which only its charts draw (%tfmem history, compare, --before and the what-if
    read none of them). The parts it keeps are shared with `report`, not copied; `report` itself is not changed (a
    name bound with --as keeps the whole report)."""
    copy = dataclasses.replace(report)
    copy.rss = dataclasses.replace(report.rss, samples=[])
    copy.tf = {name: dataclasses.replace(mem, samples=[]) for name, mem in report.tf.items()}
    if report.trace is not None:
        copy.trace = dataclasses.replace(
            report.trace,
            timeline=[],
            allocators=[dataclasses.replace(a, timeline=[]) for a in report.trace.allocators],
        )
    copy.notes = [*report.notes, COMPACTED_NOTE]
    return copy


def footprint(value: object) -> int:
    """The bytes a report (or any value made of dataclasses, lists, dicts, strings and numbers) holds in this
    process: sys.getsizeof over everything it reaches, each object once. An estimate: CPython shares small ints
    and interned strings, counted here as the report's own."""
    seen: set[int] = set()
    todo = [value]
    total = 0
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            instance_dict = getattr(item, "__dict__", None)
            if instance_dict is not None:
                todo.append(instance_dict)
            else:
                todo.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    return total


T = TypeVar("T")


def file_stem(text: str, fallback: str, limit: int = 160) -> str:
    """`text` as a file or folder name that every file system and TensorBoard's run list take: letters, digits,
    `_ . -`, the rest replaced by `_`, at most `limit` characters; `fallback` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:limit] or fallback


def main_device_name(devices: Iterable[str] | Mapping[str, DeviceMemory]) -> str | None:
    """The one decision of which TF device the report is about: a GPU (where a user who has one trains), else
    CPU:0, else the first device named; None for none. Of several GPUs, the busiest (the most grown over its
    baseline: memory earlier cells left on another GPU is not this cell's) when their figures are given, else the
    first (the sampler, before the cell, knows names only). The headline numbers, the budget, the timeline, the
    trace's allocator and the trace's notes all follow it."""
    names = list(devices)
    gpus = sorted((d for d in names if d.startswith("GPU:")), key=lambda d: int(d.split(":")[1] or 0))
    if gpus and isinstance(devices, Mapping) and len(gpus) > 1:
        # a tie goes to the device named first (a saved trace names the allocator its breakdown is about first)
        return max(gpus, key=lambda d: (devices[d].peak_bytes - devices[d].baseline_bytes, -names.index(d)))
    if gpus:
        return gpus[0]
    return "CPU:0" if "CPU:0" in names else (names[0] if names else None)


def _build(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a dataclass from its asdict() form, following the field type hints; unknown keys are ignored."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
    return cls(**kwargs)


def _convert(hint: object, value: ParsedJSON) -> object:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(hint)
        return {k: _convert(item, v) for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)  # type: ignore[arg-type]
    return value

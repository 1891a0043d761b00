"""What a step measured on a CPU would need on a GPU: `predict(report, gpu="16GB")` (docs/gpu.md, "From a CPU run
to a GPU"). The step's tensors are the CPU prediction's (its basis and band), less what stays in host memory on a GPU
(fit's copy of numpy arrays); to them the GPU adds one cuDNN workspace at a time, whose size TensorFlow's autotuner
picks on the GPU itself: the peak shown carries a typical one, "fits" and the largest batch judge the cap
TensorFlow puts on it. The allocator's limit is reckoned from the card's memory as TensorFlow does at start-up."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.sizes import format_bytes, parse_size

if TYPE_CHECKING:
    from typing import Unpack

    from tfmem_magic.advise.prediction import WhatIf, WhatIfKnobs
    from tfmem_magic.core.report import ModelInfo, Report
    from tfmem_magic.core.types import KerasLayer, KerasModel

MIB = 2**20
# TF_CUDNN_WORKSPACE_LIMIT_IN_MB's default: 4 GiB per convolution (docs/gpu.md, "Workspaces")
DEFAULT_WORKSPACE_LIMIT_MB = 4096
# what the CUDA context takes before TensorFlow asks for free memory: 90 MiB on the public T4 traces' machine, more
# with newer CUDA; taken high, so that the limit reckoned is never above TensorFlow's
CONTEXT_BYTES = 512 * MIB
# the card's memory as nvidia-smi or a data sheet gives it can be above the total CUDA reports: that much more is
# taken off (docs/gpu.md, "From a CPU run to a GPU")
CARD_OVER_CUDA = 0.02
# the first step's autotuner checks each trial's buffers with redzones around them (RedzoneAllocator, 8 MiB a side):
# four beside the trial's workspace and its copy of the output
REDZONES_BYTES = 4 * 8 * MIB
# the largest cuDNN workspace of a step over its largest convolution's input + output bytes, on the public T4
# traces (docs/gpu.md, "From a CPU run to a GPU"): the peak shown carries it; no verdict rests on it
TYPICAL_WORKSPACE_PER_CONV_IO = 3.3
# how far below the prediction a GPU's step can be: the public T4 steps were up to 35% under what their CPU
# rebuilds predicted (docs/gpu.md, "From a CPU run to a GPU"): the band's low side
GPU_BELOW = 0.4
# the convolutions whose GPU kernels take a cuDNN workspace, as Keras names their layers
CONV_LAYERS = (
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
    "ConvLSTM1D",
    "ConvLSTM2D",
    "ConvLSTM3D",
)


def min_system_memory(available: int, compute_capability: float | None) -> int:
    """What TensorFlow leaves to the system of a GPU's free memory (`MinSystemMemory`,
    tensorflow/core/common_runtime/gpu/gpu_device.cc): 225 MiB under 2 GiB; else by the compute capability's major
    version, 500 MiB up to 6.x, 1050 to 7.x, 1536 to 8.x, 1800 above. Unknown: the most (the safe side)."""
    if available < 2**31:
        return 225 * MIB
    major = None if compute_capability is None else int(compute_capability)
    if major is None or major > 8:
        return 1800 * MIB
    return (500 if major <= 6 else 1050 if major <= 7 else 1536) * MIB


@dataclass(frozen=True)
class GpuTarget:
    """The GPU a CPU-measured step is predicted for: its memory (the card's, as `nvidia-smi` gives it), its compute
    capability where known (7.5 for a T4, 8.0 an A100, 9.0 an H100) and TF_CUDNN_WORKSPACE_LIMIT_IN_MB as it will be
    set there (TensorFlow's 4096 unless set)."""

    memory_bytes: int
    compute_capability: float | None = None
    workspace_limit_mb: int = DEFAULT_WORKSPACE_LIMIT_MB

    @property
    def limit_bytes(self) -> int:
        """The allocator's limit TensorFlow would set: the free memory at its start less `min_system_memory`."""
        available = round(self.memory_bytes * (1 - CARD_OVER_CUDA)) - CONTEXT_BYTES
        return max(0, available - min_system_memory(available, self.compute_capability))

    @property
    def workspace_cap_bytes(self) -> int:
        return self.workspace_limit_mb * MIB


def target_of(gpu: str | int | GpuTarget) -> GpuTarget:
    """`gpu` as `predict` takes it: a GpuTarget, or the card's memory ("16GB", bytes)."""
    if isinstance(gpu, GpuTarget):
        target = gpu
    else:
        try:
            target = GpuTarget(parse_size(gpu) if isinstance(gpu, str) else int(gpu))
        except (TypeError, ValueError) as exc:
            raise TfmemUsageError(f'gpu={gpu!r}: give the GPU\'s memory ("16GB") or a tfmem_magic.GpuTarget') from exc
    if target.memory_bytes < 2**30:
        raise TfmemUsageError(f'gpu={gpu!r}: a GPU\'s memory of at least 1 GiB, as nvidia-smi gives it ("16GB")')
    if target.workspace_limit_mb < 0:
        raise TfmemUsageError("GpuTarget.workspace_limit_mb: 0 or more MiB, as TF_CUDNN_WORKSPACE_LIMIT_IN_MB takes")
    return target


# Keras layers that run no convolution: a model made of these alone takes no cuDNN convolution workspace
NO_CONVOLUTION = frozenset(
    {
        "InputLayer", "Dense", "EinsumDense", "Dropout", "SpatialDropout1D", "SpatialDropout2D", "GaussianNoise",
        "Flatten", "Reshape", "Permute", "RepeatVector", "Activation", "ReLU", "LeakyReLU", "Softmax", "ELU",
        "BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization", "Normalization",
        "Rescaling", "Resizing", "CenterCrop", "RandomFlip", "RandomRotation", "RandomZoom", "RandomCrop",
        "RandomTranslation", "RandomContrast", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
        "AveragePooling1D", "AveragePooling2D", "AveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D",
        "GlobalMaxPooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
        "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D",
        "UpSampling1D", "UpSampling2D", "UpSampling3D", "Embedding", "Add", "Subtract", "Multiply", "Average",
        "Maximum", "Minimum", "Concatenate", "Dot", "MultiHeadAttention", "Attention", "AdditiveAttention",
        "LSTM", "GRU", "SimpleRNN", "Bidirectional", "StringLookup", "IntegerLookup", "TextVectorization",
        "Masking", "Identity", "LSTMCell", "GRUCell", "SimpleRNNCell", "StackedRNNCells", "RNN", "TimeDistributed",
    }
)  # fmt: skip
# what walking a model's layers passes through on the way to its own: their layers are walked themselves
CONTAINERS = frozenset({"Functional", "Sequential", "Model"})
# a TensorFlow op type that convolves: Conv2D, Conv3D, DepthwiseConv2dNative, their gradients
# (Conv2DBackpropInput / Filter, ...), the fused ones; a type that merely contains "Conv" (ConvertToCooTensor) counts
# too, on the safe side
CONV_TYPE = re.compile(r"Conv|Depthwise")


def _maybe_conv(kind: str) -> bool:
    """A layer that is, or may hold, a convolution: one, a model used as a layer, a wrapper or a custom layer."""
    return kind in CONV_LAYERS or kind not in NO_CONVOLUTION


def flat_layers(model: KerasModel) -> list[KerasLayer] | None:
    """Every layer a Keras model holds, walked as Keras walks them (a model used as a layer and a custom layer's own
    layers included); None where it cannot be walked."""
    try:
        return list(model._flatten_layers(include_self=False, recursive=True))
    except Exception:  # noqa: BLE001 - not a Keras model as known: its layers are unknown
        return None


def layer_kinds(model: KerasModel) -> list[str] | None:
    """The class names of `flat_layers`, sorted: what a probe's clone and the kernel's model are told apart by."""
    layers = flat_layers(model)
    return None if layers is None else sorted(type(la).__name__ for la in layers)


def types_convolve(types: Iterable[str] | None) -> bool | None:
    """What the op types of the graphs a step ran (`step_replay.op_types`: every function the probe process
    registered, read before Grappler fuses a convolution into an op named after its activation) say of its
    convolutions; None where they were not read."""
    if types is None:
        return None
    return any(CONV_TYPE.search(t) for t in types)


def traced_op_types(model: KerasModel, graphs: list[dict[str, list[str] | None]], own_step: bool) -> list[str] | None:
    """Every op type the probes' graphs hold (`step_replay.graph_of` of each probe's file); None where one was not
    read, or where a clone's layers are not the kernel model's (a config rebuilt without some of them: its graphs
    would not be the call's). `own_step`: the probes ran the model's own step, saved (no clone)."""
    types = [g.get("op_types") for g in graphs]
    if any(t is None for t in types):
        return None
    if not own_step:
        kernel = layer_kinds(model)
        if not kernel or any(g.get("layers") != kernel for g in graphs):
            return None
    return sorted({t for kinds in types for t in kinds or []})


def step_convolves(layers: list[KerasLayer] | None, types: bool | None) -> bool:
    """Whether a step may run a cuDNN convolution: yes where a convolution's layer is anywhere in the model
    (`flat_layers`) or the step's graphs hold a convolution's op (`types_convolve`: a custom layer's, a loss's, a
    train_step's own); where those graphs were read and hold none, no; else from the layers alone: no only where
    every one is of a kind known to run none (a custom layer, a `Lambda`, unknown layers: yes)."""
    own = None if layers is None else [la for la in layers if type(la).__name__ not in CONTAINERS]
    if types is True or (own is not None and any(_is_conv(la) for la in own)):
        return True
    if types is False:
        return False
    return own is None or not own or not all(_runs_none(la) for la in own)


def _is_conv(layer: KerasLayer) -> bool:
    """A convolution's layer, or a subclass of one (a weight-standardised Conv2D)."""
    return any(base.__name__ in CONV_LAYERS for base in type(layer).__mro__)


def _runs_none(layer: KerasLayer) -> bool:
    """A layer of Keras' own whose kind runs no convolution (a class of the user's named alike may)."""
    kind = type(layer)
    return kind.__name__ in NO_CONVOLUTION and kind.__module__.split(".")[0] in ("keras", "tf_keras", "tensorflow")


def report_convolves(report: Report) -> bool:
    """Whether a report's step may run a cuDNN convolution, as `step_convolves` judges a live model: yes where the
    probes' graphs (a calibration's or a refusal's replay: `ReplayCurve.convolves`) hold a convolution or a layer
    of the report is one; no where those graphs were read and hold none; else from the layers (`may_convolve`)."""
    from tfmem_magic.advise.prediction import basis_of

    replay = basis_of(report).replay
    said = replay.convolves if replay is not None else None
    layers = report.model.layers if report.model is not None else []
    if said is True or any(layer.type in CONV_LAYERS for layer in layers):
        return True
    return False if said is False else may_convolve(report.model)


def conv_io_per_sample(model: ModelInfo | None, convolving: bool = False) -> int:
    """The largest input + output bytes per sample of a layer that is or may hold a convolution (0: none known);
    `convolving`: the step convolves (its graphs can show a loss's or a train_step's convolution), so where no layer
    may hold it, of any layer."""
    layers = model.layers if model is not None else []
    sizes = [la.input_bytes_per_sample + la.activation_bytes_per_sample for la in layers]
    found = max((n for n, la in zip(sizes, layers, strict=True) if _maybe_conv(la.type)), default=0)
    return found or (max(sizes, default=0) if convolving else 0)


def may_convolve(model: ModelInfo | None) -> bool:
    """Whether the step may run a cuDNN convolution: unless every layer is known to run none (a model not described,
    a model used as a layer, a custom layer: may)."""
    return model is None or not model.layers or any(_maybe_conv(layer.type) for layer in model.layers)


def first_step_allowance(cap_bytes: int, io_bytes: float) -> int:
    """What the first step's autotuning may hold beside the step's tensors where it runs a convolution: one trial's
    workspace (at most the cap), its copy of the output (`io_bytes`: the layer's input + output taken for it) and
    the redzones around both."""
    return cap_bytes + round(io_bytes) + REDZONES_BYTES


def predict_on_gpu(report: Report, gpu: str | int | GpuTarget, **knobs: Unpack[WhatIfKnobs]) -> WhatIf:
    """`predict`'s answer for a GPU from a report measured on a CPU: over the cell's baseline, the step's tensors (the
    CPU prediction less fit's copy of numpy arrays, which a GPU keeps in host memory) and a typical cuDNN workspace;
    its budget the allocator's limit less what the cell started with. `fits` is True only where the tensors' upper
    estimate and a whole workspace cap fit (TensorFlow's autotuner holds one workspace at a time, each within the
    cap), False only where the tensors' lower estimate alone does not, None (cannot tell) between."""
    from tfmem_magic.advise.prediction import _input_copy, basis_of, predict

    target = target_of(gpu)
    if report.on_gpu:
        raise TfmemUsageError(
            f"this report measured {report.main_device_name or 'a GPU'} itself: predict(report, ...) judges that "
            "GPU's own limit; gpu= is for a report measured on a CPU"
        )
    mem = report.main_device
    held = mem.baseline_bytes if mem is not None else 0
    budget = max(0, target.limit_bytes - held)
    cpu = predict(report, tf_budget=budget, host=False, **knobs)
    # the copy in the peak, as the input_scale asked scales it (advise/parts.py)
    copy = round(_input_copy(report)[0] * cpu.knobs.input_scale / basis_of(report).knobs.input_scale)
    at = _GpuStep(report, target, copy)
    tensors = at.tensors(cpu)
    workspace = at.workspace(cpu)
    below = max(cpu.below, GPU_BELOW)
    hi, lo = at.upper(cpu), round(tensors * (1 - below))
    fits = True if hi <= budget else False if lo > budget else None
    largest = _largest(report, at, budget, knobs, cpu.knobs.split)
    split = dict(cpu.split)
    if copy:
        split["input"] = max(0, split.get("input", 0) - copy)
    split["workspace"] = workspace
    notes = [*_notes(report, target, held, copy, workspace, at, cpu, fits, hi, budget), *cpu.notes]
    return replace(
        cpu,
        peak_bytes=tensors + workspace,
        basis=f"{cpu.basis}, on a CPU; modelled for a {format_bytes(target.memory_bytes)} GPU",
        split=split,
        budget_bytes=budget,
        fits=fits,
        largest_batch=largest,
        notes=notes,
        fit_margin=cpu.error_band,
        error_band_below=below,
        process_margin=0.0,
        measured_peak=0.0,
    )


@dataclass
class _GpuStep:
    """One batch's step on the GPU, from the CPU prediction at that batch."""

    report: Report
    target: GpuTarget
    copy: int

    def tensors(self, cpu: WhatIf) -> int:
        return max(0, cpu.peak_bytes - self.copy)

    def workspace(self, cpu: WhatIf) -> int:
        """A typical cuDNN workspace beside the step's tensors; 0 where it runs no convolution."""
        return round(TYPICAL_WORKSPACE_PER_CONV_IO * self.io(cpu)) if report_convolves(self.report) else 0

    def io(self, cpu: WhatIf) -> int:
        """The largest convolution's input + output bytes at the prediction's knobs (the layers' bytes are the
        cell's: its policy and input scale)."""
        from tfmem_magic.advise.parts import activation_scale
        from tfmem_magic.advise.prediction import basis_of

        knobs = cpu.knobs
        scale = activation_scale(basis_of(self.report).knobs, knobs)
        return round(conv_io_per_sample(self.report.model, convolving=True) * knobs.batch_size / knobs.split * scale)

    def bound(self, cpu: WhatIf) -> int:
        """What the first step's autotuning may add at most (`first_step_allowance`); 0 where it runs no convolution."""
        if not report_convolves(self.report):
            return 0
        return first_step_allowance(self.target.workspace_cap_bytes, self.io(cpu))

    def judged(self, cpu: WhatIf) -> int:
        """The tensors 'fits' judges: the CPU prediction's judged peak (a saved trace's earlier, higher moment)."""
        from tfmem_magic.advise.bases import kind_of
        from tfmem_magic.advise.prediction import basis_of

        judged = kind_of(basis_of(self.report)).judged_peak(cpu.knobs, self.report)
        return max(0, round(max(cpu.peak_bytes, judged)) - self.copy)

    def upper(self, cpu: WhatIf) -> int:
        return round(self.judged(cpu) * (1 + cpu.error_band)) + self.bound(cpu)


def _largest(report: Report, at: _GpuStep, budget: int, knobs: WhatIfKnobs, step: int) -> int | None:
    """The largest batch (as people type it, a multiple of `step`: the replicas and accumulation steps the
    prediction resolved) whose tensors' upper estimate and the first step's workspace allowance fit `budget`; None
    where the smallest does not. Never more than the rows the cell trained on (fit runs them as one batch)."""
    from tfmem_magic.advise.prediction import MAX_BATCH, predict, typeable_batch
    from tfmem_magic.advise.preflight import _largest as largest_within

    def need(batch: int) -> float:
        asked: WhatIfKnobs = {**knobs, "batch_size": typeable_batch(max(step, batch), step)}
        return at.upper(predict(report, tf_budget=budget, host=False, **asked))

    found = largest_within(need, budget, MAX_BATCH // step * step)
    if found is None:
        return None
    rows = report.model.samples if report.model is not None else None
    batch = typeable_batch(max(step, found), step)
    return min(batch, rows) if rows else batch


def _notes(
    report: Report,
    target: GpuTarget,
    held: int,
    copy: int,
    workspace: int,
    at: _GpuStep,
    cpu: WhatIf,
    fits: bool | None,
    hi: int,
    budget: int,
) -> list[str]:
    cc = (
        f"compute capability {target.compute_capability}" if target.compute_capability else "compute capability unknown"
    )
    notes = [
        f"Modelled for a GPU from a run on a CPU: TensorFlow's allocator there would have "
        f"{format_bytes(target.limit_bytes)} of the {format_bytes(target.memory_bytes)} ({cc}: what TensorFlow "
        f"leaves to the system and the CUDA context taken off), less the {format_bytes(held)} the cell started with. "
        "The step's tensors are the CPU's; a GPU's kernels can hold other temporaries (cuDNN's layouts, fused "
        "kernels): checked on two public Keras CNNs traced on a Tesla T4 (docs/gpu.md, 'From a CPU run to a GPU')."
    ]
    if copy:
        notes.append(f"fit's {format_bytes(copy)} copy of the numpy arrays stays in host memory on a GPU: not counted.")
    if not report_convolves(report):
        notes.append(
            "No convolution: no cuDNN workspace counted (cuBLAS's matrix-product workspaces are small and "
            "uncapped; not modelled)."
        )
        return notes
    notes.append(
        f"A typical cuDNN workspace ({format_bytes(workspace)}: {TYPICAL_WORKSPACE_PER_CONV_IO}x the largest "
        "convolution's input and output, as on the public T4 traces) is in the peak shown; which algorithm, and so "
        "which workspace, only the GPU's autotuner decides, run to run. 'fits' and the largest batch judge the cap "
        f"instead: TF_CUDNN_WORKSPACE_LIMIT_IN_MB={target.workspace_limit_mb}, one workspace live at a time, the "
        "first step's trials included."
    )
    if fits is None:
        room = (budget - hi + target.workspace_cap_bytes) // MIB  # the cap that takes the rest
        notes.append(
            "Cannot tell whether it fits: the tensors fit, but not with a whole workspace cap beside them. "
            + (
                f"With TF_CUDNN_WORKSPACE_LIMIT_IN_MB={room} set on the GPU machine (before TensorFlow's first "
                "convolution) it would, at the price of slower convolutions where a faster algorithm needs more."
                if room > 0
                else "The tensors' upper estimate alone fills the GPU."
            )
        )
    return notes

"""A step measured on a CPU, modelled for a GPU (`predict(report, gpu=...)`, docs/gpu.md "From a CPU run to a GPU")."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

import tfmem_magic
from tfmem_magic import GpuTarget, Report, TfmemUsageError
from tfmem_magic.advise import gpu_target

ZOO = Path(__file__).parents[1] / "data" / "prediction_zoo"
MIB = 2**20
T4_MEMORY = 15_843_721_216  # a Tesla T4 as nvidia-smi gives it (the public traces' machine)
T4_LIMIT = 14_648_653_952  # GPU_0_bfc's limit in those traces: what TensorFlow set there


def zoo(name: str) -> Report:
    return Report.from_json(gzip.decompress((ZOO / name).read_bytes()).decode())


def test_the_limit_reckoned_from_a_cards_memory_is_never_above_tensorflows():
    """TensorFlow takes the free memory at its start less MinSystemMemory (1050 MiB at compute capability 7.x):
    on the T4 traces' machine 14,648,653,952 B. The context allowance keeps the reckoned limit under it."""
    t4 = GpuTarget(T4_MEMORY, 7.5)
    assert T4_LIMIT - 800 * MIB < t4.limit_bytes <= T4_LIMIT
    assert GpuTarget(15360 * MIB, 7.5).limit_bytes <= T4_LIMIT  # nvidia-smi's 15360 MiB for the same card
    assert GpuTarget(T4_MEMORY).limit_bytes < t4.limit_bytes  # unknown capability: the most left to the system
    assert gpu_target.min_system_memory(2**30, 9.0) == 225 * MIB
    assert [gpu_target.min_system_memory(2**34, cc) for cc in (6.1, 7.0, 8.6, 9.0)] == [
        500 * MIB,
        1050 * MIB,
        1536 * MIB,
        1800 * MIB,
    ]


def test_a_cnn_measured_on_a_cpu_is_modelled_for_a_gpu_with_a_workspace_and_judged_with_the_cap():
    rep = zoo("replay-small_cnn-32-1f5120e7.json.gz")
    cpu = tfmem_magic.predict(rep)
    gpu = tfmem_magic.predict(rep, gpu="16GB")
    t = gpu_target.target_of("16GB")
    copy = cpu.split.get("input", 0) - gpu.split["input"]
    assert gpu.split["workspace"] > 0 and copy >= 0
    assert gpu.peak_bytes == cpu.peak_bytes - copy + gpu.split["workspace"]
    assert gpu.budget_bytes == t.limit_bytes - rep.main_device.baseline_bytes
    assert gpu.fits is True and "modelled for a" in gpu.basis and gpu.process_margin == 0.0
    assert any("TF_CUDNN_WORKSPACE_LIMIT_IN_MB=4096" in n for n in gpu.notes)
    # never more than the rows the cell trained on (fit runs them as one batch)
    assert tfmem_magic.largest_batch(rep, gpu="16GB") == gpu.largest_batch == rep.model.samples
    # the largest batch: its tensors' upper estimate and the first step's allowance fit; the next batch's do not
    rep.model.samples = None
    largest = tfmem_magic.largest_batch(rep, gpu="16GB")
    assert largest > rep.model.batch_size

    def upper(batch: int) -> float:
        w = tfmem_magic.predict(rep, batch_size=batch, gpu="16GB")
        # the first step's allowance: the cap, the largest convolution's input + output, 32 MiB of redzones
        io = gpu_target.conv_io_per_sample(rep.model) * batch
        allowance = t.workspace_cap_bytes + io + 32 * MIB
        return (w.peak_bytes - w.split["workspace"]) * (1 + w.error_band) + allowance

    assert upper(largest) <= gpu.budget_bytes < upper(largest + 8)  # batches as people type them: 8s
    assert gpu.below >= gpu_target.GPU_BELOW


def test_where_the_tensors_fit_but_not_beside_a_whole_cap_it_cannot_tell_and_names_the_cap_that_would():
    rep = zoo("replay-small_cnn-32-1f5120e7.json.gz")
    at_16gb = tfmem_magic.predict(rep, batch_size=4096, gpu="16GB")
    upper = (at_16gb.peak_bytes - at_16gb.split["workspace"]) * (1 + at_16gb.error_band)
    # a GPU whose limit holds the tensors' upper estimate and 2 GiB: not a whole 4 GiB cap beside them
    limit = upper + rep.main_device.baseline_bytes + 2 * 2**30
    memory = int((limit + gpu_target.CONTEXT_BYTES + 1800 * MIB) / (1 - gpu_target.CARD_OVER_CUDA))
    small = GpuTarget(memory)
    w = tfmem_magic.predict(rep, batch_size=4096, gpu=small)
    assert w.fits is None
    said = [n for n in w.notes if n.startswith("Cannot tell")]
    assert said and "TF_CUDNN_WORKSPACE_LIMIT_IN_MB=" in said[0]
    cap = int(said[0].split("TF_CUDNN_WORKSPACE_LIMIT_IN_MB=")[1].split()[0])
    capped = GpuTarget(memory, workspace_limit_mb=cap)
    assert tfmem_magic.predict(rep, batch_size=4096, gpu=capped).fits is True  # the cap it names makes it fit
    assert tfmem_magic.predict(rep, batch_size=1 << 20, gpu=small).fits is False  # the tensors alone do not


def test_a_model_without_convolutions_gets_no_workspace():
    rep = zoo("analytic-mlp-128-ba21c29d.json.gz")
    w = tfmem_magic.predict(rep, gpu="8GB")
    assert w.split["workspace"] == 0 and w.fits is True
    assert any(n.startswith("No convolution") for n in w.notes)


def test_gpu_is_for_a_report_measured_on_a_cpu_and_takes_a_memory_size():
    with pytest.raises(TfmemUsageError, match="measured on a CPU"):
        tfmem_magic.predict(zoo("from-trace-gpu.json.gz"), gpu="16GB")
    rep = zoo("analytic-mlp-128-ba21c29d.json.gz")
    with pytest.raises(TfmemUsageError, match="16GB"):
        tfmem_magic.predict(rep, gpu="lots")
    with pytest.raises(TfmemUsageError, match="at least 1 GiB"):
        tfmem_magic.predict(rep, gpu="512MB")
    with pytest.raises(TfmemUsageError, match="not both"):
        tfmem_magic.largest_batch(rep, budget="8GB", gpu="16GB")


def test_the_workspace_scales_with_the_policy_and_input_asked_against_the_cells_own():
    """The layers' bytes are the cell's: a float32 cell asked for mixed_float16 halves its convolutions' input and
    output, a cell asked at its own policy keeps them, twice the input elements double them."""
    rep = zoo("replay-small_cnn-32-1f5120e7.json.gz")
    io = gpu_target.conv_io_per_sample(rep.model) * 32  # conv_a's output at the cell's batch, float32

    def workspace(**knobs: object) -> int:
        return tfmem_magic.predict(rep, gpu="16GB", **knobs).split["workspace"]

    assert rep.whatif_basis.knobs.policy in (None, "float32") and io == 115_200 * 32
    assert workspace() == round(gpu_target.TYPICAL_WORKSPACE_PER_CONV_IO * io)
    assert workspace(policy="mixed_float16") == round(gpu_target.TYPICAL_WORKSPACE_PER_CONV_IO * io / 2)
    assert workspace(input_scale=2.0) == round(gpu_target.TYPICAL_WORKSPACE_PER_CONV_IO * io * 2)
    # a cell that ran mixed_bfloat16 (its layers' bytes are bfloat16's), asked at its own policy: not halved again
    bf16 = zoo("analytic-bf16.json.gz")
    assert bf16.whatif_basis.knobs.policy == "mixed_bfloat16" and bf16.model.batch_size == 64
    own = tfmem_magic.predict(bf16, gpu="16GB").split["workspace"]
    assert own == round(gpu_target.TYPICAL_WORKSPACE_PER_CONV_IO * 115_200 * 64)
    assert tfmem_magic.predict(bf16, gpu="16GB", policy="float32").split["workspace"] == 2 * own


def test_a_gpu_model_asked_for_mixed_float16_says_nothing_of_its_speed_on_a_cpu():
    """mixed_float16 is the GPU's own policy: the CPU's note (74-260x slower there, use mixed_bfloat16) would steer a
    GPU user away from it. The CPU prediction keeps it."""
    rep = zoo("replay-small_cnn-32-1f5120e7.json.gz")
    cpu = tfmem_magic.predict(rep, policy="mixed_float16")
    gpu = tfmem_magic.predict(rep, policy="mixed_float16", gpu="16GB")
    assert any("slower on CPU" in n for n in cpu.notes)
    assert not any("slower on CPU" in n or "mixed_bfloat16" in n for n in gpu.notes), gpu.notes


def test_a_workspace_cap_of_0_still_leaves_the_first_steps_output_copy_and_redzones():
    """TF_CUDNN_WORKSPACE_LIMIT_IN_MB=0 caps the workspace, not the autotuner's copy of the output and its redzones:
    the pre-flight's allowance keeps those for a model that convolves, and is 0 only for one that does not."""
    from tfmem_magic.advise import preflight
    from tfmem_magic.core.report import GpuPreflight

    io = 1000
    capped = GpuPreflight("GPU:0", 2**30, 0, workspace_cap_bytes=0, convolves=True, conv_io_bytes_per_sample=io)
    assert preflight._first_step(capped, 64) == 64 * io + gpu_target.REDZONES_BYTES
    assert preflight._cap_words(capped) == ""  # no workspace to leave room for
    plain = GpuPreflight("GPU:0", 2**30, 0, workspace_cap_bytes=64 * MIB, convolves=True, conv_io_bytes_per_sample=io)
    assert preflight._first_step(plain, 64) == 64 * MIB + 64 * io + gpu_target.REDZONES_BYTES
    assert "64 MiB" in preflight._cap_words(plain)
    none = GpuPreflight("GPU:0", 2**30, 0, convolves=False)
    assert preflight._first_step(none, 64) == 0 and "runs no convolution" in preflight._cap_words(none)


class Conv2D:  # stand-ins named as Keras names its layers: the rule reads the kinds
    pass


class Dense:
    pass


class KerasAttention:
    pass


Dense.__module__ = "keras.src.layers.core.dense"  # Keras' own
KerasAttention.__name__, KerasAttention.__module__ = "MultiHeadAttention", "keras.src.layers.attention"


class WeightStandardized(Conv2D):  # a user's subclass of a convolution's layer
    pass


class TransformerBlock:  # a custom layer: its `call` is the user's
    pass


class MultiHeadAttention:  # a user's class named as a Keras layer that runs no convolution
    pass


def test_whether_a_step_convolves_comes_from_its_graphs_op_types_and_its_layers():
    """The op types of the graphs the probes ran (read before Grappler names a fused convolution after its
    activation) decide where they were read; a convolution's layer anywhere counts whatever they say."""
    dense_step = ["MatMul", "BiasAdd", "Relu", "Einsum", "StatefulPartitionedCall", "ResourceApplyAdam"]
    assert gpu_target.types_convolve(dense_step) is False
    assert gpu_target.types_convolve([*dense_step, "Conv2D"]) is True
    assert gpu_target.types_convolve(["DepthwiseConv2dNativeBackpropFilter"]) is True
    assert gpu_target.types_convolve(None) is None
    custom, dense, conv = [TransformerBlock(), Dense()], [Dense(), KerasAttention()], [Dense(), Conv2D()]
    assert gpu_target.step_convolves([WeightStandardized()], None) is True
    assert gpu_target.step_convolves([MultiHeadAttention()], None) is True  # not Keras' own: may convolve
    assert gpu_target.step_convolves(conv, False) is True  # a convolution's layer, whatever the graphs hold
    assert gpu_target.step_convolves(dense, True) is True  # a loss's or a train_step's own convolution
    assert gpu_target.step_convolves(custom, False) is False  # a custom layer whose graphs hold none
    # graphs not read: from the layers alone
    assert gpu_target.step_convolves(dense, None) is False  # every kind known to run none
    assert gpu_target.step_convolves(custom, None) is True
    assert gpu_target.step_convolves(None, None) is True and gpu_target.step_convolves([], None) is True


def test_what_the_probes_graphs_said_decides_the_workspace_before_the_layers():
    """A calibration's or a refusal's probes read every op type their graphs ran (`ReplayCurve.convolves`): a model
    whose custom layer runs no convolution gets no workspace on a GPU, where its layers alone would give it one; a
    model of dense layers whose step convolves (a loss's convolution) gets one; a convolution's layer keeps it."""
    rep = zoo("replay-small_cnn-32-1f5120e7.json.gz")
    replay = rep.whatif_basis.replay
    assert replay is not None and replay.convolves is None  # saved before the graphs were read: the layers decide
    rep.model.samples = None  # the largest batch as found, not the rows the cell had
    cnn = tfmem_magic.predict(rep, gpu="16GB")
    replay.convolves = False  # a Conv2D of Keras' own is there all the same
    assert gpu_target.report_convolves(rep) and tfmem_magic.predict(rep, gpu="16GB").split["workspace"] > 0
    for layer in rep.model.layers:  # the convolutions as a user's own layer: it may convolve
        if layer.type in gpu_target.CONV_LAYERS:
            layer.type = "Blur"
    replay.convolves = None
    assert tfmem_magic.predict(rep, gpu="16GB").split["workspace"] == cnn.split["workspace"] > 0
    replay.convolves = False  # its graphs ran none
    w = tfmem_magic.predict(rep, gpu="16GB")
    assert w.split["workspace"] == 0 and w.peak_bytes == cnn.peak_bytes - cnn.split["workspace"]
    assert any(n.startswith("No convolution") for n in w.notes), w.notes
    assert w.largest_batch > cnn.largest_batch  # no cap beside its tensors
    # every layer known to run none, yet the step's graphs convolve: the cap, and a workspace of the largest layer's
    for layer in rep.model.layers:
        layer.type = "Dense"
    replay.convolves = True
    w = tfmem_magic.predict(rep, gpu="16GB")
    io = max(la.input_bytes_per_sample + la.activation_bytes_per_sample for la in rep.model.layers) * 32
    assert w.split["workspace"] == round(gpu_target.TYPICAL_WORKSPACE_PER_CONV_IO * io) > 0
    assert any("TF_CUDNN_WORKSPACE_LIMIT_IN_MB" in n for n in w.notes)

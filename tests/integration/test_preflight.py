"""Pre-flight in a real kernel: under a per-cell limit, with TensorFlow already running, a `fit` whose step will not fit
is refused before its first step (the process never passes the limit), the batch it suggests runs within the limit,
and a batch that fits runs without probes. A model whose `train_step` is its own (keras-io's DCGAN, two optimizers
not built yet) is checked on that step, saved and run by the probes."""

from __future__ import annotations

import textwrap

import pytest
from fresh import load_benchmark
from test_kernel_faults import MARK, Kernel

pytestmark = pytest.mark.slow
GiB = 2**30
LIMIT = 3 * 10**9  # --limit 3GB

SETUP = """
%load_ext tfmem_magic
import json, numpy as np, keras
keras.utils.set_random_seed(0)
x = np.random.rand(2048, 64, 64, 3).astype("float32"); y = np.random.randint(0, 10, 2048)
model = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(64, 3, activation="relu"),
                          keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                          keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
model.compile("adam", "sparse_categorical_crossentropy")
model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # TensorFlow is running: no allocator cap any more
"""
REPORT = (
    f"print({MARK!r} + json.dumps({{'status': r.status, 'rss_peak': r.rss.peak_bytes, 'notes': r.notes, "
    "'preflight': r.preflight and __import__('dataclasses').asdict(r.preflight), "
    "'error': r.error and r.error.message, 'tf_peak': r.tf_peak_bytes, "
    "'basis': r.whatif_basis and [r.whatif_basis.name, r.whatif_basis.anchor], "
    "'fixes': {f.id: f.code for f in r.fixes}}))"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("preflight"))
    assert k.run(SETUP)["error"] is None
    yield k
    k.close()


def fit(kernel: Kernel, batch: int, options: str = "", code: str = "") -> tuple[dict, dict]:
    """A cell under --limit 3GB (`code`, by default a fit at `batch`), and its report."""
    cell = kernel.run(
        f"%%tfmem --quick --limit 3GB --as r {options}\n"
        + (code or f"model.fit(x, y, batch_size={batch}, epochs=1, verbose=0)")
    )
    return cell, kernel.run(REPORT)["data"]


def test_a_batch_that_fits_runs_without_probes(kernel):
    # first in the module: later tests leave the allocator's regions of steps at batches up to 632 in the kernel,
    # which the model's own parts shortcut does not count as room ("Held regions count only against a refusal")
    cell, r = fit(kernel, 64)
    assert cell["error"] is None and r["status"] == "ok"
    pre = r["preflight"]
    assert pre["verdict"] == "fits" and pre["basis"] == "model" and pre["probe_batches"] == []
    assert any("Pre-flight of fit() at batch 64" in n and "no probes needed" in n for n in r["notes"]), r["notes"]


def test_a_step_that_will_not_fit_is_refused_before_it_runs_and_its_suggestion_fits(kernel):
    cell, r = fit(kernel, 1024)
    assert cell["error"] == "PreflightRefused", cell["stdout"][-2000:]
    pre = r["preflight"]
    # predicted by the step replay of a clone's steps at two small odd batches (not the probes' line)
    assert pre["verdict"] == "refused" and pre["basis"] == "replay", pre["replay_note"]
    low, high = pre["probe_batches"]
    assert low % 2 == high % 2 == 1 and low < high < 1024 // 8
    # even the low end of the band on what the process grows by passes the guard's threshold (under the limit)
    growth = pre["predicted_rss_bytes"] - pre["rss_bytes"]
    assert pre["rss_bytes"] + growth * (1 - pre["band_below"]) > pre["threshold_bytes"]
    assert pre["threshold_bytes"] <= LIMIT
    assert r["rss_peak"] < LIMIT  # nothing of the step ran: the process never came near the limit
    assert (
        r["status"] == "refused"
        and "before its first step" in r["error"]
        and f"to {pre['largest_batch']}" in r["error"]
    )
    # the fix cell carries the pre-flight's batch, and that batch runs within the limit (the guard never trips)
    suggested = pre["largest_batch"]
    assert 64 < suggested < 1024 and f"batch_size={suggested}" in r["fixes"]["shrink-batch"]
    # the report's what-if is the pre-flight's replay, anchored on its prediction, and names the same batch
    assert r["basis"] == ["replay", "preflight"]
    asked = kernel.run(
        f"import tfmem_magic\nw = tfmem_magic.predict(r, batch_size={suggested})\n"
        f"print({MARK!r} + json.dumps([w.peak_bytes, w.error_band, w.basis, "
        "tfmem_magic.predict(r).largest_batch]))"
    )["data"]
    predicted, band, basis, largest = asked
    assert basis == "replay" and largest == suggested, asked
    cell, r = fit(kernel, suggested)
    assert cell["error"] is None and r["status"] == "ok", (cell["stdout"][-2000:], r["notes"])
    assert r["rss_peak"] < LIMIT
    assert r["preflight"]["verdict"] in ("fits", "uncertain")
    # ... and predicted the suggested batch's TF peak within its band (here: 1.44 GiB predicted at 456, 1.50 run)
    print(
        f"\nbatch {suggested}: the refused report predicted {predicted / GiB:.2f} GiB ±{band:.0%}, "
        f"it ran at {r['tf_peak'] / GiB:.2f} GiB"
    )
    assert abs(predicted / r["tf_peak"] - 1) <= band, (predicted, r["tf_peak"])


BUILD = """
m2 = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(64, 3, activation="relu"),
                       keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                       keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
m2.compile("adam", "sparse_categorical_crossentropy")
"""


def refused_then_named(kernel: Kernel, build: str, name: str) -> tuple[dict, dict, dict]:
    """A cell that builds model `name` (`build`) and fits at batch 1024, refused; then the same cell at the batch the
    refusal named. Returns the refusal's pre-flight, the second call's and its report."""
    cell, r = fit(kernel, 0, code=build + f"{name}.fit(x, y, batch_size=1024, epochs=1, verbose=0)")
    assert cell["error"] == "PreflightRefused", cell["stdout"][-2000:]
    refused = r["preflight"]
    assert not refused["kept"], refused
    named = refused["largest_batch"]
    print(f"\n{name} built again: refused at 1024 ({refused['basis']}), named {named}")
    cell, r = fit(kernel, 0, code=build + f"{name}.fit(x, y, batch_size={named}, epochs=1, verbose=0)")
    assert cell["error"] is None and r["status"] == "ok", (cell["stdout"][-2000:], r["notes"])
    again = r["preflight"]
    assert again["kept"] and again["probe_batches"] == refused["probe_batches"], again
    assert r["rss_peak"] < LIMIT
    return refused, again, r


def test_a_cell_that_builds_its_model_again_is_judged_from_the_refusals_replay(kernel):
    """The cell a refusal stopped builds its model and fits; run again at the batch the refusal named, it builds a new
    model of the same fingerprint (measure/model_print.py), judged from the refusal's replay without new probes."""
    refused, again, r = refused_then_named(kernel, BUILD, "m2")
    assert refused["basis"] == "replay" and again["verdict"] in ("fits", "uncertain")
    assert not any(n.startswith("Calibrated") for n in r["notes"]), r["notes"]


BUILD_SUBCLASSED = """
class Net(keras.Model):
    def __init__(self, width=64):
        super().__init__()
        self.convs = [keras.layers.Conv2D(width, 3, activation="relu") for _ in range(2)]
        self.pool, self.flat, self.head = keras.layers.MaxPool2D(), keras.layers.Flatten(), keras.layers.Dense(10)

    def call(self, x):
        for conv in self.convs:
            x = self.pool(conv(x))
        return self.head(self.flat(x))

m3 = Net()
m3.compile("adam", "sparse_categorical_crossentropy")
"""


def test_a_cell_that_builds_a_subclassed_model_again_is_judged_from_the_refusals_replay(kernel):
    """The same with a subclassed model, not built when fit is called (keras-io's NER Transformer builds its model in
    the cell): its fingerprint is read from its layers' settings, so the named batch is judged without new probes."""
    refused_then_named(kernel, BUILD_SUBCLASSED, "m3")


def test_no_preflight_leaves_the_call_to_the_guard(kernel):
    cell, r = fit(kernel, 64, "--no-preflight")
    assert cell["error"] is None and r["preflight"] is None


def test_each_call_is_checked_as_it_was_fed(kernel):
    # a predict after a fit in one cell was checked at the fit's batch (32, the report's) and went on to 2.1x the
    # limit at its own batch, 2048: each call is checked as it was fed
    cell, r = fit(
        kernel,
        32,
        "",
        "model.fit(x[:256], y[:256], batch_size=32, epochs=1, verbose=0)\n"
        "out = model.predict(x, batch_size=2048, verbose=0)",
    )
    pre = r["preflight"]
    assert cell["error"] == "PreflightRefused" and (pre["call"], pre["batch_size"]) == ("predict", 2048), pre
    assert r["rss_peak"] < LIMIT
    # train_on_batch: its batch is the one handed in, checked once per size
    cell, r = fit(kernel, 1024, "", "for i in range(0, 2048, 1024): model.train_on_batch(x[i:i + 1024], y[i:i + 1024])")
    pre = r["preflight"]
    assert cell["error"] == "PreflightRefused" and (pre["call"], pre["batch_size"]) == ("train_on_batch", 1024)
    assert "stopped train_on_batch() before its first step" in r["error"] and r["rss_peak"] < LIMIT


def test_a_custom_loop_under_a_limit_is_said_to_run_without_a_preflight(kernel):
    # a GradientTape loop's steps are one tf.function each, which the pre-flight cannot run ahead of time: the
    # report says that only the guard watched them (before, it said nothing and a step at batch 1024 took the
    # process 78% past the limit)
    kernel.run("""
import tensorflow as tf
opt = keras.optimizers.Adam()
lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = lossf(yb, model(xb, training=True))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
""")
    cell = kernel.run(
        "%%tfmem --quick --limit 3GB --as r\n"
        "for xb, yb in tf.data.Dataset.from_tensor_slices((x[:192], y[:192])).batch(64): step(xb, yb)"
    )
    r = kernel.run(REPORT)["data"]
    assert cell["error"] is None and r["status"] == "ok" and r["preflight"] is None, cell["stdout"][-2000:]
    assert any(
        "trained in a loop of its own (Adam.apply(), outside fit)" in n and "only the guard watched it" in n
        for n in r["notes"]
    ), r["notes"]
    # run again, the step is traced: no update passes through Python, and the optimizer's step counter says it ran
    cell = kernel.run(
        "%%tfmem --quick --limit 3GB --as r\n"
        "for xb, yb in tf.data.Dataset.from_tensor_slices((x[:192], y[:192])).batch(64): step(xb, yb)"
    )
    r = kernel.run(REPORT)["data"]
    assert cell["error"] is None and r["status"] == "ok" and r["preflight"] is None, cell["stdout"][-2000:]
    assert any(
        "a loop of its own (opt (Adam) stepped 3 times in a tf.function traced before the cell, by its step "
        "counter, outside fit)" in n
        for n in r["notes"]
    ), r["notes"]


def test_the_largest_batch_a_report_names_under_a_limit_runs_within_that_limit(tmp_path_factory):
    # A limit counts the process, and the process grows by more than TensorFlow's allocator (the arrays fit copies,
    # its traced graphs, oneDNN's scratch, tfmem's trace). Left out of the budget, a keras.io MNIST convnet under a
    # limit 200 MiB over the process was told batch 568 fits (on the step replay) where 448 and 512 were stopped
    # by the guard (docs/what-if.md, "The budget is the process's").
    first = Kernel(tmp_path_factory.mktemp("largest-cell"))
    try:
        assert first.run(SETUP)["error"] is None
        cell = first.run("%%tfmem --limit 3GB --as r\nmodel.fit(x, y, batch_size=256, epochs=1, verbose=0)")
        assert cell["error"] is None, cell["stdout"][-2000:]
        data = first.run(
            "import tfmem_magic\n"
            + REPORT.replace(
                "'fixes'",
                "'largest': tfmem_magic.largest_batch(r), 'basis': r.whatif_basis.name, "
                "'outside': r.rss.peak_bytes - r.rss.baseline_bytes - r.tf_peak_bytes, "
                "'finding': [f.evidence for f in r.findings if f.id == 'large-batch'], 'fixes'",
            )
        )["data"]
    finally:
        first.close()
    assert data["status"] == "ok", data["notes"]
    named = data["largest"]
    assert named is not None and named > 256, data
    if data["finding"]:  # the finding names the same batch (auto calibration puts both on the replay)
        assert f"is {named}." in data["finding"][0], (data["finding"], named)
    # run where the cell started (the prediction is the cell's, from its baseline): a kernel of its own. In the
    # cell's kernel TensorFlow keeps the regions the cell grew and a larger batch reuses only part of them (the
    # report says so; the pre-flight judges that run)
    second = Kernel(tmp_path_factory.mktemp("largest-run"))
    try:
        assert second.run(SETUP)["error"] is None
        cell = second.run(f"%%tfmem --limit 3GB --as r\nmodel.fit(x, y, batch_size={named}, epochs=1, verbose=0)")
        r = second.run(REPORT)["data"]
    finally:
        second.close()
    print(
        f"\nbatch 256 on the {data['basis']} basis names {named}; run, the process peaked at "
        f"{r['rss_peak'] / GiB:.2f} GiB of {LIMIT / GiB:.2f}"
    )
    assert cell["error"] is None and r["status"] == "ok", (named, data["outside"], cell["stdout"][-2000:], r["notes"])
    assert r["rss_peak"] < LIMIT


NET = """
%load_ext tfmem_magic
import json, numpy as np, keras
x = np.random.rand(2048, 64, 64, 3).astype("float32")
class Net(keras.Model):  # subclassed, an argument and no get_config: Keras cannot write a config to clone it from
    def __init__(self, width):
        super().__init__()
        self.conv = keras.layers.Conv2D(width, 3, activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(10)
    def call(self, x):
        return self.head(self.pool(self.conv(x)))
net = Net(128)
net.predict(x[:8], verbose=0)
"""


@pytest.fixture
def net_kernel(tmp_path_factory):
    """A kernel of its own: in the module's, after the fits above, the first pre-flight counted the regions the
    previous cell's fit left in TensorFlow's allocator as reusable and named 224, and the second, after a refused
    cell (the peak counter reset, nothing ran), did not and refused 224 (docs/preflight.md, "What it does not do")."""
    k = Kernel(tmp_path_factory.mktemp("preflight-net"))
    assert k.run(NET)["error"] is None
    yield k
    k.close()


def test_predict_on_a_model_keras_cannot_clone_is_checked_on_its_own_predict_step(net_kernel):
    # no clone to probe: the model's predict_step (Keras' own, on this model) is saved and the probes run it. Batch
    # 2048 of 64x64 images through 128 filters is ~4 GiB of activations: refused under 3 GB; the batch it names runs
    kernel = net_kernel

    def run(batch: int) -> tuple[dict, dict]:
        cell = kernel.run(f"%%tfmem --quick --limit 3GB --as r\nout = net.predict(x, batch_size={batch}, verbose=0)")
        return cell, kernel.run(REPORT)["data"]

    cell, r = run(2048)
    assert cell["error"] == "PreflightRefused", cell["stdout"][-2000:]
    pre = r["preflight"]
    assert pre["call"] == "predict" and pre["basis"] == "replay", pre
    assert (pre["own_step"] or "").startswith("Net.predict_step, Keras' own"), pre["own_step"]
    assert r["rss_peak"] < LIMIT
    suggested = pre["largest_batch"]
    assert 16 < suggested < 2048
    cell, again = run(suggested)
    assert cell["error"] is None and again["status"] == "ok", (pre, again["preflight"], again["error"])
    assert again["rss_peak"] < LIMIT


@pytest.fixture(scope="module")
def gan_kernel(tmp_path_factory):
    """keras-io's DCGAN (benchmarks/custom_step_accuracy.py's), compiled and never fitted: its two Adams have no
    slots yet. TensorFlow runs (an op before it), so no allocator cap can protect the step."""
    setup, _ = load_benchmark("custom_step_accuracy").PROGRAMS["dcgan"]
    setup = textwrap.dedent(setup).replace("data = data.batch(BATCH).take(4)", "")
    k = Kernel(tmp_path_factory.mktemp("preflight-gan"))
    cell = k.run(
        "%load_ext tfmem_magic\nimport json, numpy as np, keras, tensorflow as tf\nfrom keras import layers\n"
        f"tf.zeros((4, 4)) + 1\n{setup}"
    )
    assert cell["error"] is None, cell["stdout"][-2000:]
    yield k
    k.close()


def fit_gan(kernel: Kernel, batch: int) -> tuple[dict, dict]:
    cell = kernel.run(f"%%tfmem --quick --limit 2GB --as r\ngan.fit(data.batch({batch}).take(4), epochs=1, verbose=0)")
    return cell, kernel.run(REPORT)["data"]


def test_a_train_step_of_its_own_is_checked_on_that_step(gan_kernel):
    cell, r = fit_gan(gan_kernel, 1024)
    assert cell["error"] == "PreflightRefused", cell["stdout"][-2000:]
    pre = r["preflight"]
    # the step the probes ran is the model's own (a clone's fit would have trained it with Keras' default step)
    assert pre["basis"] == "replay" and pre["own_step"] == "GAN.train_step", pre
    assert "the model's own step, saved (GAN.train_step)" in r["error"]
    growth = pre["predicted_rss_bytes"] - pre["rss_bytes"]
    assert pre["rss_bytes"] + growth * (1 - pre["band_below"]) > pre["threshold_bytes"]
    assert r["rss_peak"] < 2 * 10**9  # nothing of the step ran
    # its suggestion runs within the limit: the replay of the saved step is the step fit then runs
    suggested = pre["largest_batch"]
    assert 32 <= suggested < 1024 and f"data.batch({suggested})" in r["fixes"]["shrink-batch"], r["fixes"]
    cell, r = fit_gan(gan_kernel, suggested)
    assert cell["error"] is None and r["status"] == "ok", (r["preflight"], pre, r["rss_peak"], r["notes"])
    assert r["rss_peak"] < 2 * 10**9
    assert r["preflight"]["verdict"] in ("fits", "uncertain")


LINES_MODEL = """model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(4096),
    keras.layers.Dense(1),
])
model.compile("sgd", "mse")
x = np.random.rand(16384, 64).astype("float32"); y = np.random.rand(16384, 1).astype("float32")
model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
limit = psutil.Process().memory_info().rss + 200 * 2**20
"""


def test_a_refusal_names_the_line_that_made_the_layer_holding_its_peak(tmp_path_factory):
    """A `Dense(4096)` made on line 3 of a cell, refused at batch 16384 (its output alone is 256 MiB): the refusal
    names that line, with its code, from the replay of the clone's probes."""
    k = Kernel(tmp_path_factory.mktemp("preflight-lines"))
    try:
        setup = k.run(
            "%load_ext tfmem_magic\nimport json, psutil, numpy as np, keras, tfmem_magic\n"
            f"print({MARK!r} + json.dumps(tfmem_magic.__file__))"
        )
        assert setup["error"] is None, setup["stdout"][-2000:]
        print(f"\nthe kernel's tfmem_magic: {setup['data']}")
        assert k.run(LINES_MODEL)["error"] is None  # In [2]: the Dense(4096) on its line 3
        cell = k.run("%%tfmem --quick --limit {limit} --as r\nmodel.fit(x, y, batch_size=16384, epochs=1, verbose=0)")
        r = k.run(
            f"from tfmem_magic.show import render\nprint({MARK!r} + json.dumps({{'status': r.status, "
            "'preflight': __import__('dataclasses').asdict(r.preflight), 'error': r.error and r.error.message, "
            "'text': render.render_text(r)}))"
        )["data"]
    finally:
        k.close()
    assert cell["error"] == "PreflightRefused", cell["stdout"][-2000:]
    pre = r["preflight"]
    assert pre["verdict"] == "refused" and pre["basis"] == "replay", pre["replay_note"]
    lines = [g for g in pre["by_line"] if g["kind"] == "line"]
    print("\n" + r["error"] + "\n" + r["text"])
    dense = next(g for g in lines if g["label"] == "In [2] line 3")
    assert dense["code"] == "keras.layers.Dense(4096)," and dense["layer"].startswith("dense")
    # its output [16384,4096], or its kernel's gradient [64,4096] (which tensors meet at the peak is the executor's
    # order): at least one tensor it made, at the asked batch
    assert dense["bytes"] >= 64 * 4096 * 4 and any("4096" in (t["shape"] or "") for t in dense["tensors"])
    shapes = [t["shape"] or "" for g in pre["by_line"] for t in g["tensors"]]
    assert not [s for s in shapes for b in pre["probe_batches"] if s.startswith(f"[{b},")]  # no probe's batch
    assert "At the replay's peak: " in r["error"] and "In [2] line 3 (`keras.layers.Dense(4096),`)" in r["error"]
    assert "Refused   what the replayed step held at its peak at batch 16384" in r["text"]
    assert "In [2] line 3  keras.layers.Dense(4096)," in r["text"]


# A GPU the kernel holds, simulated on a CPU: the pre-flight's view of it (`gpu_room`) is the GPU's limit this test
# sets; the probe processes' environment is recorded as each starts (on a GPU they must never need it)
SIMULATED_GPU = """
from tfmem_magic.advise import preflight, probe_runs
from tfmem_magic.core.report import GpuPreflight
GPU_LIMIT = 400 * 2**20
probe_env = []
_spawn = probe_runs._spawn
def _spied(flavour):
    probe_env.append(probe_runs.probe_environment().get("CUDA_VISIBLE_DEVICES"))
    return _spawn(flavour)
probe_runs._spawn = _spied
def _room(parts):
    io = preflight.conv_io_per_sample(parts)
    return GpuPreflight("GPU:0", GPU_LIMIT, 0, workspace_cap_bytes=64 * 2**20, convolves=True,
                        conv_io_bytes_per_sample=io)
preflight.gpu_room = _room
probe_runs.kernel_has_gpu = lambda: True  # warm probes start as the pre-flight's do: with the GPUs hidden
"""


def test_on_a_gpu_the_probes_run_on_the_cpu_and_the_gpus_limit_refuses_what_the_process_would_take(tmp_path_factory):
    """docs/gpu.md, "A pre-flight while the kernel holds the GPU": the process's limit (3 GB) lets batch 256 run,
    the GPU's (400 MiB, simulated) does not: refused before its first step, on the GPU's judgement, by probes that
    ran with every GPU hidden; the batch it names is accepted from the kept replay, and its step, run, fits the
    GPU's room with the first step's workspace allowance beside it."""
    k = Kernel(tmp_path_factory.mktemp("preflight-gpu"))
    try:
        assert k.run(SETUP + SIMULATED_GPU)["error"] is None
        cell, r = fit(k, 256)
        assert cell["error"] == "PreflightRefused", cell["stdout"][-2000:]
        pre, gpu = r["preflight"], r["preflight"]["gpu"]
        assert gpu["verdict"] == "refused" and pre["verdict"] == "refused" and pre["basis"] == "replay", pre
        assert pre["predicted_rss_bytes"] < pre["threshold_bytes"]  # the process alone would have let it run
        assert gpu["step_bytes"] * (1 - pre["band_below"]) > gpu["limit_bytes"] - gpu["in_use_bytes"]
        assert "on GPU:0" in r["error"] and "The probes ran on the CPU" in r["error"], r["error"]
        probes = k.run(f"print({MARK!r} + json.dumps(probe_env))")["data"]
        assert probes and set(probes) == {"-1"}, probes  # every probe process started with the GPUs hidden
        named = pre["largest_batch"]
        assert named is not None and named < 256 and named == min(named, gpu["largest_batch"])
        cell, r = fit(k, named)
        assert cell["error"] is None and r["status"] == "ok", (cell["stdout"][-2000:], r["notes"])
        again = r["preflight"]
        assert again["kept"] and again["gpu"]["verdict"] in ("fits", "uncertain"), again
        started = k.run(f"print({MARK!r} + json.dumps(probe_env))")["data"]
        assert set(started) == {"-1"}, started  # the warm probes each cell starts ahead: GPUs hidden too
        allowance = 64 * 2**20 + again["gpu"]["conv_io_bytes_per_sample"] * named + 32 * 2**20
        print(f"\nGPU limit 400 MiB: batch 256 refused, {named} named; its step took {r['tf_peak'] / 2**20:.0f} MiB")
        # the step, run (on the CPU standing in), fits the room; fit's copy of the arrays (the replay's extra) stays
        # in host memory on a GPU
        assert r["tf_peak"] - again["extra_bytes"] + allowance <= 400 * 2**20, (r["tf_peak"], again["extra_bytes"])
        assert any("On GPU:0 (probes on the CPU" in n for n in r["notes"]), r["notes"]
    finally:
        k.close()


CUSTOM_LAYERS = """
import tensorflow as tf
class Block(keras.layers.Layer):  # keras-io's TransformerBlock, shortened: no convolution, a kind tfmem cannot list
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=32)
        self.ffn = keras.layers.Dense(64, activation="relu")
        self.norm = keras.layers.LayerNormalization()
    def call(self, inputs):
        return self.norm(inputs + self.ffn(self.att(inputs, inputs)))
class Blur(keras.layers.Layer):  # a fixed 3x3 blur, a bias and a ReLU: Grappler fuses them into one op named Relu,
    def build(self, shape):      # and nothing flows back into the constant kernel (no gradient's convolution)
        self.b = self.add_weight(shape=(3,), initializer="zeros")
    def call(self, inputs):
        blurred = tf.nn.conv2d(inputs, tf.ones((3, 3, 3, 3)) / 27.0, strides=1, padding="SAME")
        return tf.nn.relu(tf.nn.bias_add(blurred, self.b))
seq, labels = np.random.rand(8192, 64, 64).astype("float32"), np.random.randint(0, 10, 8192)
attention = keras.Sequential([keras.Input((64, 64)), Block(), keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(10)])
attention.compile("adam", "sparse_categorical_crossentropy")
blurred = keras.Sequential([keras.Input((64, 64, 3)), Blur(), keras.layers.Flatten(), keras.layers.Dense(10)])
blurred.compile("adam", "sparse_categorical_crossentropy")
def edge_loss(y_true, y_pred):  # a loss that convolves, on a model whose layers run no convolution
    edges = tf.constant([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])[:, :, None, None] * tf.ones((1, 1, 3, 3))
    return tf.reduce_mean(tf.square(tf.nn.conv2d(y_true - y_pred, edges, strides=1, padding="SAME")))
dense_only = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Dense(3)])
dense_only.compile("adam", edge_loss)
import os
from tfmem_magic.advise.gpu_target import may_convolve
os.environ["TF_CUDNN_WORKSPACE_LIMIT_IN_MB"] = "64"  # what the pre-flight reads where it finds a convolution
def _room_by_layers(parts):  # as gpu_room judges before the probes: from the model's layers
    conv = may_convolve(parts)
    return GpuPreflight("GPU:0", GPU_LIMIT, 0, workspace_cap_bytes=64 * 2**20 if conv else 0, convolves=conv,
                        conv_io_bytes_per_sample=preflight.conv_io_per_sample(parts, convolving=True))
preflight.gpu_room = _room_by_layers
"""


def test_on_a_gpu_a_custom_layer_gets_a_workspace_allowance_only_where_its_traced_ops_convolve(tmp_path_factory):
    """docs/gpu.md, "A pre-flight while the kernel holds the GPU": a custom layer may convolve (its `call` is the
    user's), so its model's layers alone leave it open; the op types of the probes' graphs decide: keras-io's
    Transformer block runs none (no first-step allowance on the GPU), a layer calling tf.nn.conv2d does, fused with
    its bias and ReLU into an op named after the ReLU."""
    k = Kernel(tmp_path_factory.mktemp("preflight-gpu-custom"))
    try:
        assert k.run(SETUP + SIMULATED_GPU + CUSTOM_LAYERS)["error"] is None
        cell, r = fit(k, 0, code="attention.fit(seq, labels, batch_size=8192, epochs=1, verbose=0)")
        gpu = r["preflight"]["gpu"]
        assert r["preflight"]["basis"] == "replay" and gpu["verdict"] == "refused", (r["preflight"], cell["stdout"])
        assert gpu["convolves"] is False and gpu["workspace_cap_bytes"] == 0, gpu
        assert "Its step runs no convolution" in r["error"], r["error"]
        # the refused report's what-if on a GPU judges by the same graphs: no workspace, where its layers give one
        assert r["preflight"]["replay"]["convolves"] is False
        said = k.run(
            "import tfmem_magic; w = tfmem_magic.predict(r, gpu='16GB')\n"
            "print(w.split['workspace'], any(n.startswith('No convolution') for n in w.notes))"
        )
        assert said["error"] is None and said["stdout"].strip().endswith("0 True"), said
        # a batch between, judged from the kept replay (no new probes): still none
        cell, r = fit(k, 0, code="attention.fit(seq, labels, batch_size=4096, epochs=1, verbose=0)")
        assert r["preflight"]["kept"] and r["preflight"]["gpu"]["convolves"] is False, r["preflight"]
        cell, r = fit(k, 0, code="blurred.fit(x, y, batch_size=4096, epochs=1, verbose=0)")
        gpu = r["preflight"]["gpu"]
        assert r["preflight"]["basis"] == "replay" and gpu["convolves"] is True, (r["preflight"], cell["stdout"])
        assert gpu["workspace_cap_bytes"] == 64 * 2**20
        # judged by its layers, no convolution; its graphs hold the loss's: the allowance comes back
        cell, r = fit(k, 0, code="dense_only.fit(x, x, batch_size=2048, epochs=1, verbose=0)")
        gpu = r["preflight"]["gpu"]
        assert r["preflight"]["basis"] == "replay" and gpu["convolves"] is True, (r["preflight"], cell["stdout"])
        assert gpu["workspace_cap_bytes"] == 64 * 2**20 and r["preflight"]["replay"]["convolves"] is True
    finally:
        k.close()

"""The built-in example: a small Keras CNN trained on synthetic images, measured by tfmem."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tfmem_magic.pipeline import Profiler

DEMO_SOURCE = """\
import numpy as np, keras
keras.utils.set_random_seed(0)
images = np.random.rand(4096, 32, 32, 3).astype("float32")       # 48 MiB of synthetic "photos"
labels = np.random.randint(0, 10, size=4096)
model = keras.Sequential([
    keras.Input((32, 32, 3)),
    keras.layers.Conv2D(32, 3, activation="relu", name="conv_a"),
    keras.layers.MaxPooling2D(name="pool_a"),
    keras.layers.Conv2D(64, 3, activation="relu", name="conv_b"),
    keras.layers.GlobalAveragePooling2D(name="gap"),
    keras.layers.Dense(10, name="logits"),
], name="demo_cnn")
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(images, labels, batch_size={batch}, epochs={epochs}, verbose=0)
"""


def demo_source(batch: int = 128, epochs: int = 1) -> str:
    return DEMO_SOURCE.format(batch=batch, epochs=epochs)


def run_demo(profiler: Profiler, batch: int = 128, epochs: int = 1) -> None:
    """Run the demo's source under `profiler` (a pipeline.Profiler, not yet started)."""
    code = compile(demo_source(batch, epochs), "<tfmem demo>", "exec")
    scope = {"__name__": "__tfmem_demo__"}  # outlives the block: --calibrate needs the model alive
    with profiler:
        exec(code, scope)

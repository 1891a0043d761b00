"""The pre-flight on padded batches (docs/preflight.md, 'Open dimensions'): keras-io's NER Transformer (a subclassed
model of custom layers, a custom `Loss`) fed a `padded_batch` pipeline, each batch padded to its longest sentence.
The element_spec leaves the length open; probes that made up a length of 1 predicted a step 48 times too small and
let it run past the limit. The probes must run at the length the call feeds, and the call be refused."""

from __future__ import annotations

import pytest
from test_kernel_faults import MARK, Kernel

pytestmark = pytest.mark.slow
LONGEST = 200  # the longest sentence: a batch of 512 pads to it

SETUP = f"""
%load_ext tfmem_magic
import json, numpy as np, tensorflow as tf, keras, psutil
layers = keras.layers
keras.utils.set_random_seed(0)

class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs, training=False):
        out1 = self.layernorm1(inputs + self.att(inputs, inputs))
        return self.layernorm2(out1 + self.ffn(out1))

class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, inputs):
        positions = tf.range(start=0, limit=tf.shape(inputs)[-1], delta=1)
        return self.token_emb(inputs) + self.pos_emb(positions)

class NERModel(keras.Model):
    def __init__(self, num_tags, vocab_size, maxlen=256, embed_dim=32, num_heads=2, ff_dim=32):
        super().__init__()
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        self.ff = layers.Dense(ff_dim, activation="relu")
        self.ff_final = layers.Dense(num_tags, activation="softmax")

    def call(self, inputs, training=False):
        return self.ff_final(self.ff(self.transformer_block(self.embedding_layer(inputs))))

class CustomNonPaddingTokenLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        loss = keras.losses.SparseCategoricalCrossentropy(reduction="none")(y_true, y_pred)
        mask = tf.cast(y_true > 0, "float32")
        return tf.reduce_sum(loss * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)

rng = np.random.default_rng(0)
lengths = np.where(rng.random(2048) < 0.01, {LONGEST}, rng.integers(5, 40, 2048))
lengths[0] = {LONGEST}  # the first batch holds the longest sentence too
tokens = [rng.integers(1, 4000, n) for n in lengths]
sentences = tf.data.Dataset.from_generator(
    lambda: ((t, t % 9) for t in tokens),
    output_signature=(tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)),
)
ner_model = NERModel(10, 4000)
ner_model.compile(optimizer="adam", loss=CustomNonPaddingTokenLoss())
ner_model.fit(sentences.take(64).padded_batch(16), epochs=1, verbose=0)  # TensorFlow running, the model built
limit = psutil.Process().memory_info().rss + 400 * 2**20
"""
REPORT = (
    f"print({MARK!r} + json.dumps({{'status': r.status, 'rss_peak': r.rss.peak_bytes, 'limit': limit, "
    "'notes': r.notes, "
    "'preflight': r.preflight and __import__('dataclasses').asdict(r.preflight), "
    "'error': r.error and r.error.message}))"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("open-dims"))
    setup = k.run(SETUP)
    assert setup["error"] is None, setup["stdout"][-3000:]
    yield k
    k.close()


def test_padded_batches_are_probed_at_the_length_they_feed_and_refused(kernel):
    cell = kernel.run(
        "%%tfmem --quick --limit {limit} --as r\nner_model.fit(sentences.padded_batch(512), epochs=1, verbose=0)"
    )
    r = kernel.run(REPORT)["data"]
    pre = r["preflight"]
    assert cell["error"] == "PreflightRefused", (cell["stdout"][-2000:], pre)
    assert pre["verdict"] == "refused" and f"the longest are {LONGEST}" in pre["fed_note"], pre
    # one attention score tensor at batch 512 and length 200 is 512 * 2 heads * 200 * 200 * 4 B = 156 MiB: the step
    # is far above it (the probes at a length of 1 predicted a few MiB)
    assert pre["step_bytes"] > 4 * 156 * 2**20, pre
    assert r["rss_peak"] < r["limit"], r  # refused before its first step
    named = pre["largest_batch"]
    assert named and named < 512, pre
    # the batch the refusal names runs within the same limit (judged again, from new probes)
    cell = kernel.run(
        f"%%tfmem --quick --limit {{limit}} --as r\nner_model.fit(sentences.padded_batch({named}), epochs=1, verbose=0)"
    )
    r = kernel.run(REPORT)["data"]
    assert cell["error"] is None, (cell["stdout"][-2000:], r["preflight"])
    assert r["status"] == "ok" and r["rss_peak"] <= r["limit"], r
    # judged as the refusal judged it: from the replay it kept for this model and these inputs (no new probes), and
    # accepted; what the process grew by since (the refused cell's report: a few MiB) may move the largest batch by
    # one step of 8 at most. No calibration after it: the replay stands for it
    again = r["preflight"]
    assert again["kept"] and again["probe_batches"] == pre["probe_batches"], again
    assert again["verdict"] in ("fits", "uncertain") and named - 8 <= again["largest_batch"] <= named, again
    assert not any(n.startswith("Calibrated as the cell ended") for n in r["notes"]), r["notes"]

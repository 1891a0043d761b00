"""The batch-size rewrite: only the literal changes, byte for byte; strings and comments are never touched."""

from __future__ import annotations

from tfmem_magic.advise.rewrite import find_batch_literals, rewrite_batch


def test_keyword_argument_is_rewritten_and_nothing_else():
    src = "# batch_size=64 is what the paper used\nmodel.fit(x, y,  batch_size=64 , epochs=2)  # keep me\n"
    out = rewrite_batch(src, 64, 24)
    assert out.source == src.replace("batch_size=64 ,", "batch_size=24 ,")
    assert out.source.startswith("# batch_size=64 is what")
    assert "64 → 24" in out.message and "line 2" in out.message


def test_strings_containing_batch_size_are_left_alone():
    src = 'print("batch_size=64")\nlog = f"{batch_size=}"\nBATCH_SIZE = 64\nmodel.fit(x, y, batch_size=BATCH_SIZE)\n'
    out = rewrite_batch(src, 64, 8)
    assert out.source == src.replace("BATCH_SIZE = 64", "BATCH_SIZE = 8")


def test_tf_data_batch_call():
    src = (
        "ds = (tf.data.Dataset.from_tensor_slices((x, y))\n      .shuffle(1000)\n      .batch(256)\n"
        "      .prefetch(2))\n"
    )
    out = rewrite_batch(src, 256, 96)
    assert out.source == src.replace(".batch(256)", ".batch(96)")
    assert out.changed[0].kind == "tf.data .batch()"


def test_several_candidates_only_the_one_that_ran_changes():
    src = "model.fit(x, y, batch_size=64)\nmodel.evaluate(xv, yv, batch_size=512)\n"
    out = rewrite_batch(src, 64, 32)
    assert out.source == "model.fit(x, y, batch_size=32)\nmodel.evaluate(xv, yv, batch_size=512)\n"
    ambiguous = rewrite_batch(src, 128, 32)  # neither is the batch that ran
    assert ambiguous.source is None and "several batch sizes" in ambiguous.message and "line 2" in ambiguous.message


def test_lone_literal_changes_even_if_the_batch_ran_smaller():
    # 100 samples with batch_size=256: Keras ran one batch of 100, the literal is still the one to change
    out = rewrite_batch("m.fit(x[:100], y[:100], batch_size=256)", 100, 50)
    assert out.source == "m.fit(x[:100], y[:100], batch_size=50)"


def test_none_found_or_set_elsewhere_says_so():
    none = rewrite_batch("model.fit(x, y)\n", 32, 16)
    assert none.source is None and "not written in this cell" in none.message and "16" in none.message
    elsewhere = rewrite_batch("model.fit(x, y, batch_size=BS)\n", 64, 16)
    assert elsewhere.source is None and "set BS = 16" in elsewhere.message
    broken = rewrite_batch("model.fit(x, y, batch_size=64\n", 64, 16)  # unbalanced: not Python yet
    assert broken.source is None


def test_names_that_are_not_batch_sizes_are_ignored():
    found, _ = find_batch_literals("num_batches = 10\nsteps = 64\nbatch_norm = 1\ntrain_batch_size = 48\nbs = 8\n")
    assert [(f.name, f.value) for f in found] == [("train_batch_size", 48), ("bs", 8)]

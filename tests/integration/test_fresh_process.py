"""Situations that need a fresh Python process: the allocator is chosen once, at TensorFlow's first op."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fresh import run_python

import tfmem_magic

pytestmark = pytest.mark.slow
PACKAGE = Path(tfmem_magic.__file__).parent


def interactive_modules() -> set[str]:
    """The package's modules a script must not load, found on disk (so a renamed or a new one is checked too):
    every module under adapters/ and every other module that imports IPython or ipywidgets at module level."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        imported = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
        if parts[1] == "adapters" or any(m.split(".")[0] in ("IPython", "ipywidgets") for m in imported):
            out.add(name)
    return out


def test_script_api_without_ipython_sees_every_allocation():
    data = run_python("""
        import json, sys, tfmem_magic
        tfmem_magic.prepare()
        import tensorflow as tf
        with tfmem_magic.profile(label="script") as p:
            x = tf.random.uniform((512, 256))
        r = p.report
        ours = sorted(m for m in sys.modules if m.split(".")[0] == "tfmem_magic")
        print(json.dumps({"ours": ours, "allocator": r.env.allocator,
                          "complete": r.env.allocator_complete, "grew": r.tf["CPU:0"].end_bytes,
                          "top": r.trace.at_peak[0].requested_bytes, "last": tfmem_magic.last_report() is r}))
    """)
    # Keras itself imports IPython (keras/src/saving/file_editor.py): check that our adapters and widgets stayed out
    ours, interactive = set(data.pop("ours")), interactive_modules()
    assert "tfmem_magic.adapters.magics" in interactive and "tfmem_magic.pipeline" in ours  # neither list is empty
    assert not ours & interactive, f"a script loaded {sorted(ours & interactive)}"
    assert data == {
        "allocator": "bfc_cpu_allocator_for_gpu",
        "complete": True,
        "grew": data["grew"],
        "top": 512 * 256 * 4,
        "last": True,
    }
    assert data["grew"] >= 512 * 256 * 4


def test_loaded_after_first_op_says_what_is_degraded():
    data = run_python("""
        import json
        import tensorflow as tf
        tf.constant(1.0)                       # TF is running before the extension loads
        from IPython.core.interactiveshell import InteractiveShell
        sh = InteractiveShell.instance()
        sh.run_line_magic("load_ext", "tfmem_magic")
        sh.run_cell("%%tfmem --as rep\\nimport tensorflow as tf\\n"
                    "small = tf.ones((16, 16))\\nbig = tf.ones((512, 512))")
        r = sh.user_ns["rep"]
        print(json.dumps({"allocator": r.env.allocator, "complete": r.env.allocator_complete,
                          "findings": [f.id for f in r.findings], "note": r.env.allocator_note}))
    """)
    # this CPU has AVX512_VNNI/BF16, so TF's default allocator is oneDNN's mklcpu
    # (docs/design.md, 'Allocators and what they see')
    assert data["allocator"] in ("mklcpu", "cpu") and data["complete"] is False
    assert "allocator-blind-spot" in data["findings"]
    assert "load_ext tfmem_magic" in data["note"]


def test_no_statistics_at_all_gives_an_rss_report_not_a_crash():
    data = run_python(
        """
        import json
        import tensorflow as tf
        tf.constant(1.0)
        import tfmem_magic
        with tfmem_magic.profile() as p:
            x = tf.ones((256, 256))
        r = p.report
        print(json.dumps({"allocator": r.env.allocator, "tf": r.tf, "status": r.status, "rss": r.rss.peak_bytes > 0,
                          "findings": [f.id for f in r.findings]}))
    """,
        env={"TF_ENABLE_ONEDNN_OPTS": "0"},
    )
    assert data["allocator"] == "cpu" and data["tf"] == {} and data["status"] == "ok" and data["rss"]
    assert "allocator-blind-spot" in data["findings"]


def test_without_tensorflow_reports_process_memory():
    data = run_python("""
        import json, sys
        sys.modules["tensorflow"] = None       # as if TensorFlow were not installed
        import tfmem_magic
        with tfmem_magic.profile() as p:
            block = bytearray(50 * 2**20)
        r = p.report
        print(json.dumps({"mode": r.mode, "tf": r.tf, "notes": r.notes, "grew": r.rss.peak_bytes - r.rss.baseline_bytes,
                          "text": tfmem_magic.render_text(r)}))
    """)
    assert data["mode"] == "quick" and data["tf"] == {}
    assert any("not installed" in n for n in data["notes"])
    assert data["grew"] >= 45 * 2**20


def test_fragmentation_rule_fires_when_the_allocator_holds_a_larger_chunk():
    """In a fresh process BFC grows its region to 128 MiB for a 66 MiB tensor and hands the whole chunk over (it
    splits a chunk only when the rest is large): 62 MiB held for nothing while the tensor lives."""
    data = run_python("""
        import json, tfmem_magic
        tfmem_magic.prepare()
        import tensorflow as tf
        tf.ones(4)
        with tfmem_magic.profile(label="fragmented") as p:
            a = tf.ones((66 * 2**20 // 4,))
        with tfmem_magic.profile(label="plain") as q:
            d = tf.ones((10 * 2**20 // 4,))
        ids = lambda r: sorted(f.id for f in r.findings)
        frag = next((f for f in p.report.findings if f.id == "fragmentation"), None)
        t = p.report.trace
        print(json.dumps({"fragmented": ids(p.report), "plain": ids(q.report), "waste": frag.bytes if frag else None,
                          "requested": t.requested_at_peak_bytes, "allocated": t.allocated_at_peak_bytes}))
    """)
    assert "fragmentation" in data["fragmented"] and "fragmentation" not in data["plain"]
    known = 66 * 2**20  # the tensor the cell made: what it requested, whatever the allocator handed out
    assert known <= data["requested"] <= known + 64 * 1024
    assert data["waste"] == data["allocated"] - data["requested"] >= 32 * 2**20

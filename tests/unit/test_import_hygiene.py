import subprocess
import sys


def test_core_import_pulls_no_ipython_widgets_or_tensorflow():
    code = ("import sys, tfmem_magic, tfmem_magic.pipeline, tfmem_magic.show.render, tfmem_magic.adapters.arguments;"
            "print([m for m in ('IPython', 'ipywidgets', 'tensorflow', 'keras') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_is_single_sourced():
    from importlib.metadata import version

    import tfmem_magic

    assert tfmem_magic.__version__ == version("tfmem_magic")

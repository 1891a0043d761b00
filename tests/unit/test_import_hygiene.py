import subprocess
import sys

HEAVY = ("IPython", "ipywidgets", "tensorflow", "keras", "matplotlib")


def loaded_after(code: str, setup: str = "") -> list[str]:
    """The HEAVY packages (top-level names) that `code` imports in a fresh interpreter, beyond what `setup` did."""
    script = (f"import sys\n{setup}\nbefore = set(sys.modules)\n{code}\n"
              "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} & set(%r)))" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip())  # a list literal printed by the child


def test_core_import_pulls_no_ipython_widgets_or_tensorflow():
    assert set(loaded_after("import tfmem_magic, tfmem_magic.pipeline, tfmem_magic.show.render, "
                            "tfmem_magic.adapters.arguments")) & {"IPython", "ipywidgets", "tensorflow", "keras"} \
        == set()


def test_the_pytest_plugin_pulls_nothing_heavy_until_asked():
    # installed as a pytest11 entry point, it is imported by every pytest run in the environment
    assert loaded_after("import tfmem_magic.adapters.pytest_plugin") == []


def test_the_keras_callback_adds_no_notebook_packages_to_what_keras_imports():
    # Keras 3 imports IPython itself (keras/src/saving/file_editor.py): the callback must add nothing to that
    assert set(loaded_after("import tfmem_magic.keras", setup="import keras")) & {"IPython", "ipywidgets",
                                                                                  "matplotlib"} == set()


def test_version_is_single_sourced():
    from importlib.metadata import version

    import tfmem_magic

    assert tfmem_magic.__version__ == version("tfmem_magic")

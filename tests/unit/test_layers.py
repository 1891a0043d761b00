"""The package's layers import only downwards: core <- measure <- analyze <- advise <- pipeline <- show <- adapters.

A lower layer that imported a higher one would tie, say, the measurement to the panel; the rule keeps each surface
replaceable and the core usable without IPython, ipywidgets or TensorFlow."""

import ast
from pathlib import Path

import tfmem_magic

PACKAGE = Path(tfmem_magic.__file__).parent
LAYERS = ["core", "measure", "analyze", "advise", "pipeline", "show", "adapters"]
# each layer's modules may import these third-party packages at module level (inside functions is the lazy path)
FORBIDDEN_AT_TOP = {
    "core": {"numpy", "tensorflow", "keras", "IPython", "ipywidgets", "psutil", "matplotlib"},
    "measure": {"IPython", "ipywidgets", "matplotlib"},
    "analyze": {"IPython", "ipywidgets"},
    "advise": {"IPython", "ipywidgets"},
    "pipeline": {"IPython", "ipywidgets"},
}


def layer_of(module: str) -> str | None:
    """'tfmem_magic.measure.tracer' -> 'measure'; top-level modules other than pipeline belong to no layer."""
    parts = module.split(".")
    if parts[0] != "tfmem_magic" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at module level) for every import statement in the file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{path}: relative import; the layers are checked on absolute names")
            out.append((node.module, id(node) in top))
            out += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
    return out


def package_modules() -> dict[str, Path]:
    return {
        ".".join(("tfmem_magic",) + p.relative_to(PACKAGE).with_suffix("").parts): p
        for p in PACKAGE.rglob("*.py")
        if "labextension" not in p.parts
    }


def test_every_module_belongs_to_a_layer():
    loose = {m for m in package_modules() if layer_of(m) is None}
    # the public facades: the package itself, `python -m tfmem_magic`, and `tfmem_magic.keras` (the callback)
    assert loose == {"tfmem_magic.__init__", "tfmem_magic.__main__", "tfmem_magic._version", "tfmem_magic.keras"}


def test_no_import_runs_up_the_layers():
    wrong = []
    for module, path in package_modules().items():
        mine = layer_of(module)
        if mine is None:
            continue
        for target, _ in imports(path):
            theirs = layer_of(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_lower_layers_keep_out_heavy_or_interactive_packages_at_import():
    wrong = []
    for module, path in package_modules().items():
        forbidden = FORBIDDEN_AT_TOP.get(layer_of(module) or "", set())
        for target, at_top in imports(path):
            if at_top and target.split(".")[0] in forbidden:
                wrong.append(f"{module} imports {target} at module level")
    assert wrong == []


def test_the_measured_report_is_built_without_advice():
    """The capture and the analysis build the report; only the pipeline composes the advice modules."""
    for module in ("tfmem_magic.measure.measurement", "tfmem_magic.analyze.build"):
        targets = {layer_of(t) for t, _ in imports(package_modules()[module])}
        assert "advise" not in targets and "show" not in targets, module

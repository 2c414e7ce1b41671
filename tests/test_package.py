"""The package's surface: help(rl_losses) lists the API (__all__), every public wrapper and config documents
each of its arguments and fields, py.typed ships with the package, and the modules import one another without
a cycle (so any of them can be imported first)."""
import ast
import dataclasses
import inspect
import os

import pytest

import rl_losses
from rl_losses import config, functional

PACKAGE = os.path.dirname(rl_losses.__file__)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WRAPPERS = ["cross_entropy", "z_loss", "grpo_loss", "gspo_loss"]
LINEAR = {"linear_cross_entropy": "cross_entropy", "linear_grpo_loss": "grpo_loss", "linear_gspo_loss": "gspo_loss"}


def test_all_lists_the_api_and_every_name_resolves():
    assert set(WRAPPERS) | set(LINEAR) | {"PolicyLossOutput", "LanguageModelLossConfig", "pack_documents",
                                           "Document"} <= set(rl_losses.__all__)
    for name in rl_losses.__all__:
        assert getattr(rl_losses, name).__doc__, name
    assert len(set(rl_losses.__all__)) == len(rl_losses.__all__)


@pytest.mark.parametrize("name", WRAPPERS + list(LINEAR))
def test_wrappers_document_every_argument(name):
    fn = getattr(functional, name)
    doc = inspect.getdoc(fn)
    # A fused-linear wrapper documents its own arguments and refers to its logits op for the others.
    documented = doc + (inspect.getdoc(getattr(functional, LINEAR[name])) if name in LINEAR else "")
    missing = [p for p in inspect.signature(fn).parameters if p not in documented]
    assert not missing, f"{name}'s docstring does not mention {missing}"
    if name in LINEAR:
        assert f"``{LINEAR[name]}``" in doc


def test_target_is_documented_as_the_next_token_labels():
    for name in ("cross_entropy", "grpo_loss", "gspo_loss"):
        assert "next-token labels" in inspect.getdoc(getattr(functional, name)), name


@pytest.mark.parametrize("cls", [c for c in vars(config).values() if isinstance(c, type)
                                 and issubclass(c, config.LanguageModelLossConfig)])
def test_configs_document_every_field(cls):
    # A field is documented on the class that declares it (the subclasses inherit the base's docstring).
    declared = [f.name for f in dataclasses.fields(cls) if f.name in cls.__dict__.get("__annotations__", {})]
    missing = [name for name in declared if name not in (cls.__doc__ or "")]
    assert not missing, f"{cls.__name__}'s docstring does not mention {missing}"


def test_py_typed_ships_with_the_package():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert '"py.typed"' in f.read()


def _module_level_imports(path: str) -> set[str]:
    """rl_losses submodules a module imports when it is loaded (not inside functions or TYPE_CHECKING)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rl_losses"):
                if node.module == "rl_losses":
                    found.update(alias.name for alias in node.names)
                else:
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("rl_losses."))

    visit(tree.body)
    return found


def test_no_import_cycle_between_the_modules():
    modules = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py"}
    graph = {m: _module_level_imports(os.path.join(PACKAGE, m + ".py")) & modules for m in modules}
    assert "losses" in graph["config"] and "config" not in graph["losses"]  # configs build the modules
    assert "distributed" in graph["functional"] and "functional" not in graph["distributed"]
    state = {}

    def walk(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for dep in sorted(graph[m]):
            walk(dep, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        walk(m, [])

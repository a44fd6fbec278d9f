# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""The installed package: its public names and its type-information marker."""

from __future__ import annotations

import ast
from pathlib import Path

import torchrl_gspo


def test_package_ships_py_typed():
    assert (Path(torchrl_gspo.__file__).parent / "py.typed").is_file()


def test_public_names_resolve():
    for name in torchrl_gspo.__all__:
        assert getattr(torchrl_gspo, name) is not None, name


def _module_imports() -> dict[str, set[str]]:
    """Each package module's imports of other package modules, ``TYPE_CHECKING`` ones
    and those inside functions included; modules are named by their dotted path in the
    package (``moe.routing``), a subpackage by its folder (``moe``), the package itself
    ``__init__``."""
    root = Path(torchrl_gspo.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = (
            ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)
        )
        paths[name] = path

    def resolve(dotted: str) -> str:
        """A module name of the package for an absolute ``torchrl_gspo...`` name."""
        inner = dotted.removeprefix("torchrl_gspo").lstrip(".")
        while inner and inner not in paths:
            inner = inner.rpartition(".")[0]
        return inner or "__init__"

    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {resolve(a.name) for a in node.names if a.name.startswith("torchrl_gspo")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torchrl_gspo"
            ):
                edges |= {resolve(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path of modules, or None (a depth-first search)."""
    done, path = set(), []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(name)
        return None

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_package_modules():
    graph = _module_imports()
    assert graph["scores"] >= {"_reader", "_checks"}  # the reader sees the edges
    assert graph["moe.routing"] >= {"moe._routers"} and "moe" in graph["__init__"]
    assert _cycle(graph) is None


def _code_lines(function: ast.FunctionDef, lines: list[str]) -> int:
    """Lines of ``function`` holding code: its docstring, comments and blank lines
    not counted."""
    skip = set()
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    span = range(function.lineno, function.end_lineno + 1)
    return sum(
        1
        for number in span
        if number not in skip
        and lines[number - 1].strip()
        and not lines[number - 1].strip().startswith("#")
    )


def test_no_function_over_50_code_lines():
    root = Path(torchrl_gspo.__file__).parent
    long = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = _code_lines(node, text.splitlines())
                long += [f"{path.stem}.{node.name}: {count}"] if count > 50 else []
    assert not long


def test_the_line_counter_leaves_out_docstrings_comments_and_blanks():
    source = 'def f():\n    """Doc.\n\n    more."""\n    # a comment\n\n    x = 1\n    return x\n'
    (function,) = ast.parse(source).body
    assert _code_lines(function, source.splitlines()) == 3  # def, x = 1, return


DESIGN = Path(__file__).parents[1] / "docs" / "source" / "design.rst"


def test_the_design_page_names_every_module():
    table = DESIGN.read_text().split("One call")[0]
    root = Path(torchrl_gspo.__file__).parent
    missing = [
        p.name for p in root.glob("*.py") if p.stem != "__init__" and f"``{p.name}``" not in table
    ]
    assert not missing


def test_the_design_page_lists_gmpos_hook_as_written():
    """The page's GMPO listing is ``GMPOLoss._objective`` less its docstring."""
    import inspect
    import textwrap

    from torchrl_gspo import GMPOLoss

    source = textwrap.dedent(inspect.getsource(GMPOLoss._objective)).splitlines()
    function = ast.parse("\n".join(source)).body[0]
    docstring = range(function.body[0].lineno, function.body[0].end_lineno + 1)
    code = [line for number, line in enumerate(source, 1) if number not in docstring]
    page = textwrap.dedent(DESIGN.read_text().split("def _objective(self, scores: Scores)")[1])
    listed = ("def _objective(self, scores: Scores)" + page).split("\n\n")[0]
    assert textwrap.indent("\n".join(code), "    ").strip() == textwrap.indent(listed, "").strip()

"""The import graph of Relay's own code has no circle and no upward arrow.

Every `.py` under src/relay, procs, ipc and launch is parsed with `ast`; every Import and
ImportFrom node counts, wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`). An import of a package's submodule is an edge to that submodule;
`from pkg import name` is an edge to `pkg.name` when that is a module, otherwise to `pkg`
(its `__init__`). Edges to anything outside these packages are ignored.

The layers below describe the design, lowest first: a module may import its own layer or a
lower one, never a higher one (and never so that a circle forms, even within a layer).
"""

from __future__ import annotations

import ast
import os

from tests.helpers.paths import ROOT

# (directory holding the top-level package, top-level package)
PACKAGES = (("src", "relay"), ("", "procs"), ("", "ipc"), ("", "launch"))

# Lowest first. An entry is a module, or `pkg.*`: the package and every module under it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # What every stage shares: configuration, request parameters and records, the step
    # contract between the scheduler and the model runner (relay.step), rope math, small
    # utilities.
    (
        "base",
        (
            "relay.cache_dir",
            "relay.checkpoint_quant",
            "relay.config",
            "relay.health",
            "relay.hf_config",
            "relay.hf_deepseek",
            "relay.lifecycle",
            "relay.metrics",
            "relay.optional_features",
            "relay.outputs",
            "relay.rope",
            "relay.sampling_params",
            "relay.step",
        ),
    ),
    # The paged KV pool, its allocator and the radix prefix cache.
    ("memory", ("relay.memory.*",)),
    # Tokenizer, detokenizer, grammar-constrained decoding (no tensors).
    ("text", ("relay.text.*",)),
    # Running a step: model runner, layers, models, kernels, sampler, the draft-model runner.
    ("execution", ("relay.execution.*",)),
    # Which requests run each step; speaks to execution only through relay.step.
    ("scheduling", ("relay.scheduling.*",)),
    # The HTTP APIs.
    ("api", ("relay.api.*",)),
    # The offline engine: scheduler and runner in one process.
    ("engine", ("relay.engine",)),
    # The package's public names (`relay.Engine` is imported on first use).
    ("public", ("relay",)),
    # The wire between processes, one module per process, their wiring.
    ("ipc", ("ipc.*",)),
    ("procs", ("procs.*",)),
    ("launch", ("launch.*",)),
)

# Known violations still to fix, as (importer, imported) module pairs; empty when done.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, str]:
    """Module name -> file path."""
    found = {}
    for base, top in PACKAGES:
        start = os.path.join(ROOT, base, top)
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.join(ROOT, base) if base else ROOT)
                parts = rel[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _is_package(modules: dict[str, str], name: str) -> bool:
    return modules.get(name, "").endswith("__init__.py")


def _target(modules: dict[str, str], name: str) -> str | None:
    """The module an import of `name` loads last: `name` itself, or its nearest parent we own."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        package = module if _is_package(modules, module) else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for name in targets:
                target = _target(modules, name)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def layer_of(module: str) -> int:
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            package = entry[:-2] if entry.endswith(".*") else None
            if module == entry or (
                package and (module == package or module.startswith(package + "."))
            ):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One chain per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(root: str) -> None:
        # iterative Tarjan
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_chain(graph, set(component)) for component in components]


def _chain(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module, as a readable chain."""
    start = min(component)
    previous = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    chain = [node]
                    while previous[chain[-1]] is not None:
                        chain.append(previous[chain[-1]])
                    return list(reversed(chain)) + [start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    return sorted(component)


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module) and (module, target) not in ALLOWED
    )


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_circles():
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_upward_arrows():
    found = upward_arrows(import_graph())
    lines = [
        f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for module, target in found
    ]
    assert not found, "upward imports:\n" + "\n".join(lines)


def test_allowed_list_is_current():
    """Every whitelisted pair still exists and still points upward (remove fixed ones)."""
    graph = import_graph()
    stale = [
        pair
        for pair in ALLOWED
        if pair[1] not in graph.get(pair[0], ()) or layer_of(pair[1]) <= layer_of(pair[0])
    ]
    assert not stale, f"no longer needed in ALLOWED: {sorted(stale)}"


if __name__ == "__main__":
    g = import_graph()
    for c in cycles(g):
        print("circle:", " -> ".join(c))
    for m, t in upward_arrows(g):
        print("up:", m, f"({LAYERS[layer_of(m)][0]})", "->", t, f"({LAYERS[layer_of(t)][0]})")

"""The import map of the repository: no circles, no import from a lower layer to a higher one,
folders that are layers, and the torch-free parts stay torch-free.

Every first-party module is in ``LAYERS`` (bottom first); a module may import modules of its own
layer or below. A new module fails ``test_every_module_has_a_layer`` until it is placed, and a
new top-level package fails ``test_every_package_is_scanned`` until its modules are. Imports
inside functions count too: a lazy import hides a circle from Python, not from this test; their
number may only shrink (``LAZY_IMPORTS``).

Folders are layers too: a *room* is a top-level package, or one of ``training``'s sub-packages
or top-level modules (``training`` is opened one level: its config sits at the bottom and its
entry points at the top). No two rooms may import each other, directly or around a circle
(``test_no_folder_ties``), so a package can be read, tested and moved as one piece.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from support import node_reason

REPO_ROOT = Path(__file__).resolve().parents[1]
OPENED = ("training",)
"""Top-level packages whose sub-packages and top-level modules are rooms of their own."""
LAZY_IMPORTS = 47
"""First-party imports inside functions (``_lazy_imports``): at most this many. Lower it when
a move removes some; a new one needs a reason a comment at the import gives (a CLI that stays
torch-free until a command needs torch, an optional dependency)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: standard library only
    (
        "training",
        "training.exits",
        "training.durable",
        "training.tables",
        "training.modes",
        "training.runlog",
        "training.runlog.files",
        "training.runlog.phases",
        "training.runlog.writer",
        "training.runlog.replica",
        "training.shards",
        # the Kubernetes API (the client is imported inside): the launchers' Job client, and the
        # pod's own cluster actions (the straggler policy counts the spares, the supervisor cordons)
        "ops",
        "ops.cluster",
        "ops.cordon",
        "training.resilience",
        "training.faults",
        "training.checkpoint",
        "training.checkpoint.lifetime",
        "training.checkpoint.committer",
        "training.launch",
        "training.launch.rdzv_store",
        "training.launch.reaper",
        "training.observe",
        "training.observe.catalog",
        "training.observe.efa",
        "training.resilience.gloo_abort",
        "training.resilience.hang",
        "training.replica",
        "training.replica.topology",
        "facts",
        "facts.checkpoint",
        "facts.fsx",
        "facts.hardware",
        "facts.prices",
        "facts.recipes",
        "manifests",
        "manifests.sizes",
        "planner",
        # the node fencer's policy and shipped settings (standard library)
        "infra.fencer",
        "infra.fencer.settings",
        "infra.fencer.decide",
        "infra.fencer.metrics",
    ),
    # configuration, and what reads a run directory
    (
        "training.config",
        "training.runlog.verdict",
        "training.runlog.metrics",
        "training.runlog.accounting",
    ),
    (
        "training.recipes",
        "training.overrides",
        "training.runlog.report",
        "training.runlog.tensorboard",
        "training.observe.view",
        "training.observe.launch",
        "training.hooks",
        "training.stop",
        "training.startup_check",
        "training.allreduce_check",
        "training.replica.launch",
    ),
    # the pieces of a training run
    (
        "training.data",
        "training.model",
        "training.checkpoint.layout",
        "training.checkpoint.device_threads",
        "training.checkpoint.integrity",
        "training.checkpoint.staging",
        "training.checkpoint.torch_async",
        "training.checkpoint.memory",
        "training.checkpoint.snapshot_files",
        "training.checkpoint.tiers",
        "training.checkpoint.transfer",
        "training.command",
        "training.observe.exporter",
    ),
    (
        "training.parallel",
        "training.checkpoint.nvrx_async",
        "training.checkpoint.local",
        "training.checkpoint.pod_memory",
        "training.checkpoint.storage",
        "training.checkpoint.peer",
        "training.resilience.inject",
        "training.resilience.straggler",
    ),
    ("training.checkpoint.engines", "training.checkpoint.registry", "training.checkpoint.restore"),
    ("training.checkpoint.manager",),
    ("training.trainer",),
    ("training.replica.trainer",),
    ("training.run",),
    ("training.resilience.step_hooks",),
    # restart layers around a run
    (
        "training.resilience.nvrx",
        "training.resilience.injob",
        "training.resilience.inprocess",
    ),
    ("training.resilience.layer",),
    # the Kubernetes objects (they embed the launcher command), then what deploys them
    (
        "manifests.objects",
        "manifests.objects.common",
        "manifests.objects.cordon",
        "manifests.objects.system_service",
        "manifests.objects.rdzv_store",
        "manifests.objects.job",
        "manifests.objects.spares",
        "manifests.objects.shared",
    ),
    ("manifests.render",),
    ("manifests.replica",),
    (
        "manifests.kustomize",
        "infra.config",
        "infra.nag",
        "infra.network",
        "infra.k8s_immutable",
        "infra.aws_call",
        "infra.addon_versions",
        "infra.replacements",
        "infra.pod_identity",
        "infra.fencer.ec2",
    ),
    (
        "infra.first_deploy",
        "infra.images",
        "infra.cluster",
        "infra.image",
        "infra.storage",
        "infra.sizing",
        "infra.gpu_nodegroup",
        "infra.workloads",
        "infra.observability",
        "infra.node_fencer",
        "infra.fencer.controller",
    ),
    ("infra.addons", "infra.deployed"),
    ("infra.fencer.__main__",),
    ("infra.stack", "infra.deploy_target", "infra.alert_probe", "infra.guard", "infra"),
    # launchers and command lines
    (
        "training.launch.local",
        "training.launch.pod",
        "training.launch.eks",
        "training.__main__",
        "manifests.preflight",
    ),
    # the planner (reads facts and bench results), bottom first
    ("planner.ettr", "planner.spares", "planner.sources", "planner.fsx"),
    ("planner.failures",),
    ("planner.tiers",),
    ("planner.costs",),
    ("planner.measured", "planner.plan"),
    ("planner.plot", "planner.report", "planner.sanity", "planner.overlays"),
    ("planner.cli",),
    ("planner.__main__",),
    # the pod emulation (tests/pods and bench.node_loss run it): above the manifests it renders
    # and the trainer it starts, below the benchmarks
    ("podsim", "podsim.model", "podsim.machine", "podsim.state"),
    ("podsim.cluster", "podsim.kube_api", "podsim.slow_node"),
    ("podsim.control_plane",),
    ("podsim.ec2",),
    ("podsim.jobs",),
    # benchmarks: above everything they measure
    ("bench", "bench.common", "bench.summary"),
    (
        "bench.checkpoint",
        "bench.goodput",
        "bench.node_loss",
        "bench.overhead",
        "bench.peer",
        "bench.restart",
        "bench.restore",
    ),
    ("bench.exporter",),
    ("bench.run_all",),
)

PACKAGES = tuple(sorted({module.split(".")[0] for layer in LAYERS for module in layer}))
"""The top-level packages scanned: every one that ``LAYERS`` names."""

TORCH_FREE = (
    "training.modes",
    "training.config",
    "training.recipes",
    "training.overrides",
    "training.faults",
    "training.hooks",
    "training.runlog.report",
    "training.command",
    "training.launch.pod",
    # the local launcher (`make train`, every local run of the tests): torch there cost ~5 s of
    # CPU before any rank started
    "training.launch.local",
    "ops.cordon",
    "ops.cluster",
    "training.observe.exporter",
    "manifests.render",
    "manifests.kustomize",
    "infra.stack",
    "planner.cli",
)
"""Modules whose whole import closure must not load torch: the CDK app, the manifests, the
planner, config checks (faults included) and the pod supervisor start in a second, not in ten."""


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [
                    resolve(f"{node.module}.{alias.name}") or resolve(node.module)
                    for alias in node.names
                ]
            graph[module] |= {t for t in targets if t and t != module}
    return graph


def _room(module: str) -> str:
    """The folder a module belongs to, as a layer: see the module docstring."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in OPENED else parts[0]


def _room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        rooms[_room(module)] |= {_room(t) for t in targets} - {_room(module)}
    return rooms


def _lazy_imports(modules: dict[str, Path]) -> list[str]:
    """``module:line`` of each first-party import inside a function body."""
    first_party = {name.split(".")[0] for name in modules}
    found = set()
    for module, path in modules.items():
        for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                if any(name.split(".")[0] in first_party for name in names):
                    found.add(f"{module}:{node.lineno}")
    return sorted(found)


def _layer_of() -> dict[str, int]:
    layer_of: dict[str, int] = {}
    for index, layer in enumerate(LAYERS):
        for module in layer:
            assert module not in layer_of, f"{module} is in LAYERS twice"
            layer_of[module] = index
    return layer_of


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    layer_of = _layer_of()
    modules = _modules()
    assert sorted(set(modules) - set(layer_of)) == [], "place these modules in LAYERS"
    assert sorted(set(layer_of) - set(modules)) == [], "LAYERS names modules that do not exist"


def test_every_package_is_scanned() -> None:
    """A new top-level package (a folder with ``__init__.py``) is placed in ``LAYERS``."""
    found = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")} - {"tests"}
    assert sorted(found - set(PACKAGES)) == [], "place these packages' modules in LAYERS"


def test_no_import_circles() -> None:
    assert _cycles(_import_graph(_modules())) == []


def test_no_module_imports_a_higher_layer() -> None:
    layer_of = _layer_of()
    upward = [
        f"{module} (layer {layer_of[module]}) imports {target} (layer {layer_of[target]})"
        for module, targets in sorted(_import_graph(_modules()).items())
        for target in sorted(targets)
        if module in layer_of and target in layer_of and layer_of[target] > layer_of[module]
    ]
    assert upward == []


def test_no_folder_ties() -> None:
    """No room imports a room that imports it back (directly or around a circle): each folder
    sits on one band of layers. Each tie is printed with the module imports that make it."""
    graph = _import_graph(_modules())
    ties = []
    for rooms in _cycles(_room_graph(graph)):
        ties.append(" <-> ".join(rooms))
        ties += [
            f"    {module} -> {target}"
            for module, targets in sorted(graph.items())
            for target in sorted(targets)
            if _room(module) != _room(target) and {_room(module), _room(target)} <= set(rooms)
        ]
    assert ties == [], "\n".join(ties)


def test_imports_inside_functions_do_not_grow() -> None:
    lazy = _lazy_imports(_modules())
    assert len(lazy) <= LAZY_IMPORTS, "imports inside functions:\n" + "\n".join(lazy)


def test_the_checker_sees_circles_and_upward_imports() -> None:
    """The checks above on hand-made graphs, so that they can fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # Two folders whose modules import each other without a module circle: a folder tie.
    modules = {"ops.client": {"manifests.sizes"}, "manifests.preflight": {"ops.client"}}
    assert _cycles(modules) == []
    assert _cycles(_room_graph(modules)) == [["manifests", "ops"]]
    # training is opened one level: its sub-packages and top-level modules are rooms.
    assert _room("training.launch.eks") == "training.launch"
    assert _room("training.config") == "training.config"
    assert _room("podsim.emulator") == "podsim"
    graph = _import_graph(_modules())
    assert "training.checkpoint.layout" in graph["training.checkpoint.manager"]
    assert "training.exits" in graph["training.config"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "module",
    [
        # aws-cdk-lib starts Node.js when imported (tests/conftest.py: INFRA)
        pytest.param(m, marks=pytest.mark.requires(reason=node_reason()))
        if m == "infra.stack"
        else m
        for m in TORCH_FREE
    ],
)
def test_torch_free_modules_do_not_load_torch(module: str) -> None:
    code = (
        f"import {module}, sys\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "sys.exit('loaded ' + loaded[0] if loaded else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_config_with_faults_is_checked_without_torch() -> None:
    code = (
        "import sys\n"
        "from training.overrides import build_config\n"
        "build_config(['--faults=exception@0:3;sigkill@1:5'])\n"
        "sys.exit('torch loaded' if 'torch' in sys.modules else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stdout + done.stderr

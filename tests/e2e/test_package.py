"""The package surface: lazy top-level exports, the engine's core modules, what imports without torch, and the
names its loggers go by."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import ferrox_batch


def test_the_admission_arithmetic_imports_without_torch():
    code = (
        "import sys\n"
        "import ferrox_batch.admission.block_budget, ferrox_batch.admission.queue, ferrox_batch.admission.counters\n"
        "import ferrox_batch.admission.config, ferrox_batch.admission.step_budget\n"
        "import ferrox_batch.admission.clock, ferrox_batch.admission.status, ferrox_batch.admission.budget\n"
        "import ferrox_batch.generation_types\n"
        "import ferrox_batch.scheduler.step_cost\n"
        "import ferrox_batch.usage, ferrox_batch.errors\n"
        "import ferrox_batch.cancel, ferrox_batch.policy.stop, ferrox_batch.policy.utf8_stream\n"
        "import ferrox_batch.admission.kv\n"
        "import ferrox_batch.scheduler.scheduler, ferrox_batch.scheduler.request, ferrox_batch.scheduler.plan\n"
        "import ferrox_batch.scheduler.sink\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_top_level_exports_resolve():
    for name in ferrox_batch.__all__:
        assert getattr(ferrox_batch, name) is not None
    assert ferrox_batch.ContinuousBatcher.__name__ == "ContinuousBatcher"


#: The engine's core: the scheduler (pure Python), the model runner, and the worker and handle over them.
CORE_MODULES = [
    "ferrox_batch.scheduler",
    "ferrox_batch.scheduler.plan",
    "ferrox_batch.scheduler.request",
    "ferrox_batch.scheduler.scheduler",
    "ferrox_batch.scheduler.sink",
    "ferrox_batch.runtime.runner",
    "ferrox_batch.engine.worker",
    "ferrox_batch.engine.wiring",
    "ferrox_batch.engine.handle",
    "ferrox_batch.engine.ticket",
]

#: Moved onto the layers: `batch/` became `admission/` (the upstream's modules) and `engine/` (the handle and
#: the worker), `models/` became `runtime/` (README, "What moved"); a request's state lives in one `Request`.
REMOVED_MODULES = ["ferrox_batch.batch", "ferrox_batch.models"]


def test_the_core_modules_import_and_the_replaced_ones_are_gone():
    for name in CORE_MODULES:
        importlib.import_module(name)
    present = {module.name for module in pkgutil.walk_packages(ferrox_batch.__path__, "ferrox_batch.")}
    assert set(CORE_MODULES) <= present
    for name in REMOVED_MODULES:
        assert name not in present and importlib.util.find_spec(name) is None, name


#: The torch release that brought each torch API the code relies on.
TORCH_APIS = {"scaled_dot_product_attention(enable_gqa=...)": (2, 5)}


def test_the_declared_torch_floor_has_every_api_the_code_uses():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9]+)\.([0-9]+)', pyproject)
    assert floor is not None, "pyproject.toml declares no torch floor"
    declared = (int(floor[1]), int(floor[2]))
    for api, since in TORCH_APIS.items():
        assert declared >= since, f"{api} needs torch {since}, pyproject.toml accepts {declared}"


def test_the_reply_event_type_is_exported_under_the_upstream_name():
    from ferrox_batch.replies import Chunk, Finished, Reply

    assert "BatcherEvent" in ferrox_batch.__all__
    assert ferrox_batch.BatcherEvent == Reply == Chunk | Finished
    assert isinstance(Chunk("x"), ferrox_batch.BatcherEvent) and isinstance(Finished(None), ferrox_batch.BatcherEvent)
    # Beside the upstream's other configuration names, as its `config` module exported them.
    assert {"BatcherConfig", "DecodeFn", "BatcherEvent"} <= set(ferrox_batch.__all__)


PACKAGE = Path(ferrox_batch.__file__).parent


def _logger_names(path: Path) -> list[tuple[int, bool, str | None]]:
    """(line, at module level, the name or None where it is no literal) of every `getLogger(...)` in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node.value) for node in tree.body if isinstance(node, ast.Assign)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger":
            arg = node.args[0] if node.args else None
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
            found.append((node.lineno, id(node) in top, name))
    return found


def test_every_logger_is_named_after_the_package_it_lives_in():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        package = ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")
        ancestors = {".".join(package.split(".")[:i]) for i in range(1, package.count(".") + 2)}
        for line, module_level, name in _logger_names(path):
            # A module's own logger is its package's; the command line configures the package's top.
            if name != package if module_level else name not in ancestors:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} logs as {name!r}, lives in {package}")
    assert not wrong, "loggers named after another package:\n" + "\n".join(wrong)

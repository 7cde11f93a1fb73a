"""Importing a module whose extra is not installed names the extra (ADR 0081).

From a plain ``pip install stopline`` (no extras), ``import
stopline.integrations.temporal`` and its neighbours raised a bare
``ModuleNotFoundError: No module named 'temporalio'`` from deep inside the
integration's imports, never saying which extra provides it. Now each says
``pip install 'stopline[<extra>]'`` and is still a ``ModuleNotFoundError`` whose
``name`` is the missing module.

And the other way round: ``pip install 'stopline[pydantic-ai]'`` (as
docs/frameworks/pydantic-ai.md says) installed ``pydantic-ai-slim`` without the
fastmcp client its MCP toolsets need, so ``import stopline.integrations.pydantic_ai``
failed with pydantic-ai's ``ImportError`` right after the documented install. Each
integration's extra is installed here and its module imported. The wheel and the
fresh virtual environment are those of ``test_install`` (``conftest``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.packaging.conftest import installed, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# each module that needs an extra, the extra, and the module it is missing first
NEEDING = [
    ("stopline.integrations.temporal", "temporal", "temporalio"),
    ("stopline.integrations.dbos", "dbos", "dbos"),
    ("stopline.integrations.langgraph", "langgraph", "langgraph"),
    ("stopline.integrations.openai_agents", "openai-agents", "agents"),
    ("stopline.integrations.pydantic_ai", "pydantic-ai", "pydantic_ai"),
    ("stopline.console", "console", "jinja2"),
]

PROBE = """
import json, sys
try:
    __import__(sys.argv[1])
except ModuleNotFoundError as exc:
    print(json.dumps({"message": str(exc), "name": exc.name}))
else:
    print(json.dumps(None))
"""


@pytest.fixture(scope="module")
def venv_with_extras(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    extras = ",".join(extra for _module, extra, _missing in NEEDING)
    # --no-compile: the imports below compile what they read; the rest (~30% of the
    # install's time, most of the extras' packages) was compiled for nothing
    where = tmp_path_factory.mktemp("extras") / "venv"
    return installed(where, dist, extras, "--no-compile")


@pytest.mark.parametrize(("module", "extra", "missing"), NEEDING)
def test_importing_a_module_without_its_extra_names_the_extra(
    venv: Path, tmp_path: Path, module: str, extra: str, missing: str
) -> None:
    probed = run(venv / "bin" / "python", "-c", PROBE, module, cwd=tmp_path)
    assert probed.returncode == 0, probed.stderr
    caught = json.loads(probed.stdout)
    assert caught is not None, f"{module} imported without its extra"
    assert f"pip install 'stopline[{extra}]'" in caught["message"]
    assert module in caught["message"]
    assert caught["name"] == missing


def test_the_modules_that_need_no_extra_import_from_a_plain_install(
    venv: Path, tmp_path: Path
) -> None:
    modules = [
        "stopline",
        "stopline.integrations",
        "stopline.integrations.mcp",
        "stopline.integrations.mcp.tasks",
        "stopline.integrations.mcp.tasks_client",
        "stopline.integrations.mcp.check",
        "stopline.integrations.temporal_server",
        "stopline.testing",
        "stopline.telemetry",
        "stopline.demo",
    ]
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    probed = run(venv / "bin" / "python", "-c", code, *modules, cwd=tmp_path)
    assert probed.returncode == 0, probed.stderr


def test_each_module_imports_once_its_extra_is_installed(
    venv_with_extras: Path, tmp_path: Path
) -> None:
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    modules = [module for module, _extra, _missing in NEEDING]
    probed = run(venv_with_extras / "bin" / "python", "-c", code, *modules, cwd=tmp_path)
    assert probed.returncode == 0, probed.stderr

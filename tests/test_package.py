"""The installed distribution: one top-level package, ``trainproof``, that never shadows a user's own ``storage/`` or
``job/`` package; and the declared Python range is the one the code needs (a static check over every module).

The wheel is built from this checkout and installed, without its dependencies, into a fresh virtualenv that sees
the test environment's third-party packages (torch, ...) through a ``.pth`` line but not this checkout; a user
folder with its own ``storage`` and ``job`` packages and a task that imports both then trains through the installed
console script, from that folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from tests.support.timing import budget

ROOT = Path(__file__).resolve().parent.parent


def _requires_python() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'^requires-python = ">=(3\.\d+)"$', text, re.M)
    assert found, "pyproject.toml declares requires-python as '>=3.N'"
    return found.group(1)


def _vermin(*paths: str) -> subprocess.CompletedProcess:
    vermin = Path(sys.executable).parent / "vermin"
    if not vermin.exists():
        pytest.skip("vermin is not installed (it comes with the test extras: pip install -e '.[test]')")
    return subprocess.run([str(vermin), f"-t={_requires_python()}-", "--violations", "--no-tips",
                           "--eval-annotations", *paths], cwd=ROOT, capture_output=True, text=True, timeout=budget(300))


def test_the_declared_python_range_is_what_the_code_needs():
    """Every module of the product runs on the oldest Python that pyproject.toml admits."""
    result = _vermin("trainproof")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_minimum_version_check_can_fail(tmp_path):
    (tmp_path / "newer.py").write_text("import tomllib\n")  # 3.11's standard library
    assert _requires_python() == "3.10"
    assert _vermin(str(tmp_path / "newer.py")).returncode != 0


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel built from this checkout (its bin/ folder)."""
    base = tmp_path_factory.mktemp("package")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(base / "dist"), str(ROOT)], capture_output=True, text=True, timeout=budget(600))
    assert built.returncode == 0, built.stderr
    wheel = next((base / "dist").glob("trainproof-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name}
    assert tops == {"trainproof"}, f"the wheel installs more than one top-level name: {sorted(tops)}"
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=budget(300))
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The test environment's packages, but not its editable hook for this checkout (a .pth line adds a folder
    # without running that folder's own .pth files).
    Path(site, "test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=budget(600))
    assert done.returncode == 0, done.stderr
    return venv / "bin"


def test_the_wheel_trains_a_task_beside_a_users_own_storage_and_job_packages(installed, tmp_path):
    user = tmp_path / "project"
    for pkg in ("storage", "job"):
        (user / pkg).mkdir(parents=True)
        (user / pkg / "__init__.py").write_text(f"WHO = 'the user\\'s own {pkg}'\n")
    (user / "mytask.py").write_text(textwrap.dedent('''
        import torch
        from torch.utils.data import TensorDataset

        import job
        import storage
        from trainproof.tasks import DatasetTask

        def factory(config):
            assert storage.WHO == "the user's own storage" and job.WHO == "the user's own job"
            x = torch.linspace(-1, 1, 8).unsqueeze(1)
            return DatasetTask(dataset=TensorDataset(x, 2 * x), build_model=lambda: torch.nn.Linear(1, 1),
                               per_sample_loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).squeeze(1),
                               config=dict(config), batch_size=4)
    '''))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINPROOF_", "PYTHON"))}
    env["TRAINPROOF_LOG_FORMAT"] = "json"
    where = subprocess.run([str(installed / "python"), "-c", "import trainproof; print(trainproof.__file__)"],
                           cwd=user, env=env, capture_output=True, text=True, timeout=budget(120))
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(installed.parent), where
    result = subprocess.run([str(installed / "trainproof"), "train", "--store", "./run", "--task", "mytask:factory",
                             "--max-steps", "3"], cwd=user, env=env, capture_output=True, text=True, timeout=budget(600))
    assert result.returncode == 0, result.stderr
    assert json.loads((user / "run" / "summary.json").read_text())["step"] == 3
    listed = subprocess.run([str(installed / "python"), "-m", "trainproof", "ls", "--store", "./run", "--json"],
                            cwd=user, env=env, capture_output=True, text=True, timeout=budget(120))
    assert listed.returncode == 0 and '"step": 3' in listed.stdout, listed.stdout + listed.stderr

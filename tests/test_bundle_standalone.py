"""An export bundle loads with nothing but ``torch`` and ``safetensors``: the README snippet, taken verbatim from
the bundle's README.md, runs in an interpreter that cannot import ``trainproof`` (``python -S -E -s``
whose import path is the bundle folder, the standard library and a folder exposing only torch, safetensors and
their declared dependencies) and reproduces the metric of ``metrics.json`` within the tolerance the README states.

Runs for regression, tinylm and examples.charlm (trained by ``python -m trainproof train``, exported in this process).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.timing import budget
from tests.test_train_helpers import run

ROOT = Path(__file__).resolve().parent.parent

# The interpreter's import path: '' (the working directory: the bundle copy), the torch-only folder, the
# standard library. Before anything else it proves that trainproof is out of reach.
BOOT = """
import importlib.util, sys
sys.path.insert(1, {site!r})
reachable = [m for m in ("trainproof", "tests") if importlib.util.find_spec(m) is not None]
print("TRAINPROOF-REACHABLE", reachable)
exec(compile(open("snippet.py").read(), "README.md", "exec"), {{"__name__": "__main__"}})
"""


def _closure(*names: str) -> list[md.Distribution]:
    """The installed distributions ``names`` need at run time (their requirements, transitively, markers applied)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency this machine does not have: the import cannot need it
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


@pytest.fixture(scope="module")
def torch_only_site(tmp_path_factory) -> Path:
    """A folder of links to torch, safetensors and their dependencies only (what `pip install torch safetensors`
    puts in a fresh virtualenv)."""
    site = link_site(tmp_path_factory.mktemp("torch-only-site"), "torch", "safetensors")
    assert not {"numpy", "trainproof"} & {p.name for p in site.iterdir()}
    return site


def link_site(site: Path, *names: str) -> Path:
    """``site`` filled with links to the top-level folders and modules of ``names`` and their dependencies."""
    for dist in _closure(*names):
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(dist.locate_file(top))
            if top not in ("..", "__pycache__") and source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return site


def _snippet(readme: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 1, "the bundle README must hold exactly one python block: the snippet"
    return blocks[0]


def _export(tmp: Path, task: str, *args: str) -> Path:
    trained = run(tmp / "run", "--task", task, "--max-steps", "3", *args)
    assert trained.code == 0, trained.stderr
    from trainproof.export.bundle import export
    from trainproof.storage import open_store

    bundle = export(open_store(str(tmp / "run")), task=task)  # the task comes from the caller, never plan.json
    return tmp / "run" / "exports" / f"step-{bundle.step:08d}"


def _run_snippet(bundle: Path, copy: Path, site: Path) -> subprocess.CompletedProcess:
    shutil.copytree(bundle, copy)  # a consumer's copy: nothing around it
    (copy / "snippet.py").write_text(_snippet((copy / "README.md").read_text()))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(copy)}  # no PYTHONPATH (and -E ignores it anyway)
    return subprocess.run([sys.executable, "-S", "-E", "-s", "-c", BOOT.format(site=str(site))], cwd=copy,
                          env=env, capture_output=True, text=True, timeout=budget(300))


@pytest.mark.parametrize("task,args", [
    ("regression", ()),
    ("tinylm", ("--config", "{tmp}/tinylm.json")),
    ("examples.charlm:factory", ("--config", str(ROOT / "examples" / "charlm-quick.json"))),
], ids=["regression", "tinylm", "charlm"])
def test_readme_snippet_reproduces_the_metric_without_trainproof(task, args, tmp_path, torch_only_site):
    from trainproof.export.standalone import STANDALONE_RTOL

    (tmp_path / "tinylm.json").write_text(json.dumps({"n_sequences": 12}))
    bundle = _export(tmp_path, task, *(a.format(tmp=tmp_path) for a in args))
    result = _run_snippet(bundle, tmp_path / "consumer", torch_only_site)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "TRAINPROOF-REACHABLE []", lines[0]  # the interpreter really cannot import trainproof
    metric, value, label, recorded_text = lines[-1].split()
    recorded = json.loads((bundle / "metrics.json").read_text())["eval"]
    assert (metric, label, float(recorded_text)) == (recorded["metric"], "recorded:", recorded["value"])
    assert abs(float(value) - recorded["value"]) <= STANDALONE_RTOL * abs(recorded["value"]), (value, recorded)


def test_the_reachability_probe_sees_trainproof_where_it_is(tmp_path, torch_only_site):
    """The probe the snippet test relies on, from the repository root (where trainproof/ is on the path): it sees it."""
    boot = BOOT.split("exec(")[0]
    result = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", boot.format(site=str(torch_only_site))],
                            cwd=ROOT, env={"PATH": os.environ.get("PATH", "")}, capture_output=True, text=True)
    # From the repository root '' would expose trainproof/: the first line proves find_spec sees it, so the [] above
    # is a real measurement, not a blind spot.
    assert "TRAINPROOF-REACHABLE ['trainproof', 'tests']" in result.stdout and result.returncode == 0


USER_TASK = """
import torch
from torch.utils.data import TensorDataset
from trainproof.tasks import DatasetTask

def factory(config):
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).unsqueeze(1)
    data = TensorDataset(torch.cat([x, x * x], 1), 3 * x)
    return DatasetTask(
        dataset=data, eval_dataset=data,
        build_model=lambda: torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)),
        per_sample_loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).squeeze(1),
        config=dict(config), batch_size=4, dtype=torch.float64, optimizer="sgd", lr=0.1)
"""


def test_a_traceable_task_unknown_to_the_exporter_gets_a_program_that_runs_without_its_code_at_any_batch_size(
        tmp_path, torch_only_site, monkeypatch):
    (tmp_path / "usertask.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))  # the exporter imports the task, as `trainproof export` would
    trained = run(tmp_path / "run", "--task", "usertask:factory", "--max-steps", "2",
                  env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert trained.code == 0, trained.stderr
    from trainproof.export.bundle import export
    from trainproof.storage import open_store

    export(open_store(str(tmp_path / "run")), task="usertask:factory")
    bundle = tmp_path / "run" / "exports" / "step-00000002"
    assert not (bundle / "model.py").exists() and (bundle / "model.pt2").is_file()
    readme = (bundle / "README.md").read_text()
    assert "no `model.py`" in readme and "another project" in readme
    result = _run_snippet(bundle, tmp_path / "consumer", torch_only_site)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "TRAINPROOF-REACHABLE []" and lines[-1] == "max |output - recorded|: 0.0", lines
    assert "the batch) dynamic" in readme

    # The program's batch dimension is dynamic: it runs at batch sizes other than the traced one (4), equal to the
    # model rebuilt with the exported weights.
    import torch
    from safetensors.torch import load_file

    program = torch.export.load(str(bundle / "model.pt2")).module()
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    model.load_state_dict(load_file(str(bundle / "model.safetensors")))
    traced = load_file(str(bundle / "program_inputs.safetensors"))["arg_0"]
    assert traced.shape[0] == 4
    for rows in (1, 7):
        x = torch.linspace(-1, 1, rows * 2, dtype=torch.float64).reshape(rows, 2)
        with torch.no_grad():
            assert torch.equal(program(x), model(x)), rows


def test_a_bundle_of_an_untraceable_unknown_task_says_so_and_has_no_snippet():
    from trainproof.export.bundle_readme import readme

    text = readme(metric_name="m", metric=1.0, fp_name="model.safetensors", bf16_names=["model_bf16.pt"],
                  has_model_py=False, program_note="not traced: x", has_plot=False)
    assert "```python" not in text and "no `model.py`" in text and "could not trace it (not traced: x)" in text

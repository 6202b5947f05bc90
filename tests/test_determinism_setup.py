"""The trainer's determinism switch: the same effect as ``torch.use_deterministic_algorithms(True)``, without
importing torch._inductor at start-up (1.5 s of every resume on a small CPU)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, torch
from job.train.loop import use_deterministic_algorithms
use_deterministic_algorithms(warn_only={warn})
print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
      'torch._inductor' in sys.modules)
import torch._inductor.config as config
print(config.deterministic)
"""


def _probe(warn: bool) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(warn=warn)], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_deterministic_kernels_and_inductor_setting_without_importing_inductor():
    assert _probe(False) == ["True", "False", "False", "True"]
    assert _probe(True) == ["True", "True", "False", "True"]


def test_an_already_imported_inductor_gets_the_setting_on_its_config():
    code = "import torch._inductor.config as c; c.deterministic = False\n" + PROBE.format(warn=False)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "True", "True"]

"""The trainer's determinism switch: the same effect as ``torch.use_deterministic_algorithms(True)``, without
importing torch._inductor at start-up (1.5 s of every resume on a small CPU)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, torch
from trainproof.train.device import use_deterministic_algorithms
for warn in (False, True):
    use_deterministic_algorithms(warn_only=warn)
    print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
          'torch._inductor' in sys.modules)
import torch._inductor.config as config
print(config.deterministic)          # read from the environment variable when inductor was imported
config.deterministic = False
use_deterministic_algorithms(warn_only=False)
print(config.deterministic)          # an imported inductor gets the setting on its config
"""


def test_deterministic_kernels_and_inductor_setting_without_importing_inductor():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False", "True", "True", "False", "True", "True"]


OLD_INDUCTOR = """
import sys, types, torch
class Config(types.ModuleType):  # an inductor config of torch < 2.10: unknown settings are refused
    def __setattr__(self, name, value):
        raise AttributeError(f"torch._inductor.config.{name} does not exist")
sys.modules["torch._inductor.config"] = Config("torch._inductor.config")
from trainproof.train.device import use_deterministic_algorithms
use_deterministic_algorithms(warn_only=False)
print(torch.are_deterministic_algorithms_enabled())
"""


def test_an_inductor_without_the_deterministic_setting_is_no_error():
    """torch 2.4-2.9 (the range pyproject.toml allows) has no inductor ``deterministic`` setting and refuses unknown
    ones: a task that imported inductor before the trainer starts must not fail there."""
    out = subprocess.run([sys.executable, "-c", OLD_INDUCTOR], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-2000:]

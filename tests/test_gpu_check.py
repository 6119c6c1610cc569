"""`reproduce/gpu_check.py` (make gpu-check): without CUDA it says so in one line; bad parts are refused. The dry run of
every part is `make gpu-check DRY=1`, in `make test-all`."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "reproduce" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_one_line_and_success(tmp_path):
    run = subprocess.run([sys.executable, SCRIPT, "--out", tmp_path], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1 and "no CUDA device" in run.stdout and "DRY=1" in run.stdout
    assert not any(tmp_path.iterdir())  # no report of nothing


def test_unknown_part_refused():
    run = subprocess.run([sys.executable, SCRIPT, "--dry", "--parts", "flex,nope"], capture_output=True, text=True)
    assert run.returncode == 2 and "--parts must name parts of" in run.stderr and "'nope'" in run.stderr

"""The CUDA kernels' element masks against the one mask rule, on the CPU.

csrc/cuda/mask.cuh computes a tile's element mask in band form (a range of
visible column offsets per row); tests/cuda_host/mask_rule_check.cu compares
every element with the per-row rule key_lo(row) <= key < key_hi(row). It is
host code, so it runs wherever nvcc is (CI has it); skipped without nvcc.
"""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _nvcc():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (CUDA_HOME or PATH): the host check needs it")
def test_element_masks_follow_the_row_rule(tmp_path):
    exe = tmp_path / "mask_rule_check"
    src = os.path.join(HERE, "cuda_host", "mask_rule_check.cu")
    subprocess.run([_nvcc(), "-std=c++17", "-O1", "-o", str(exe), src], check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 mismatches" in run.stdout and not run.stdout.startswith("0 elements"), run.stdout


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (CUDA_HOME or PATH): the host check needs it")
def test_fast_divmod_divides_exactly(tmp_path):
    """The backward kernels decode each step's query block with mask.cuh's
    FastDivmod (a multiply-high): exact against n / d, host code."""
    exe = tmp_path / "fast_divmod_check"
    src = os.path.join(HERE, "cuda_host", "fast_divmod_check.cu")
    subprocess.run([_nvcc(), "-std=c++17", "-O1", "-o", str(exe), src], check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 mismatches" in run.stdout, run.stdout

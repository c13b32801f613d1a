"""An error raised by the first call of a fresh process is an exception, not
a crash. A build that carried its own static copy of libstdc++ segfaulted the
first time an error message formatted a number (q of rank 3 on a fresh
process, CPU or CUDA): the test runs that call in a subprocess so that a crash
fails the test instead of killing the test run."""

import subprocess
import sys

SCRIPT = """
import torch, flashattn_ext
q = torch.randn(2, 5, 16, device="{dev}", dtype=torch.float16)   # rank 3: invalid
k = torch.randn(2, 7, 2, 16, device="{dev}", dtype=torch.float16)
op = torch.ops.flashattn_ext.fwd.default
# (deterministic, where the schema still has it; the arguments with defaults are left to them)
extra = (False,) * sum(1 for a in op._schema.arguments[7:] if not a.has_default_value())
try:
    op(q, k, k, 0.25, -1, -1, True, *extra)
except ValueError as e:
    print("raised:", e)
"""


def test_first_error_of_a_process_is_an_exception(device):
    if device == "cpu":
        script = SCRIPT.replace("dtype=torch.float16", "dtype=torch.float32")
    else:
        script = SCRIPT
    r = subprocess.run([sys.executable, "-c", script.format(dev=device)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit code {r.returncode}: {r.stderr[-2000:]}"
    assert "raised:" in r.stdout and "q must have 4 dimensions" in r.stdout, r.stdout + r.stderr[-2000:]

"""Fixtures shared by the test files.

* ``device`` (with ``dtype`` when a test asks for both): every supported
  (device, dtype) pair; cuda cases carry the ``cuda`` marker and are skipped
  without a GPU or without CUDA kernels in the build (one skip reason for all of
  them, so that ``-rs`` lists it once beside the other skips' reasons, and one
  line at the end of the run saying how many and why).
  ``@pytest.mark.dtypes(...)`` narrows the dtypes of a test.
* a fresh random seed for every test, printed (shown on failure); set
  FLASHATTN_TEST_SEED to replay one.
* ``poison``: torch.empty returns NaN-filled memory for the test, so an output
  element a kernel forgets to write shows up (uses torch's deterministic mode,
  which also turns on the deterministic backward).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import DTYPES  # noqa: E402

import flashattn_ext  # noqa: E402
from flashattn_ext import interface  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
CUDA_BUILD = flashattn_ext.build_info()["cuda"]
if not HAS_CUDA:
    CUDA_SKIP = "no CUDA device (torch.cuda.is_available() is False)"
elif not CUDA_BUILD:
    CUDA_SKIP = "flashattn_ext built without CUDA kernels (FLASHATTN_CPU_ONLY=1, or no nvcc when it was built)"
else:
    CUDA_SKIP = None

_cuda_skipped = []  # node ids of the tests skipped for CUDA_SKIP (the summary line counts them)


def _device_param(dev, *values, id=None):
    return pytest.param(*values, marks=[pytest.mark.cuda] if dev == "cuda" else [], id=id)


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    if "device" not in names:
        return
    if "dtype" in names:
        marker = metafunc.definition.get_closest_marker("dtypes")
        allowed = marker.args if marker else None
        params = [
            _device_param(dev, dev, dt, id=f"{dev}-{_dtype_name(dt)}")
            for dev in ("cpu", "cuda")
            for dt in DTYPES[dev]
            if allowed is None or dt in allowed
        ]
        metafunc.parametrize(("device", "dtype"), params)
    else:
        metafunc.parametrize("device", [_device_param(dev, dev, id=dev) for dev in ("cpu", "cuda")])


def pytest_configure(config):
    config.addinivalue_line("markers", "dtypes(*dtypes): restrict the dtypes a test runs with")


def pytest_runtest_setup(item):
    """Every test marked cuda (the device parametrization's cuda cases and the
    tests marked by hand) is skipped here when CUDA_SKIP says why: one skip
    location, so `-rs` shows the CUDA skips as one line and the other skips with
    their own reasons."""
    if CUDA_SKIP is not None and item.get_closest_marker("cuda") is not None:
        _cuda_skipped.append(item.nodeid)
        pytest.skip(CUDA_SKIP)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line on why tests were skipped: how many for want of CUDA, and how
    many for other reasons (shown by -rs)."""
    skipped = terminalreporter.stats.get("skipped", [])
    cuda = set(_cuda_skipped)
    n_cuda = sum(1 for r in skipped if r.nodeid in cuda)
    n_other = len(skipped) - n_cuda
    if not n_cuda and not n_other:
        return
    parts = []
    if n_cuda:
        then = "they run on a machine with a GPU" if not HAS_CUDA else "rebuild with the CUDA kernels to run them"
        parts.append(f"{n_cuda} CUDA tests skipped: {CUDA_SKIP}; {then}")
    if n_other:
        parts.append(f"{n_other} other test{'s' if n_other != 1 else ''} skipped (-rs shows why)")
    terminalreporter.write_line("flashattn_ext: " + "; ".join(parts))


@pytest.fixture(autouse=True)
def _seed():
    seed = int(os.environ.get("FLASHATTN_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    print(f"seed={seed} (replay with FLASHATTN_TEST_SEED={seed})")
    yield seed


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees the one-time fallback warnings afresh."""
    interface._warned.clear()
    yield
    interface._warned.clear()


@pytest.fixture
def poison():
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
    torch.utils.deterministic.fill_uninitialized_memory = prev_fill

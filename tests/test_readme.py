"""Every ```python block of README.md, run as written, each in a fresh interpreter.

The blocks are read from README.md at test time, so a block that stops running
fails here the day it is edited. Each runs in a subprocess from an empty
directory (nothing of the checkout on its path but the flashattn_ext this test
imports), once with no GPU visible (CUDA_VISIBLE_DEVICES="": the CPU path every
reader without a GPU takes) and once on the GPU when there is one (the cuda
case). Warnings raised in a block fail it: a reader would see them.
"""

import os
import re
import subprocess
import sys

import pytest

import flashattn_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(text):
    """[(line of the opening fence, code)] for every ```python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        if m.group(1) == "python":
            blocks.append((i + 1, "\n".join(lines[i + 1 : j]) + "\n"))
        i = j + 1
    return blocks


with open(README, encoding="utf-8") as _f:
    BLOCKS = python_blocks(_f.read())


def test_readme_blocks_found():
    """The extraction sees the README's Python blocks (a fence spelt otherwise, e.g.
    ```py, would be left out of test_readme_block silently)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    tags = {m.group(1) for m in map(FENCE.match, text.splitlines()) if m and m.group(1)}
    assert tags <= {"python", "bash"}, f"README.md has code fences tagged {sorted(tags)}: tag Python as ```python"
    assert len(BLOCKS) >= 3, BLOCKS


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block(device, line, code, tmp_path):
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    # The flashattn_ext under test, however it was found (an editable install or PYTHONPATH).
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(flashattn_ext.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_dir] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONWARNINGS"] = "error"  # a warning a reader would see fails the block
    env["HF_HUB_OFFLINE"] = "1"  # nothing may come from the Hub
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"README.md block at line {line} failed on {device}:\n{code}\n{r.stdout}\n{r.stderr}"

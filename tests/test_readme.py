"""Every ```python block of README.md runs as written: in order, in one namespace, as a reader
pasting them would (with TRITON_INTERPRET=1 on a machine without a GPU, as the README says)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).parents[1] / "README.md"

# Runs each snippet compiled under README.md's name and line numbers: a failure points there.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for filename, line, code in json.load(open(sys.argv[1])):
    exec(compile("\\n" * line + code, filename, "exec"), namespace)
"""


def snippets() -> list[tuple[str, int, str]]:
    """(file, line before the code, code) of each ```python block."""
    text = README.read_text()
    return [
        (str(README), text.count("\n", 0, match.start(1)), match.group(1))
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    ]


def test_readme_snippets_are_found():
    found = snippets()
    assert len(found) >= 4
    assert "block_sparse_attn_func" in found[0][2] and "msa_func" in found[-1][2]


@pytest.mark.on_device
def test_readme_snippets_run_in_order(tmp_path):
    (tmp_path / "snippets.json").write_text(json.dumps(snippets()))
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path / "snippets.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]

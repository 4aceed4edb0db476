"""minirt embedded in another project: any import order works (a process that imported triton before
minirt, as transformers does, used to fail every kernel call on a machine without a GPU)."""
import os
import subprocess
import sys

import pytest

SCRIPT = """
import {first}, {second}
import minirt
engine = minirt.load({checkpoint!r})
logits = engine.prefill([[1, 2, 3], [4, 5]])
print(tuple(engine.decode(logits.argmax(-1)).shape))
"""


@pytest.mark.parametrize("first, second", [("triton", "minirt"), ("minirt", "triton")])
def test_kernels_run_whatever_was_imported_first(tiny_master, first, second):
    # The variable unset: the process must choose the interpreter itself, as an embedding process would.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first, second=second, checkpoint=str(tiny_master))],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "(2, 512)"

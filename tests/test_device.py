"""Device selection at import, the override variable, and the error for importing triton first."""

import os
import subprocess
import sys

import helpers

CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SOFTMAX_INTERPRET")}


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], env={**CLEAN_ENV, **env}, capture_output=True, text=True,
                          timeout=300)


def test_exposes_device_and_interpreter_flag():
    assert helpers.DEVICE.type in ("cuda", "npu", "cpu")
    assert helpers.INTERPRET == (helpers.DEVICE.type == "cpu")
    if helpers.INTERPRET:
        assert os.environ["TRITON_INTERPRET"] == "1"


def test_override_forces_interpreter():
    out = run_python("import helpers; print(helpers.DEVICE, helpers.INTERPRET)", SOFTMAX_INTERPRET="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "True"]


def test_bad_override_value():
    out = run_python("import helpers", SOFTMAX_INTERPRET="yes")
    assert out.returncode != 0 and "SOFTMAX_INTERPRET must be 0 or 1" in out.stderr


def test_triton_imported_first_is_explained():
    out = run_python("import triton, helpers", SOFTMAX_INTERPRET="1")
    assert out.returncode != 0
    assert "put `import helpers` before any `import triton`" in out.stderr

"""Device selection at import, the override variable, and the error for importing triton first."""

import os
import subprocess
import sys

import helpers

CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("TRITON_INTERPRET", "SOFTMAX_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}


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


FUSION_PROBE = """
import os, warnings, torch, helpers
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = helpers.softmax(torch.randn(4, 8, device=helpers.DEVICE))
torch.testing.assert_close(y.sum(-1), torch.ones(4, device=helpers.DEVICE))
print(os.environ["TRITON_DEFAULT_FP_FUSION"], sum("FP_FUSION" in str(w.message) for w in caught))
"""


def test_fp_fusion_stays_on_without_triton_39s_warning():
    """Triton 3.9 warns at a kernel's first compile that its default for FMA contraction turns off in 3.10: helpers
    keeps it on, as the course's numbers were made, and the launch warns of nothing (on a GPU; the interpreter does not
    compile). A learner's own setting is kept."""
    for chosen, expected in ((None, "1 0"), ("0", "0 0")):
        out = run_python(FUSION_PROBE, **({} if chosen is None else {"TRITON_DEFAULT_FP_FUSION": chosen}))
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == expected.split()

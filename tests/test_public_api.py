import subprocess
import sys

import autotune


def test_all_is_sorted_and_complete():
    assert autotune.__all__ == sorted(autotune.__all__)
    for name in autotune.__all__:
        assert hasattr(autotune, name), name
    public = {n for n in vars(autotune) if not n.startswith("_") and callable(getattr(autotune, n))}
    assert public <= set(autotune.__all__)


def test_public_functions_have_docstrings():
    for name in autotune.__all__:
        obj = getattr(autotune, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_import_is_light():
    # What `import autotune` loads beyond torch itself (which may load some of these on its own).
    code = (
        "import sys, torch; before = set(sys.modules); import autotune; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
        "('optuna', 'pynvml', 'psutil', 'tqdm', 'matplotlib', 'sqlalchemy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_import_loads_the_planning_machinery_when_planning_starts():
    # `import autotune` loads none of its wings; the first public name used loads what it needs.
    code = (
        "import sys, autotune; print(sorted(m for m in sys.modules if m.startswith('autotune.'))); "
        "autotune.format_bytes(1); print('autotune.probe.estimate' in sys.modules); "
        "autotune.plan; print('autotune.probe.estimate' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:3] == ["[]", "False", "True"]


def test_quantize_has_one_public_spelling_and_loads_no_bitsandbytes_until_it_runs():
    # The spelling quantize's own docstring uses; naming it imports autotune.memory.quantized, not bitsandbytes.
    code = (
        "import sys, autotune, autotune.memory.quantized as q; print('quantize' in autotune.__all__, autotune.quantize is q.quantize, "
        "'autotune.quantize(' in q.quantize.__doc__, 'bitsandbytes' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True", "False"]

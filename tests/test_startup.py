"""Start-up cost: the CLI's help and `import sparsegen` hold no torch, the load path no optional
heavy library, and the CLI's catalog, read from the source, is what the registries hold."""

import subprocess
import sys

import pytest

from sparsegen.catalog import catalog

NOT_FOR_LOADING = (
    "lm_eval", "fastapi", "uvicorn", "matplotlib", "nltk", "wonderwords", "peft", "compressed_tensors", "gguf",
)  # fmt: skip
NOT_FOR_HELP = ("torch", "transformers", "numpy", "safetensors", "huggingface_hub", *NOT_FOR_LOADING)


def imported_after(code: str, watched: tuple[str, ...]) -> list[str]:
    """Which of the `watched` modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(*[m for m in {watched!r} if m in sys.modules], file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return done.stderr.split()


def test_the_catalog_read_from_the_source_is_the_registries():
    from sparsegen.contextual import SELECTORS
    from sparsegen.contextual.selector import faster_selectors
    from sparsegen.kv import POLICIES
    from sparsegen.prune import PRUNERS
    from sparsegen.quant import QUANTIZERS

    assert catalog() == {
        "policies": sorted(POLICIES),
        "streamable_policies": sorted(name for name, cls in POLICIES.items() if not cls.prefill_only),
        "policy_help": POLICIES.help(),
        "selectors": {name: SELECTORS.summary(name) for name in sorted(SELECTORS)},
        "faster_selectors": faster_selectors(),
        "pruners": sorted(PRUNERS),
        "quantizers": sorted(QUANTIZERS),
    }
    assert "h2o" in catalog()["policies"] and "wanda" in catalog()["pruners"]


def test_help_of_the_cli_and_its_commands_imports_no_torch():
    """`sparsegen --help` (and a command's) builds the whole CLI: no build step, no torch, no cache."""
    helps = [["--help"], ["generate", "--help"], ["prune", "--help"], ["eval", "--help"], ["bench", "kv", "--help"]]
    code = "\n".join(
        ["from contextlib import suppress", "from sparsegen.cli import app"]
        + [f"with suppress(SystemExit):\n    app({args!r})" for args in helps]
    )
    assert imported_after(code, NOT_FOR_HELP) == []


def test_import_sparsegen_is_light():
    assert imported_after("import sparsegen", NOT_FOR_HELP) == []


@pytest.mark.slow  # its process imports torch and transformers (seconds)
def test_the_load_path_imports_no_optional_library():
    assert imported_after("import sparsegen; sparsegen.load", NOT_FOR_LOADING) == []

"""The kernels' builder (`sparsegen.kernels.build`): a source's build folder is keyed by the headers
it includes as well as by its own code, and the build finds those headers beside the source."""

from __future__ import annotations

import pytest

from sparsegen.kernels import build as builder

SOURCE = """#include <pybind11/pybind11.h>
#include "tiny_value.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("value", []() { return kValue; }); }
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A source and the header it includes, in a folder of their own; the cache in tmp_path too."""
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "tiny_value.h").write_text("#pragma once\nconstexpr int kValue = 1;\n")
    (folder / "tiny_kernel.cpp").write_text(SOURCE)
    return folder / "tiny_kernel.cpp"


def test_the_included_headers_are_found_recursively_and_others_left_out(tiny):
    (tiny.parent / "tiny_value.h").write_text('#pragma once\n#include "tiny_more.h"\nconstexpr int kValue = 1;\n')
    (tiny.parent / "tiny_more.h").write_text("#pragma once\n")
    (tiny.parent / "unused.h").write_text("#pragma once\n")
    assert list(builder.local_headers(tiny)) == ["tiny_value.h", "tiny_more.h"]


def test_a_header_change_is_a_new_build_folder(tiny, tmp_path):
    first = builder.build_folder(tiny)
    assert first.parent == tmp_path / "cache" / "kernels"
    assert (first / "tiny_value.h").read_text() == (tiny.parent / "tiny_value.h").read_text()
    assert builder.build_folder(tiny) == first  # the same code: the same folder
    (tiny.parent / "tiny_value.h").write_text("#pragma once\nconstexpr int kValue = 2;\n")
    second = builder.build_folder(tiny)
    assert second != first and "kValue = 2" in (second / "tiny_value.h").read_text()
    assert "kValue = 1" in (first / "tiny_value.h").read_text()  # the first build's copy is left as it was


def test_a_source_builds_with_its_header_beside_it(tiny):
    """A real build (a minute on a slow machine): the copy in the cache compiles with its header."""
    module = builder.build(tiny, "the tiny test kernel")
    assert module is not None, "the build failed: see the message above"
    assert module.value() == 1


def test_compiled_graphs_are_kept_apart_for_each_version_of_the_kernels(tiny, monkeypatch):
    """Inductor's cache does not see an op's C++ code: the folder compiled steps are cached in
    (`decode.engine`) changes with any kernel source or header, and with nothing else."""
    from sparsegen.decode.engine import _inductor_cache

    monkeypatch.setattr(builder, "SOURCES", tiny.parent)

    def folder():
        builder.sources_hash.cache_clear()
        return _inductor_cache()

    try:
        first = folder()
        (tiny.parent / "notes.txt").write_text("not a kernel")
        assert folder() == first
        (tiny.parent / "tiny_value.h").write_text("#pragma once\nconstexpr int kValue = 2;\n")
        second = folder()
        tiny.write_text(SOURCE + "// changed\n")
        assert len({first, second, folder()}) == 3 and first.parent == second.parent
    finally:
        builder.sources_hash.cache_clear()

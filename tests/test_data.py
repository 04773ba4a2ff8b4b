import warnings

import pytest

from sparsegen import data
from sparsegen.errors import SparsegenError


def test_strip_gutenberg_removes_header_and_footer():
    text = (
        "licence blah\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nBody line.\n*** END OF THIS PROJECT ***\nmore"
    )
    assert data.strip_gutenberg(text) == "Body line."
    assert data.strip_gutenberg("  plain text \n") == "plain text"


def test_load_text_reads_a_user_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world")
    assert data.load_text(str(path)) == "hello world"


def test_load_text_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(SparsegenError, match="not found"):
        data.load_text(str(tmp_path / "missing.txt"))


def test_pieces_keep_every_character():
    text = "".join(f"line {i} " * (i % 7) + "\n" for i in range(500))
    pieces = data._pieces(text, 100)
    assert "".join(pieces) == text
    assert max(len(p) for p in pieces) <= 100


@pytest.mark.real
def test_tokenize_long_matches_whole_text_and_is_quiet(real, caplog):
    _, tokenizer = real
    text = data.load_text("shakespeare")
    assert "Project Gutenberg" not in text[:2000] and len(text) > 5_000_000
    sample = text[:60_000]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = data.tokenize_long(tokenizer, sample, piece_chars=3000)
    assert "longer than the specified maximum" not in caplog.text
    whole = tokenizer(sample, add_special_tokens=False, verbose=False)["input_ids"]
    # Splitting at line ends keeps tokens identical except, rarely, right at a boundary.
    assert abs(len(ids) - len(whole)) <= 2
    assert tokenizer.decode(ids) == sample
    assert len(data.tokenize_long(tokenizer, text, max_tokens=5000)) == 5000

"""Run one of RULER's generator scripts as its own `__main__`: `python -m sparsegen.eval.ruler_run
SCRIPT ARGS...`.

The scripts split essays with NLTK's `sent_tokenize`, whose trained English model is a download
this machine cannot make; NLTK's Punkt splitter with its default parameters stands in (same
algorithm, no learned abbreviations). The script's folder goes first on `sys.path`, as when run
directly, since the scripts import their neighbours by plain name.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    import nltk.tokenize
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    splitter = PunktSentenceTokenizer()
    nltk.tokenize.sent_tokenize = lambda text, language="english": splitter.tokenize(text)
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

"""The default model and one saved RULER sample's context and question as token ids, for the
scripts that time a part of a RULER run (`rolled_scores_ab.py`, `shared_evicting_ab.py`,
`kvzip_reread_time.py`)."""

import json
from pathlib import Path

from sparsegen.eval.ruler_data import RulerSample
from sparsegen.loading import load


def load_sample(samples: Path):
    """(model, tokenizer, context ids, question ids) of the first sample in a `samples/*.json` file."""
    model, tokenizer = load("smollm2-135m")
    sample = RulerSample(**json.loads(samples.read_text())["samples"][0])
    context = tokenizer(sample.context, add_special_tokens=False)["input_ids"]
    question = tokenizer(sample.question, add_special_tokens=False)["input_ids"]
    return model, tokenizer, context, question

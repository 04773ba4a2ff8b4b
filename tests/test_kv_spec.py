"""KVSpec: validated once, frozen, recorded and read back, and the one step-sharing rule."""

import dataclasses
import json

import pytest

from sparsegen.errors import SparsegenError
from sparsegen.kv.spec import KVSpec
from sparsegen.scale.sweep import cells_of


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: KVSpec.of("nope"), "unknown KV policy 'nope'"),
        (lambda: KVSpec.of("h2o", budget=-3), "budget must be"),
        (lambda: KVSpec.of("h2o", budget=8, heavy=4), "not both"),
        (lambda: KVSpec.of("window", sinks=2), "keeps no sinks"),
        (lambda: KVSpec.of("streaming", budget=8, kv_bits=5), "kv_bits must be one of"),
        (lambda: KVSpec.of("streaming", position="sideways"), "position must be one of"),
        (lambda: KVSpec.of("h2o", colour="red"), "colour"),
        (lambda: KVSpec("h2o"), "KVSpec.of(name"),
        (lambda: KVSpec.from_dict({"settings": {}}), "policy name"),
        (lambda: KVSpec.from_dict({"policy": "h2o", "bits": 4}), "unknown keys"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_problem(build, words):
    with pytest.raises(SparsegenError) as raised:
        build()
    message = str(raised.value)
    assert words in message and "\n" not in message


def test_a_spec_is_frozen_and_built_once():
    spec = KVSpec.of("h2o", budget=128, kv_bits=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kv_bits = 8
    assert (spec.policy.heavy, spec.policy.recent, spec.kv_bits) == (64, 64, 4)
    assert KVSpec.coerce(spec) is spec
    assert KVSpec.coerce("streaming") == KVSpec.of("streaming")
    assert KVSpec.coerce(spec.policy) == KVSpec(spec.policy)


@pytest.mark.parametrize(
    "spec",
    [
        KVSpec.of("full"),
        KVSpec.of("h2o", budget=0.2, kv_bits=8),
        KVSpec.of("streaming", sinks=2, recent=30, position="original", kv_bits=4),
        KVSpec.of("snapkv", budget=64, kernel=3),
        KVSpec.of("pyramidkv", budget=40, beta=10.0),
        KVSpec.of("rkv", budget=64, compress_every=16),
    ],
)
def test_to_dict_is_json_and_reads_back(spec):
    saved = json.loads(json.dumps(spec.to_dict()))
    assert KVSpec.from_dict(saved) == spec
    assert hash(KVSpec.from_dict(saved)) == hash(spec)
    assert str(spec).startswith(spec.name + "(")
    every = spec.policy.compress_every  # recorded only where not the default, so older records read the same
    assert ("compress_every" in saved["settings"]) == (every != 1) and ("compress_every" in str(spec)) == (every != 1)


def test_describe_says_position_and_bits():
    assert KVSpec.of("window", recent=8, position="rolling", kv_bits=4).describe() == (
        "window(recent=8) position=rolling int4"
    )


SHARES_STEP = [  # (a, b, share one batched step?)
    (dict(policy="h2o", heavy=4, recent=4), dict(policy="h2o", heavy=10, recent=2), True),
    (dict(policy="h2o", budget=8), dict(policy="h2o", budget=0.3), True),
    (dict(policy="streaming", sinks=4, recent=8), dict(policy="streaming", sinks=4, recent=30), True),
    (dict(policy="streaming", recent=8), dict(policy="streaming", recent=8, position="rolling"), True),
    (dict(policy="streaming", sinks=2, recent=8), dict(policy="streaming", sinks=4, recent=8), False),
    (dict(policy="h2o", budget=8), dict(policy="h2o", budget=8, kv_bits=4), False),
    (dict(policy="h2o", budget=8, kv_bits=8), dict(policy="h2o", budget=8, kv_bits=4), False),
    (dict(policy="h2o", budget=8), dict(policy="tova", budget=8), False),
    (dict(policy="h2o", budget=8), dict(policy="h2o", budget=8, normalize=True), False),
    (dict(policy="h2o", budget=8), dict(policy="h2o", budget=8, compress_every=4), False),
    (dict(policy="h2o", budget=8), dict(policy="h2o", budget=8, position="rolling"), False),
    (dict(policy="streaming", recent=8, position="original"), dict(policy="streaming", recent=8), False),
]


@pytest.mark.parametrize("a, b, shares", SHARES_STEP)
def test_which_rows_share_a_step(a, b, shares):
    one, other = KVSpec.of(**a), KVSpec.of(**b)
    assert one.shares_step_with(other) is shares
    assert other.shares_step_with(one) is shares
    assert (one.step_key() == other.step_key()) is shares


def test_a_sweep_cell_reads_its_kv_once_and_records_a_spec_that_reads_back():
    grid = {"model": "m", "evaluations": [{"kind": "needle"}]}
    grid["kv"] = [{"policy": "full"}, {"policy": "h2o", "budget": 64, "kv_bits": 8, "position": "rolling"}]
    specs = [cell.spec for cell in cells_of(grid)]
    assert specs == [KVSpec.of("full"), KVSpec.of("h2o", budget=64, kv_bits=8, position="rolling")]
    assert [KVSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) for spec in specs] == specs
    with pytest.raises(SparsegenError, match="unknown KV policy 'h2'"):
        cells_of({**grid, "kv": [{"policy": "h2"}]})

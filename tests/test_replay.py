"""Selection traces (specjax.engine.replay): recorded scores decide a replayed run's selections, mapped onto its
shape; a replay is deterministic; a trace that would not mean what it says is refused; results label it."""

import dataclasses
import json
import types

import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.engine import Engine, EngineConfig, Request, fingerprint, make_system, replay
from specjax.errors import SpecjaxError
from specjax.stores import KVStore

SYSTEMS = ("as_h2o_lfu", "spec", "spec_gqa")


def _requests(model, prefix_len, count=3, query_len=7):
    """`count` requests over one prefix (reused: later ones meet caches the earlier ones filled)."""
    rng = np.random.default_rng(0)
    v = model.config.vocab_size
    prefix = rng.integers(0, v, prefix_len).tolist()
    return [Request(prefix, rng.integers(0, v, query_len).tolist(), [rng.integers(0, v, 3).tolist()], index=i)
            for i in range(count)]


def _engine(model, name, selections=None, retention=0.25):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    store = KVStore.open(spec, fingerprint(model, 16), context=ts.Context())
    config = EngineConfig(retention=retention, gpu_cache_bytes=32 << 10, cpu_cache_bytes=32 << 10, trace=True)
    return Engine(model, make_system(name), store, config, selections=selections)


def _run_all(engine, requests):
    engine.warm(requests[0].prefix)
    return [engine.run(r) for r in requests]


def _record(model, name, requests, path, task="needle"):
    recorder = replay.Recorder(replay.source_of(model, name, 0.25, task, None))
    results = _run_all(_engine(model, name, recorder), requests)
    recorder.save(path)
    return results


def _replay(path, model, task="needle"):
    trace = replay.Replay.load(path)
    trace.check(model, task)
    return trace.bind(model.config)


def _selections(results):
    return [[np.asarray(s).tolist() for s in r.selections] for r in results]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Each system's trace of three requests on tiny-llama (random weights, seed 1), with what the run selected."""
    model = specjax.load_model("tiny-llama", init="random", seed=1)
    folder = tmp_path_factory.mktemp("traces")
    requests = _requests(model, 128)
    return model, folder, {name: _record(model, name, requests, folder / f"{name}.npz") for name in SYSTEMS}


@pytest.mark.parametrize("name", SYSTEMS)
def test_other_weights_replaying_a_trace_select_what_the_recording_selected(recorded, name):
    model, folder, results = recorded
    other = specjax.load_model("tiny-llama", init="random", seed=2)  # its own attention selects otherwise
    requests = _requests(other, 128)
    own = _run_all(_engine(other, name), requests)
    replayed = _run_all(_engine(other, name, _replay(folder / f"{name}.npz", other)), requests)
    assert _selections(replayed) == _selections(results[name])
    assert _selections(own) != _selections(results[name])  # so the equality above is the trace's doing
    for a, b in zip(replayed, results[name]):
        assert a.layers["fallback"] == b.layers["fallback"]
        np.testing.assert_array_equal(a.layers["jaccard"], b.layers["jaccard"])


def test_a_replay_is_deterministic(recorded):
    model, folder, _ = recorded
    other = specjax.load_model("tiny-llama", init="random", seed=3)
    requests = _requests(other, 128)
    runs = [_run_all(_engine(other, "spec", _replay(folder / "spec.npz", other)), requests) for _ in range(2)]
    assert _selections(runs[0]) == _selections(runs[1])
    assert [r.io["disk_bytes"] for r in runs[0]] == [r.io["disk_bytes"] for r in runs[1]]


def test_onto_a_longer_prefix_and_more_heads_positions_map_by_relative_offset(recorded):
    """tiny-llama's trace (128-token prefix, 4 heads) onto tiny-gqa (8 heads on 4 KV heads) with a 256-token prefix:
    every recorded position stands for two, so the probes' Jaccard is the recorded one and a shared set is the
    recorded one with each position doubled."""
    model, folder, results = recorded
    target = specjax.load_model("tiny-gqa", init="random", seed=0)
    requests = _requests(target, 256)
    replayed = _run_all(_engine(target, "spec", _replay(folder / "spec.npz", target)), requests)

    def doubled(positions):
        return np.sort(np.concatenate([2 * positions, 2 * positions + 1]))

    for ours, theirs in zip(replayed, results["spec"]):
        assert ours.reused_tokens == 256 and theirs.reused_tokens == 128
        np.testing.assert_allclose(ours.layers["jaccard"], theirs.layers["jaccard"], rtol=1e-6)
        assert ours.layers["fallback"] == theirs.layers["fallback"]
        for a, b in zip(ours.selections, theirs.selections):
            a, b = np.sort(np.asarray(a), axis=-1), np.asarray(b)
            if len(b) == 1:  # a shared set
                np.testing.assert_array_equal(a, doubled(b[0])[None])
            else:  # per-head sets: target head h replays recorded head h * 4 // 8
                assert a.shape == (8, 2 * b.shape[1])
                for h in range(8):
                    np.testing.assert_array_equal(a[h], doubled(b[h // 2]))


def test_layers_map_by_relative_depth(tmp_path):
    """A 2-layer trace onto a 4-layer model: layers 0, 1 replay recorded layer 0 and layers 2, 3 layer 1."""
    model = specjax.load_model("tiny-llama", init="random", seed=1)
    _record(model, "as_h2o_lfu", _requests(model, 64, count=1), tmp_path / "t.npz")
    deeper = types.SimpleNamespace(num_layers=4, num_heads=4)
    trace = replay.Replay.load(tmp_path / "t.npz").bind(deeper)
    trace.begin(0)
    columns = np.arange(64)
    rows = [np.asarray(trace.scores(layer, range(4), "heads", columns, 64, np.zeros((4, 64), np.float32)))
            for layer in range(4)]
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[2], rows[3])
    assert not np.array_equal(rows[0], rows[2])
    # two probes standing for the 4 recorded heads spread over them (heads 0 and 2), not the first two
    probes = np.asarray(trace.scores(0, (0, 1), "probes", columns, 64, np.zeros((2, 64), np.float32)))
    np.testing.assert_array_equal(probes, rows[0][[0, 2]])


def _fake_model(name, digest, weights, layers=2, heads=4):
    return types.SimpleNamespace(name=name, weights_digest=digest, weights=weights,
                                 config=types.SimpleNamespace(num_layers=layers, num_heads=heads))


def test_a_trace_that_would_not_mean_what_it_says_is_refused(recorded, tmp_path):
    model, folder, _ = recorded
    trace = replay.Replay.load(folder / "spec.npz")
    with pytest.raises(SpecjaxError, match="recorded on task 'needle'; this run is 'piqa'"):
        trace.check(model, "piqa")
    with pytest.raises(SpecjaxError, match="trained weights of its own"):
        trace.check(_fake_model("smollm2-135m", "other", "pretrained"), "needle")
    trace.check(_fake_model("timing-qwen2.5-7b", "other", "random", layers=28, heads=4), "needle")  # random: fine
    with pytest.raises(SpecjaxError, match="the trace is damaged"):
        trace.check(_fake_model("tiny-llama", model.weights_digest, "random", layers=3), "needle")
    with pytest.raises(SpecjaxError, match="no selection trace at"):
        replay.Replay.load(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a trace")
    with pytest.raises(SpecjaxError, match="is not a selection trace"):
        replay.Replay.load(tmp_path / "bad.npz")
    with np.load(folder / "spec.npz") as f:
        arrays = dict(f)
    arrays["source"] = np.asarray(json.dumps({**json.loads(str(arrays["source"])), "format": 99}))
    np.savez(tmp_path / "future.npz", **arrays)
    with pytest.raises(SpecjaxError, match="format 99"):
        replay.Replay.load(tmp_path / "future.npz")
    with pytest.raises(SpecjaxError, match="needs each request's index"):
        trace.begin(None)


def test_a_stand_in_trace_is_taken_only_where_a_systems_own_holds_no_scores(recorded, tmp_path):
    """The planner's recording may have computed every request's prefix: its trace holds no scores, and SPEC's (which
    identifies as the planner's loaded part does) stands in, saying so; a damaged trace is never passed over."""
    model, folder, _ = recorded
    empty = replay.Recorder(replay.source_of(model, "planner", 0.25, "needle", None))
    empty.begin(0)
    empty.save(tmp_path / replay.trace_name("planner", 0.25))
    (tmp_path / replay.trace_name("spec", 0.25)).write_bytes((folder / "spec.npz").read_bytes())
    found = replay.Replay.find(tmp_path, ["planner", "spec"], 0.25)
    assert found.describe()["system"] == "spec"
    with pytest.raises(replay.NoScores, match="holds no scores"):
        replay.Replay.find(tmp_path, ["planner"], 0.25)
    with pytest.raises(replay.NoScores, match="no selection trace at"):
        replay.Replay.find(tmp_path, ["spec_gqa"], 0.75)
    (tmp_path / replay.trace_name("planner", 0.25)).write_bytes(b"damaged")
    with pytest.raises(SpecjaxError, match="is not a selection trace"):
        replay.Replay.find(tmp_path, ["planner", "spec"], 0.25)


def test_results_label_replayed_selections(tmp_path):
    """The evaluation end to end: record, then replay onto the model that recorded; results.json and results.md say
    the selections were replayed and from what, and the replay read the bytes the recording read."""
    from absl import flags

    from specjax.eval import __main__ as cli

    common = ["prog", "--model=tiny-llama", "--init=random", "--limit=3", "--systems=as_h2o_lfu,spec",
              "--retention=0.25", "--noprogress", "--needle_facts=8"]
    try:
        flags.FLAGS([*common, f"--record_selections={tmp_path / 'trace'}", f"--output_dir={tmp_path / 'rec'}"])
        cli.main(["prog"])
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*common, f"--replay_selections={tmp_path / 'trace'}",
                     f"--output_dir={tmp_path / 'rep'}"])
        cli.main(["prog"])
    finally:
        flags.FLAGS.unparse_flags()
    rec = json.loads((tmp_path / "rec" / "results.json").read_text())
    rep = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == ["as_h2o_lfu@r=0.25.npz", "spec@r=0.25.npz"]
    assert rec["selections"]["mode"] == "record"
    assert rep["selections"]["mode"] == "replay"
    assert rep["selections"]["runs"]["spec@r=0.25"]["recorded_by"] == "tiny-llama"
    assert any("selections replayed from" in n and "accuracy is meaningless" in n for n in rep["notes"])
    assert "- selections: **replayed** from" in (tmp_path / "rep" / "results.md").read_text()
    for name in ("as_h2o_lfu", "spec"):
        assert rep["systems"][name]["io"]["disk_bytes"] == rec["systems"][name]["io"]["disk_bytes"]


def test_recording_and_replaying_at_once_is_refused():
    from specjax.eval import __main__ as cli
    from specjax.eval.errors import EvalError
    from specjax.eval.settings import EvalSettings

    with pytest.raises(EvalError, match="exclude each other"):
        cli._selection_setting(EvalSettings.from_values({"record_selections": "a", "replay_selections": "b"}))

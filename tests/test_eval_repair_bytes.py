"""Damaged stored KV and the bytes results report: what an attempt given up at a bad chunk read, and what repairing
the stored prefix read and wrote, are counted apart from the system's own disk bytes (per request, per run, in
results.md), and a repair in the warm-up leaves the system's own reads as on a whole store."""

import pathlib

import numpy as np
import pytest

import specjax
from specjax.engine import Engine, Request, fingerprint, make_system
from specjax.engine.systems import SystemOptions
from specjax.eval import report, report_markdown, runner, systems, tasks, workload
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.stores import K, PROBE, V, KVStore

EMULATION = {"disk_bandwidth": None, "pcie_bandwidth": None, "direct_io": False}


@pytest.fixture(scope="module")
def model():
    return specjax.load_model("tiny-llama", init="random")


def _flip_a_byte(store_dir, layer: int, kind: int, which: float = 0.5) -> None:
    """Flip one byte of a stored chunk of `layer` and `kind`: the chunk `which` of the way through the store."""
    with KVStore.open(store_dir, None) as store:
        chunks = sorted(store.stored_chunk_ids())
        key, offset = store.extent_of(layer, kind, chunks[int(which * (len(chunks) - 1))])
    path = pathlib.Path(store_dir) / key
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))


def _stored_bytes(store_dir, tokens: int) -> tuple[int, int]:
    """(every byte the store's chunks hold, as a repair's check reads them; the bytes of `tokens` tokens' vectors, as
    storing them writes them): K, V and probe keys of every layer."""
    with KVStore.open(store_dir, None) as store:
        lay = store.layout
        chunks = len(store.stored_chunk_ids()) * sum(lay.chunk_nbytes(k) for k in lay.kinds())
        return lay.num_layers * chunks, lay.num_layers * tokens * sum(lay.token_nbytes(k) for k in lay.kinds())


def test_a_request_meeting_a_bad_chunk_counts_its_given_up_reads_and_the_repair_apart(model, tmp_path):
    """as_full over a prefix with a flipped byte in one V chunk: the request that meets it is recomputed, its own I/O
    is that recompute's (nothing read), and the reads it gave up, the repair's check of every stored chunk and its
    writes are the request's repair_io; the next request reads as on a whole store and repairs nothing."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, model.config.vocab_size, 96).tolist()
    request = Request(prefix, rng.integers(0, model.config.vocab_size, 7).tolist(), [[5, 6]])
    clean_dir, damaged_dir = tmp_path / "clean", tmp_path / "damaged"
    for where in (clean_dir, damaged_dir):
        with KVStore.open(where, fingerprint(model, 16)) as store:
            Engine(model, make_system("as_full"), store).warm(prefix)
    with KVStore.open(clean_dir, fingerprint(model, 16)) as store:
        clean = Engine(model, make_system("as_full"), store).run(request)
    stored, written = _stored_bytes(damaged_dir, len(prefix))
    _flip_a_byte(damaged_dir, 1, V)
    with KVStore.open(damaged_dir, fingerprint(model, 16)) as store:
        engine = Engine(model, make_system("as_full"), store)
        met = engine.run(request)
        given_up = met.repair_io["disk_bytes"] - stored
        again = engine.run(request)
    assert met.recomputed_bad_chunks and met.io["bad_chunks"] == 1 and met.io["disk_bytes"] == 0
    assert 0 < given_up <= clean.io["disk_bytes"]
    assert met.repair_io == {"disk_bytes": stored + given_up, "disk_bytes_written": written, "damaged_chunks": 1}
    assert engine.repair_io == met.repair_io
    assert not again.recomputed_bad_chunks and again.io["disk_bytes"] == clean.io["disk_bytes"]
    assert again.repair_io == {"disk_bytes": 0, "disk_bytes_written": 0, "damaged_chunks": 0}
    np.testing.assert_allclose(met.first_token_logits, clean.first_token_logits, atol=1e-4)


def _needle(model):
    return workload.build_workload(tasks.load_task("needle"), tokenizer_for(model)[0],
                                   workload.WorkloadSpec(limit=4, prefix_tokens=512))


def test_spec_meeting_a_damaged_probe_extent_reads_its_own_bytes_and_reports_the_repair(model, tmp_path):
    """spec (without speculative prefetch, whose reads depend on timing) and as_full interleaved, once on a whole
    store and once after a byte of a probe-key extent flipped in the base store: spec meets it in its warm-up and
    stores the prefix anew; its timed requests then read the bytes they read on the whole store (the warm-up's
    reordering repacks the repaired prefix too), and results say apart from them what the repair cost."""
    wl = _needle(model)
    settings = systems.SystemSettings(chunk_tokens=16, options=SystemOptions(no_prefetch=True))
    plan = runner.plan(["as_full", "spec"], [0.02])

    def evaluate():
        return runner.run_all(model, wl, plan, settings, tmp_path / "store", interleave=True)

    clean = evaluate()
    (base,) = [p for p in (tmp_path / "store").iterdir() if p.is_dir() and p.name.startswith("base-")]
    stored, written = _stored_bytes(base, len(wl.requests[0].prefix_ids))
    _flip_a_byte(base, 1, PROBE)
    damaged = evaluate()
    results = report.build_results(model="tiny-llama", task="needle", weights="random", device="cpu",
                                   emulation=EMULATION, config={}, runs=damaged, requests=wl.requests)
    report.validate_results(results)
    spec, as_full = results["systems"]["spec-no_prefetch"], results["systems"]["as_full"]
    own = [[o.counters["disk_bytes"] for o in run.outcomes] for run in (clean[1], damaged[1])]
    assert own[0] == own[1]  # its own reads, as on the whole store
    assert spec["io"]["disk_bytes"] == sum(own[1]) and spec["io"]["repair_disk_bytes"] == 0  # met in the warm-up
    repair = spec["repair"]
    assert repair["prefixes"] == 1 and repair["damaged_chunks"] == 1
    assert repair["disk_bytes_written"] == 2 * written  # stored anew in its copy, then in the base store
    assert repair["disk_bytes"] >= 2 * stored  # both checked whole, and the warm-up's attempt given up
    assert as_full["repair"] is None and as_full["io"]["repair_disk_bytes"] == 0  # it reads no probe keys
    assert all({"repair_disk_bytes", "repair_disk_bytes_written"} <= o.counters.keys() for o in damaged[1].outcomes)

    (note,) = [n for n in report.store_notes(damaged) if n.startswith("spec-no_prefetch: ")]
    assert (f"disk: {report_markdown.fmt_bytes(np.mean(own[1]))} a request its own, and repair of 1 damaged chunks "
            f"{report_markdown.fmt_bytes(repair['disk_bytes'])} read, {report_markdown.fmt_bytes(2 * written)} written") in note
    results["notes"] = report.store_notes(damaged)
    assert f"**note**: {note}" in report_markdown.markdown(results)

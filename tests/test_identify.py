"""Identification as a decision (`specjax.engine.identify`): a policy, driven by a plain loop over one layer's KV in
memory instead of the engine, asks for the reads and device steps it should, in order, and chooses what its scores
say. No engine, store or cache takes part."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.engine import identify as I, policy_steps as P
from specjax.engine import make_system
from specjax.engine import state as st
from specjax.kernels import PerHeadIndices, SharedIndices
from specjax.shapes import bucket
from specjax.stores import K, PROBE, V

# 6 query heads over 3 KV heads: SPEC's probe heads 0, 1, 2 read KV heads 0 and 1, so the probe keys are not K
CFG = ModelConfig(arch="llama", vocab_size=32, hidden_size=48, num_layers=4, num_heads=6, num_kv_heads=3, head_dim=8,
                  intermediate_size=32, max_positions=512)
M, N, D = 40, 4, 8
M_PAD, N_PAD = bucket(M), bucket(N)
KEEP = 10


class Memory:
    """Carries a policy's steps out over one layer's KV in memory (`kv`: kind -> [heads, M, d]); the scores of a
    role in `scores` are handed back in place of the computed ones (as a replayed selection trace would be)."""

    def __init__(self, kv: dict, scores: dict | None = None, cached: bool = False):
        """`cached`: every row is in the caches' pages, so a `TakeChosen` is served (else it gets None)."""
        self.kv, self.scores, self.cached = kv, scores or {}, cached
        self.steps: list = []
        self.computed: dict = {}  # role -> the scores a Score step computed

    def run(self, policy, facts, layer, state):
        steps, result = policy.select(facts, layer, state), None
        try:
            while True:
                step = steps.send(result)
                self.steps.append(step)
                result = self.carry_out(layer, step)
        except StopIteration as done:
            return done.value

    def carry_out(self, layer, step):
        match step:
            case P.Take():
                positions = layer.positions if step.positions is None else np.asarray(step.positions)
                rows = np.zeros((self.kv[step.kind].shape[0], step.pad_to or layer.m_pad, D), np.float32)
                rows[:, : len(positions)] = self.kv[step.kind][:, positions]
                return jnp.asarray(rows)
            case P.TakeChosen():
                if not (self.cached and bool(step.when)):
                    return None
                rows = np.asarray(step.rows)[: step.count]
                return tuple(self.carry_out(layer, P.Take(kind, layer.positions[rows], step.pad_to))
                             for kind in step.kinds)
            case P.Score():  # as LayerIO: a trace stands in for the scores, never for the logits
                got = step.fn(*step.args, **step.kwargs)
                computed, logits = got if step.logits else (got, None)
                self.computed[step.role] = computed
                given = self.scores.get(step.role)
                scores = computed if given is None else jnp.asarray(given, computed.dtype)
                return (scores, logits) if step.logits else scores
            case P.Decide():
                return step.fn(*step.args, **step.kwargs)
            case P.Credit() | P.PlanPeriod():
                return None
        raise AssertionError(f"not a step: {step!r}")

    def kinds(self) -> list:
        """Each step as (its type's name, the kind it reads or None)."""
        return [(type(s).__name__, getattr(s, "kind", None)) for s in self.steps]


def _kv(seed=0):
    rng = np.random.default_rng(seed)
    kv = {kind: rng.standard_normal((CFG.num_kv_heads, M, D)).astype(np.float32) for kind in (K, V)}
    kv[PROBE] = kv[K][:2]  # the probe kind holds the probe heads' KV heads (0 and 1)
    q = jnp.asarray(rng.standard_normal((CFG.num_heads, N_PAD, D)), jnp.float32)
    own_k = jnp.asarray(rng.standard_normal((CFG.num_kv_heads, N_PAD, D)), jnp.float32)
    return kv, P.Layer(0, q, own_k, N, KEEP, bucket(KEEP), M, M_PAD, np.arange(M))


def _facts(system: str, **changes) -> I.Facts:
    return I.Facts.of(CFG, make_system(system, **changes), chunk_tokens=8, kernel_impl="reference")


def _state():
    return st.ImportanceState.init(CFG.num_layers, M_PAD)


def _top(row: np.ndarray, k: int = KEEP) -> set:
    return set(np.argsort(-np.asarray(row)[:M], kind="stable")[:k].tolist())


def test_facts_name_the_probe_heads_and_whether_their_keys_are_k():
    f = _facts("spec")
    assert (f.probe_q, f.probe_kv, f.kv_of_probe, f.probe_is_k) == ((0, 1, 2), (0, 1), (0, 0, 1), False)
    assert f.kv_of_head == (0, 0, 1, 1, 2, 2)
    wide = I.Facts.of(CFG, dataclasses.replace(make_system("spec"), num_probe_heads=6))
    assert wide.probe_is_k and wide.probe_kv == (0, 1, 2)


def test_h2o_reads_every_key_then_only_the_values_its_heads_chose():
    kv, layer = _kv()
    memory = Memory(kv)
    out = memory.run(I.policy("h2o"), _facts("as_h2o_lfu"), layer, _state())
    assert memory.kinds() == [("Take", K), ("Score", None), ("Decide", None), ("Take", V)]
    assert memory.steps[0].positions is None  # every key
    scores = np.asarray(memory.computed["heads"])
    chosen = np.asarray(out.chosen)
    assert chosen.shape == (CFG.num_heads, KEEP) and isinstance(out.selection, PerHeadIndices)
    for head in range(CFG.num_heads):  # each head its own top-k of the scores it was given
        assert set(chosen[head].tolist()) == _top(scores[head])
    union = np.unique(chosen)
    np.testing.assert_array_equal(memory.steps[3].positions, union)  # the values of the union, and nothing else
    values = np.asarray(out.values)
    np.testing.assert_array_equal(values[:, union], kv[V][:, union])
    others = np.setdiff1d(np.arange(M_PAD), union)
    assert not values[:, others].any()
    np.testing.assert_array_equal(np.asarray(out.state.selected[0])[: len(union)], union)
    assert bool(out.state.fallback[0])


def test_itf_takes_the_probes_shared_set_when_they_agree_and_reads_only_its_kv():
    kv, layer = _kv(1)
    row = np.random.default_rng(2).random(M_PAD).astype(np.float32)
    memory = Memory(kv, scores={"probes": np.stack([row] * 3)})  # three probe heads, one opinion
    out = memory.run(I.policy("itf"), _facts("spec"), layer, _state())
    assert memory.kinds() == [("Take", PROBE), ("Score", None), ("Decide", None), ("TakeChosen", None),
                              ("Take", K), ("Take", V)]  # nothing cached: the device could take none of the set
    assert memory.steps[0].phase == "probe_io" and memory.steps[1].role == "probes"
    assert memory.steps[3].kinds == (K, V) and bool(memory.steps[3].when)
    chosen = np.asarray(out.chosen)
    assert chosen.shape == (1, KEEP) and set(chosen[0].tolist()) == _top(row)
    assert isinstance(out.selection, SharedIndices)
    for take in memory.steps[4:]:  # the shared set's K and V, nothing else
        np.testing.assert_array_equal(take.positions, chosen[0])
    np.testing.assert_array_equal(np.asarray(out.keys)[:, :KEEP], kv[K][:, chosen[0]])
    assert not bool(out.state.fallback[0]) and float(out.state.jaccard[0]) == 1.0


def test_itf_takes_a_cached_shared_set_on_the_device_and_gets_what_its_takes_would_give():
    kv, layer = _kv(1)
    row = np.random.default_rng(2).random(M_PAD).astype(np.float32)
    by_takes = Memory(kv, scores={"probes": np.stack([row] * 3)}).run(I.policy("itf"), _facts("spec"), layer, _state())
    memory = Memory(kv, scores={"probes": np.stack([row] * 3)}, cached=True)
    out = memory.run(I.policy("itf"), _facts("spec"), layer, _state())
    assert memory.kinds() == [("Take", PROBE), ("Score", None), ("Decide", None), ("TakeChosen", None)]
    step = memory.steps[3]
    assert step.count == KEEP and step.pad_to == bucket(KEEP)
    np.testing.assert_array_equal(np.asarray(step.rows)[:KEEP], np.asarray(out.chosen)[0])
    np.testing.assert_array_equal(np.asarray(out.chosen), np.asarray(by_takes.chosen))
    for field in ("keys", "values"):
        np.testing.assert_array_equal(np.asarray(getattr(out, field)), np.asarray(getattr(by_takes, field)))


def test_itf_falls_back_to_every_heads_own_set_when_the_probes_disagree():
    kv, layer = _kv(3)
    apart = np.zeros((3, M_PAD), np.float32)
    for probe in range(3):  # each probe head attends to a block of its own
        apart[probe, probe * KEEP:(probe + 1) * KEEP] = 1.0 + np.arange(KEEP)
    memory = Memory(kv, scores={"probes": apart}, cached=True)  # whatever is cached, the failed test decides
    out = memory.run(I.policy("itf"), _facts("spec"), layer, _state())
    assert memory.kinds() == [("Take", PROBE), ("Score", None), ("Decide", None), ("TakeChosen", None),
                              ("Take", K), ("Score", None), ("Decide", None), ("Take", V)]  # the test failed:
    assert not bool(memory.steps[3].when)  # no shared set taken; per-head H2O
    assert memory.steps[4].positions is None and memory.steps[5].role == "heads"
    assert bool(out.state.fallback[0]) and float(out.state.jaccard[0]) == 0.0
    scores = np.asarray(memory.computed["heads"])
    for head in range(CFG.num_heads):
        assert set(np.asarray(out.chosen)[head].tolist()) == _top(scores[head])


def test_chunks_first_layer_of_a_period_chooses_and_plans_its_later_layers_reuse_the_choice():
    kv, layer = _kv(4)
    facts = _facts("contiguous_kv")
    period = facts.system.period_layers
    assert period > 1
    memory = Memory(kv)
    first = memory.run(I.policy("chunks"), facts, layer, _state())
    assert memory.kinds() == [("Take", K), ("Score", None), ("Decide", None), ("Credit", K), ("PlanPeriod", None),
                              ("Take", V)]
    chosen = np.asarray(first.chosen)[0]
    chunks = np.unique(chosen // facts.chunk_tokens)
    assert len(chosen) == len(chunks) * facts.chunk_tokens  # whole chunks (none of them the partial last)
    credit, plan = memory.steps[3], memory.steps[4]
    np.testing.assert_array_equal(credit.positions, chosen)
    np.testing.assert_array_equal(credit.importance, first.importance()[chosen])
    np.testing.assert_array_equal(plan.chosen, chosen)

    later = Memory(kv)
    second = later.run(I.policy("chunks"), facts, P.Layer(1, layer.q, layer.own_k, N, KEEP, layer.k_cap, M, M_PAD,
                                                          layer.positions), first.state)
    assert later.kinds() == [("Take", K), ("Take", V)]  # nothing scored or decided: the period's choice
    for take in later.steps:
        np.testing.assert_array_equal(take.positions, chosen)
        np.testing.assert_array_equal(take.importance, first.importance()[chosen])
    np.testing.assert_array_equal(np.asarray(second.chosen)[0], chosen)
    np.testing.assert_array_equal(second.importance(), first.importance())


def test_identification_imports_no_reader_and_no_engine():
    """A policy reads through the steps it yields, so its module imports nothing that reads or runs requests (the
    engine imports it; it imports neither the engine nor the engine's reader, `layer_io`)."""
    import ast

    tree = ast.parse(open(I.__file__).read())
    imported = set()  # every module named, and module.name for each name imported from one
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    assert "specjax.engine.state" in imported  # the parse sees the module's imports
    banned = {"specjax.engine.engine", "specjax.engine.layer_io", "specjax.stores.prefetch", "specjax.stores.caches",
              "specjax.stores.store"}
    assert not imported & banned


def test_every_identification_a_system_may_name_is_a_policy():
    from specjax.engine.systems import IDENTIFY, SYSTEMS

    assert IDENTIFY is I.POLICIES and {s.identify for s in SYSTEMS.values()} <= set(IDENTIFY)
    for name in IDENTIFY:
        assert isinstance(I.policy(name), I.POLICIES[name])

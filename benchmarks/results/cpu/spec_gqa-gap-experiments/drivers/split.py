import functools, os, runpy, sys
import jax
from specjax.engine import state as st
from specjax.kernels import itf
if os.environ.get("SPLIT", "1") == "1":
    @functools.partial(jax.jit, static_argnames=("k_cap",))
    def _top(head_scores, prefix_len, *, k_cap):
        return itf.top_k(head_scores, k_cap, prefix_len)
    @functools.partial(jax.jit, static_argnames=("groups", "probe_rows", "k_cap", "guarded"))
    def _rest(state, layer, head_scores, per_head, k, prefix_len, alpha, min_share, *, groups, probe_rows, k_cap, guarded, kept_of=None):
        probes = st.kv_head_scores(head_scores[:probe_rows], prefix_len, groups=groups)
        decision = itf.identify(probes, k, prefix_len, alpha, k_cap=k_cap)
        state = st._record_itf(state, layer, decision, k, prefix_len, kept_of)
        use_shared = decision.use_shared
        if guarded:
            state, use_shared = st._guard(state, layer, head_scores, decision.shared, k, prefix_len, use_shared, min_share, k_cap, per_head)
        return state, probes, decision.shared, per_head, use_shared
    def gqa_select(state, layer, head_scores, k, prefix_len, alpha, min_share, *, groups, probe_rows, k_cap, guarded, kept_of=None):
        per_head = _top(head_scores, prefix_len, k_cap=k_cap)
        return _rest(state, layer, head_scores, per_head, k, prefix_len, alpha, min_share, groups=groups, probe_rows=probe_rows, k_cap=k_cap, guarded=guarded, kept_of=kept_of)
    st.gqa_select = gqa_select
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)

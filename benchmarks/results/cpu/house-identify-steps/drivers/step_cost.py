"""Host cost of carrying out a policy's steps through LayerIO.select's loop, against calling the step functions directly."""
import time
import numpy as np
from specjax.engine import identify as I
from specjax.engine.layer_io import LayerIO

class FakeIO:
    _carry_out = LayerIO._carry_out
    select = LayerIO.select
    all_positions = np.arange(10); m = 10; m_pad = 16
    class engine:
        selections = None
        facts = None
    def take(self, *a, **k): return 1
    def identify(self, fn, *a, **k): return fn(*a, **k)

def noop(*a, **k): return 0

class Policy:
    def select(self, f, layer, state):
        for _ in range(STEPS // 2):
            yield I.Take(1)
            yield I.Decide(noop, (1, 2), {})
        return state

STEPS = 200
io, pol = FakeIO(), Policy()
def via_steps():
    io.select(pol, None, 0, None, None, 1, 1, 16)
def direct():
    for _ in range(STEPS // 2):
        io.take(0, 1, io.all_positions, 16, "kv_io_stall", importance=None)
        io.identify(noop, 1, 2)
for fn in (via_steps, direct, via_steps, direct):
    best = min((lambda t0: (fn(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(200))
    print(fn.__name__, f"{best * 1e6 / STEPS:.2f} us per step")

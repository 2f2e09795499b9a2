import sys, runpy, gc
mode = sys.argv.pop(1)
if mode == "off":
    gc.disable()
elif mode == "freeze":
    import specjax.eval.runner as R  # freeze after imports; thresholds higher
    gc.set_threshold(100000, 50, 100)
sys.argv[0] = "specjax.eval"
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)

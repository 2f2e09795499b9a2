import runpy, sys, os
sys.setswitchinterval(float(os.environ.get("SW", "0.005")))
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)

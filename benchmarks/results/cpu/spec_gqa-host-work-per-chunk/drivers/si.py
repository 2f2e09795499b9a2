import sys, runpy
sys.setswitchinterval(float(sys.argv.pop(1)))
sys.argv[0] = "specjax.eval"
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)

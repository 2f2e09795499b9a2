import json, sys, os
for d in sys.argv[1:]:
    if not os.path.exists(d + "/results.json"): continue
    r=json.load(open(d + "/results.json"))
    s=r["systems"]["spec_gqa"]; h=r["systems"]["as_h2o_lfu"]
    f=lambda x: "/".join(f"{v:.0f}" for v in x["breakdown_ms"].values())
    print(d.split("/")[-2] + "/" + d.split("/")[-1], "h2o %.1f [%s] gqa %.1f [%s] ratio %.3f"%(h["ttft_ms"]["mean"], f(h), s["ttft_ms"]["mean"], f(s), s["ttft_ms"]["mean"]/h["ttft_ms"]["mean"]),
          "gqa MB %.2f reads %.1f acc %.3f/%.3f compiles %s/%s" % (s["io"]["disk_bytes"]/40/1e6, s["io"]["read_requests_per_request"], s["accuracy"]["acc"], h["accuracy"]["acc"], s["compilations_timed"], h["compilations_timed"]))

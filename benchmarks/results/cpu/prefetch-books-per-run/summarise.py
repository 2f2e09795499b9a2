import json, sys, glob, statistics, os
for d in sorted(glob.glob(sys.argv[1] + '/*-[0-9]')):
    if not os.path.exists(d + '/requests.jsonl'): continue
    rows = [json.loads(l) for l in open(d + '/requests.jsonl')]
    sha = json.load(open(d + '/results.json')).get('code', {}).get('source_sha256', '')[:10]
    out = []
    for s in sorted({r['system'] for r in rows}):
        rs = [r for r in rows if r['system'] == s]
        t = statistics.mean(r['ttft_ms'] for r in rs)
        bd = {k: round(statistics.mean(r['breakdown_ms'][k] for r in rs)) for k in rs[0]['breakdown_ms']}
        reads = statistics.mean(r['counters'].get('read_requests', 0) for r in rs)
        mb = statistics.mean(r['counters'].get('disk_bytes', 0) for r in rs) / 1e6
        he = [r['counters']['host_exposed_ms'] for r in rs if r['counters'].get('host_exposed_ms') is not None]
        out.append(f"{s} {t:7.1f} ms [{' '.join(f'{k}={v}' for k, v in bd.items())}] reads {reads:.0f} {mb:.1f} MB exposed {statistics.mean(he) if he else float('nan'):.0f}")
    print(os.path.basename(d), sha, '\n   ' + '\n   '.join(out))

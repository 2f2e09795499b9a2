import os, time, tempfile, concurrent.futures, numpy as np, sys
n_threads = int(sys.argv[1])
path = tempfile.mktemp()
data = np.random.default_rng(0).bytes(128 << 20)
with open(path, "wb") as f: f.write(data)
pool = concurrent.futures.ThreadPoolExecutor(n_threads)
def rd(off):
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(32768)
        os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
    return buf
for rep in range(3):
    t = time.perf_counter()
    futs = [pool.submit(rd, i * 65536) for i in range(3584)]
    concurrent.futures.wait(futs)
    dt = time.perf_counter() - t
    print(f"threads {n_threads}: {dt/3584*1e6:.1f} us/read")
os.remove(path)

#!/usr/bin/env python3
"""Runs PyTorch jobs together on one GPU, each with its own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
and prints each one's rate over the same stretch, for tests/gpu/mps-check (not in tests/run).

    mps-pairs.py SECONDS APP:PCT [APP:PCT ...]      APP is matmul or stream
Prints one JSON line: the jobs and their iterations per second.
"""
import json, os, subprocess, sys, tempfile, time

APPS = {
    "matmul": "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a); step = lambda: torch.matmul(a, b)",
    "stream": "a = torch.empty(1 << 30, device='cuda'); b = torch.empty_like(a); step = lambda: b.copy_(a)",
}

# Each job sets up, says it is ready, waits for the common start time, then counts steps.
CHILD = """
import os, sys, time, torch
{setup}
step(); torch.cuda.synchronize()
open(sys.argv[1], 'w').close()
while not os.path.exists(sys.argv[2]): time.sleep(0.01)
t0 = float(open(sys.argv[2]).read()); secs = float(sys.argv[3])
while time.time() < t0: time.sleep(0.001)
n = 0
while time.time() < t0 + secs:
    for _ in range(10): step()
    torch.cuda.synchronize(); n += 10
print(n / secs, flush=True)
"""


def main():
    secs = float(sys.argv[1])
    jobs = [(j.split(":")[0], int(j.split(":")[1])) for j in sys.argv[2:]]
    d = tempfile.mkdtemp()
    go = os.path.join(d, "go")
    procs = []
    for k, (app, pct) in enumerate(jobs):
        env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(pct))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", CHILD.format(setup=APPS[app]), os.path.join(d, f"ready{k}"), go, str(secs)],
            env=env, stdout=subprocess.PIPE, text=True))
    while not all(os.path.exists(os.path.join(d, f"ready{k}")) for k in range(len(jobs))):
        if any(p.poll() not in (None, 0) for p in procs):
            sys.exit("a job failed to start")
        time.sleep(0.05)
    with open(go + ".tmp", "w") as f:
        f.write(str(time.time() + 0.5))
    os.rename(go + ".tmp", go)
    rates = [float(p.communicate()[0].strip()) for p in procs]
    print(json.dumps({"jobs": [f"{a}:{p}" for a, p in jobs], "rates": [round(r, 1) for r in rates]}), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A real GPU job for tests/gpu/nvml-check: tells multiplexd it starts on its GPU the way the
SPANK plugin does (same socket protocol; Slurm's allocation is GPU $GPU_INDEX, default 0),
does a fixed amount of work with PyTorch, reports its progress, tells the daemon it
finished, and prints its own measured rate.

    workload.py SOCKET NODE JOB_ID APP ITERATIONS
APP is "matmul" (bf16 8192^3 products, compute bound) or "stream" (large copies, memory bound).
With REPORTS=0 in its environment it sends no progress reports: the daemon then measures it
by its busy GPU time alone.
"""
import json, os, socket, struct, sys, time

import torch


def call(path, request):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    body = json.dumps({"version": 2, "request": request}).encode()
    s.sendall(struct.pack(">I", len(body)) + body)
    n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
    reply = json.loads(s.recv(n, socket.MSG_WAITALL))
    s.close()
    return reply["response"]


def main():
    path, node, job, app, iters = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    # Set up before asking for the GPU, so start-up time is not counted as work.
    dev = torch.device("cuda:0")
    if app == "matmul":
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        step = lambda: torch.matmul(a, b)
    else:
        a = torch.empty(1 << 30, device=dev, dtype=torch.float32)  # 4 GiB
        b = torch.empty_like(a)
        step = lambda: b.copy_(a)
    step()
    torch.cuda.synchronize()
    gpu = os.environ.get("GPU_INDEX", "0")
    started = call(path, {"type": "start", "job_id": job, "step_id": 0, "uid": 0, "app": app,
                          "mem_mb": None, "node": node, "slurm_gres": None,
                          "slurm_job_gpus": gpu, "admin_comment": None})
    print(f"job {job} ({app}) started: {json.dumps(started)}", flush=True)
    reports = os.environ.get("REPORTS", "1") != "0"
    t0 = time.monotonic()
    for i in range(1, iters + 1):
        step()
        if reports and i % (iters // 10) == 0:
            torch.cuda.synchronize()
            call(path, {"type": "report", "job_id": job, "kind": {"kind": "progress", "done": float(i)}})
    torch.cuda.synchronize()
    dt = time.monotonic() - t0
    call(path, {"type": "finish", "job_id": job, "step_id": 0, "exit_status": 0})
    print(f"job {job} ({app}) ran {iters} iterations in {dt:.2f} s: {iters / dt:.1f} it/s", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One training job of tests/gpu/real-pairs, kept warm between its runs.

    real-job.py MODEL DEVICE [--daemon SOCKET[,reports]]... [--node NODE] [--gpu INDEX]

MODEL is one of MODELS below; DEVICE is "cuda" (a real GPU), "cpu" (the same models, tiny, on
the CPU: the dry run where PyTorch is installed) or "standin" (no PyTorch: a process whose
iterations burn or wait on the CPU as a training step does on a GPU, for the dry run on CI).

It builds its model and synthetic data, warms up, prints {"ready": ...} on stdout and then
obeys one JSON command per line on stdin:

    {"cmd": "run", "seconds": T}           run T seconds
    {"cmd": "run", "iters": N}             run N iterations (the same work every time)
    ... "job": {"id": J, "app": A}         and tell each daemon as slurmstepd's plugin does:
                                           start (job J of application A on GPU INDEX), progress
                                           reports every half second to those marked
                                           ",reports", finish at the end
    {"cmd": "quit"}

and answers each run with {"done": {"iters", "t0", "t1", "marks", "mem_mb"}}: the
CLOCK_MONOTONIC times it started and ended (one clock for every process of the machine),
[time, iterations] about every 50 ms, and its peak memory (MiB: PyTorch's reserved GPU memory
on a GPU, else the process's peak resident memory). Its own rate is iterations / (t1 - t0).
The job's Slurm id, for the daemon's telemetry, is SLURM_JOB_ID in its environment.
"""
import json
import os
import resource
import socket
import struct
import sys
import time

MODELS = {
    # name: what it is (on a GPU; on the CPU the same, tiny)
    "resnet18": "ResNet-18, batch 64, 224 px, bf16 autocast",
    "resnet50": "ResNet-50, batch 32, 224 px, bf16 autocast",
    "vit": "ViT-B/16, batch 32, 224 px, bf16 autocast",
    "lm": "GPT-style transformer LM, 6 layers, d 512, 256 tokens, batch 16",
    "recommender": "MLP recommender, 8 embedding tables of 100k x 64, batch 4096",
    "input-bound": "ResNet-18, batch 32, fed by a one-thread CPU input pipeline",
    # Stand-ins (no PyTorch): what they do to one CPU core, which plays the GPU.
    "compute": "stand-in: a fixed computation per step (about 10 ms alone)",
    "mixed": "stand-in: half that computation and 5 ms of waiting per step",
    "input": "stand-in: a sixth of it and 12 ms waiting for input per step",
}
# (additions per step, seconds of waiting per step)
STANDINS = {"compute": (600_000, 0.0), "mixed": (300_000, 0.005), "input": (100_000, 0.012)}


def call(path, request):
    """One request to a daemon's socket (its wire format: a 4-byte length, then JSON)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        body = json.dumps({"version": 2, "request": request}).encode()
        s.sendall(struct.pack(">I", len(body)) + body)
        n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
        return json.loads(s.recv(n, socket.MSG_WAITALL))["response"]
    finally:
        s.close()


def burn(additions):
    """A fixed amount of work (not of time): it takes longer while another job holds the core."""
    return sum(range(additions))


def build(model, device):
    """The model's training step, as a function of no arguments."""
    if device == "standin":
        work, wait = STANDINS[model]
        return lambda: (burn(work), time.sleep(wait) if wait else None), lambda: None

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    gpu = device == "cuda"
    dev = torch.device("cuda:0" if gpu else "cpu")
    if gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    # On the CPU: the same models, tiny, so that the dry run takes seconds.
    px, scale = (224, 1) if gpu else (32, 8)
    sync = (lambda: torch.cuda.synchronize()) if gpu else (lambda: None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)

    def image_step(net, batch, classes, pipeline=False):
        net = net.to(dev).to(memory_format=torch.channels_last) if gpu else net.to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, 3, px, px, device=dev)
        y = torch.randint(0, classes, (batch,), device=dev)

        def step():
            inp = x
            if pipeline:
                # Decoding and augmenting on one CPU thread, as a starved data loader does.
                raw = torch.randint(0, 255, (batch, 3, px, px), dtype=torch.uint8)
                img = raw.float().div_(255).sub_(0.5).div_(0.25)
                img = torch.flip(img, dims=[3]) if raw[0, 0, 0, 0] > 127 else img
                inp = img.to(dev, non_blocking=False)
            with autocast():
                loss = F.cross_entropy(net(inp), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step

    import torchvision

    if model == "resnet18":
        return image_step(torchvision.models.resnet18(num_classes=1000), 64 // scale, 1000), sync
    if model == "resnet50":
        return image_step(torchvision.models.resnet50(num_classes=1000), 32 // scale, 1000), sync
    if model == "input-bound":
        if not gpu:
            torch.set_num_threads(1)
        return image_step(torchvision.models.resnet18(num_classes=1000), 32 // scale, 1000, pipeline=True), sync
    if model == "vit":
        if gpu:
            net = torchvision.models.vit_b_16(num_classes=1000)
        else:
            net = torchvision.models.VisionTransformer(
                image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10
            )
        return image_step(net, 32 // scale, 10 if not gpu else 1000), sync
    if model == "lm":
        vocab, d, layers, seq, batch = (16000, 512, 6, 256, 16) if gpu else (1000, 64, 2, 32, 4)

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.pos = nn.Parameter(torch.zeros(seq, d))
                layer = nn.TransformerEncoderLayer(d, 8 if gpu else 2, 4 * d, batch_first=True, norm_first=True)
                self.body = nn.TransformerEncoder(layer, layers)
                self.head = nn.Linear(d, vocab)
                self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

            def forward(self, t):
                return self.head(self.body(self.emb(t) + self.pos, mask=self.mask))

        net = LM().to(dev)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=dev)

        def step():
            with autocast():
                logits = net(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step, sync
    if model == "recommender":
        tables, rows, dim, batch = (8, 100_000, 64, 4096) if gpu else (4, 1000, 16, 256)

        class Rec(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
                self.dense = nn.Sequential(nn.Linear(13, dim), nn.ReLU())
                self.top = nn.Sequential(
                    nn.Linear(dim * (tables + 1), 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1)
                )

            def forward(self, dense, idx):
                parts = [self.dense(dense)] + [e(idx[:, k, :]) for k, e in enumerate(self.emb)]
                return self.top(torch.cat(parts, dim=1)).squeeze(1)

        net = Rec().to(dev)
        opt = torch.optim.Adagrad(net.parameters(), lr=0.01)
        dense = torch.randn(batch, 13, device=dev)
        idx = torch.randint(0, rows, (batch, tables, 4), device=dev)
        y = torch.rand(batch, device=dev)

        def step():
            with autocast():
                loss = F.binary_cross_entropy_with_logits(net(dense, idx).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step, sync
    raise SystemExit(f"real-job: unknown model {model!r}: choose from {', '.join(MODELS)}")


def peak_mb(device):
    if device == "cuda":
        import torch

        return round(torch.cuda.max_memory_reserved() / 2**20)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        raise SystemExit(__doc__)
    model, device = args[0], args[1]
    daemons, node, gpu = [], "gpunode", "0"
    rest = args[2:]
    while rest:
        flag, value, rest = rest[0], rest[1], rest[2:]
        if flag == "--daemon":
            path, _, mark = value.partition(",")
            daemons.append((path, mark == "reports"))
        elif flag == "--node":
            node = value
        elif flag == "--gpu":
            gpu = value
        else:
            raise SystemExit(f"real-job: unknown option {flag}")
    if model not in MODELS:
        raise SystemExit(f"real-job: unknown model {model!r}: choose from {', '.join(MODELS)}")
    if (device == "standin") != (model in STANDINS):
        raise SystemExit(f"real-job: {model} is {'' if model in STANDINS else 'not '}a stand-in; device {device}")
    step, sync = build(model, device)
    # Warm-up: kernels chosen, memory allocated, caches filled.
    t = time.monotonic()
    n = 0
    while n < 5 or time.monotonic() - t < 1.0:
        step()
        n += 1
    sync()
    print(json.dumps({"ready": {"model": model, "pid": os.getpid(), "mem_mb": peak_mb(device)}}), flush=True)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            return
        job = cmd.get("job")
        if job:
            uid = os.getuid()
            for path, _ in daemons:
                said = call(path, {"type": "start", "job_id": job["id"], "step_id": 0, "uid": uid,
                                   "app": job["app"], "mem_mb": None, "node": node, "slurm_gres": None,
                                   "slurm_job_gpus": gpu, "admin_comment": None})
                if said.get("type") != "started":
                    raise SystemExit(f"real-job: {path} did not record job {job['id']}: {said}")
        iters, seconds = cmd.get("iters"), cmd.get("seconds")
        t0 = time.monotonic()
        marks, i, next_mark, next_report = [[t0, 0]], 0, t0 + 0.05, t0 + 0.5
        while (iters is not None and i < iters) or (seconds is not None and time.monotonic() - t0 < seconds):
            step()
            i += 1
            now = time.monotonic()
            if now >= next_mark:
                sync()
                now = time.monotonic()
                marks.append([now, i])
                next_mark = now + 0.05
            if job and now >= next_report:
                for path, reports in daemons:
                    if reports:
                        call(path, {"type": "report", "job_id": job["id"],
                                    "kind": {"kind": "progress", "done": float(i)}})
                next_report = now + 0.5
        sync()
        t1 = time.monotonic()
        marks.append([t1, i])
        if job:
            for path, _ in daemons:
                call(path, {"type": "finish", "job_id": job["id"], "step_id": 0, "exit_status": 0})
        print(json.dumps({"done": {"iters": i, "t0": t0, "t1": t1, "marks": marks, "mem_mb": peak_mb(device)}}),
              flush=True)


if __name__ == "__main__":
    main()

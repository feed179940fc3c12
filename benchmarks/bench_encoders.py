"""Forward+backward timings of the guide encoders.

    python benchmarks/bench_encoders.py [--threads 2] [--device cpu] [--repeats 20]

SetTransformer: B=128, N=40 parts, dim_in=16, hidden 128, 4 heads, 16 inducing points, 2 ISABs, K=10 outputs,
with a soft key mask; both attention kernels (explicit / SDPA).  PartEncoder: M=40, 4x128 channels, B=128, 40x40.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from probcaps import encoders
from probcaps.encoders import PartEncoder, SetTransformer


def timeit(fn, repeats: int, device: str, warmup: int = 3) -> str:
    """``"min / median ms"`` over ``repeats`` calls (the min is the robust figure on a shared, loaded machine)."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return f"{times[0] * 1e3:7.1f} / {times[len(times) // 2] * 1e3:7.1f} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128, help="images (and part sets) per call")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = args.device
    B, N, M = args.batch, 40, 40

    st = SetTransformer(16, 10, 32, dim_hidden=128, num_heads=4, num_inds=16, num_isab=2).to(dev)
    x = torch.randn(B, N, 16, device=dev)
    w = torch.rand(B, N, device=dev)
    w[:, -10:] = 0

    def st_step():
        st.zero_grad(set_to_none=True)
        st(x, w).square().mean().backward()

    def st_fwd():
        with torch.no_grad():
            st(x, w)

    for sdpa in (False, True):
        encoders.USE_SDPA = sdpa
        name = "sdpa" if sdpa else "explicit"
        print(
            f"SetTransformer [{name:8s}] B={B} N={N}: fwd+bwd {timeit(st_step, args.repeats, dev)}, "
            f"fwd (no_grad) {timeit(st_fwd, args.repeats, dev)}  (min / median)"
        )
    encoders.USE_SDPA = False

    enc = PartEncoder(M).to(dev)
    img = torch.rand(B, 1, 40, 40, device=dev)

    def enc_step():
        enc.zero_grad(set_to_none=True)
        out = enc(img)
        (out.presence_logit.mean() + out.pose.square().mean() + out.features.square().mean()).backward()

    def enc_fwd():
        with torch.no_grad():
            enc(img)

    reps = max(3, args.repeats // 4) if dev == "cpu" else args.repeats
    print(
        f"PartEncoder M={M} 4x128ch B={B} 40x40: fwd+bwd {timeit(enc_step, reps, dev)}, "
        f"fwd (no_grad) {timeit(enc_fwd, reps, dev)}  (min / median)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a decode_chain call spends its time: per-stage and per-barrier times across the CTAs.

    cd benchmarks && QWEN3_CHAIN_DEBUG=8 python decode_chain_stages.py [8B|0.6B|32B]

QWEN3_CHAIN_DEBUG (read once by the extension; csrc/kernels/decode_chain.cu): bit 3 makes thread 0
of every CTA store globaltimer stamps into the workspace (the start, each stage's end before its
barrier, each stage's start after it); bits 1 and 2 skip the multiply / the grid barriers, which
gives wrong outputs but separates streaming from arithmetic and waiting. The last of 20 calls is
printed: min / median / max over the CTAs of each stamp, in us since the earliest kernel entry
(a call's time minus the last exit is the gap between calls).
Thirteenth session (H200, 8B, the TMA-ring kernel): a CTA's stage-1 end ranged over 25 us with
equal work per CTA; fourteenth: dealing units dynamically did not make the stages shorter, the
register-load kernel (now the only one) did (RESULTS.md).
"""

import os
import sys

import torch

import qwen3_kernels

SHAPES = {"8B": (4096, 4096, 12288, 6144), "0.6B": (1024, 2048, 3072, 4096),
          "32B": (5120, 8192, 25600, 10240)}
STAMP_OFFSET = 4096  # bytes into the workspace; 10 int64 stamps per CTA (decode_chain.cu)


def main(name: str = "8B") -> None:
    if not (torch.cuda.is_available() and int(os.environ.get("QWEN3_CHAIN_DEBUG", "0")) & 8):
        sys.exit("needs a GPU and QWEN3_CHAIN_DEBUG=8 (or 10, 12, 14) in the environment")
    h, q, i, n = SHAPES[name]
    dt = torch.bfloat16
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda") * scale).to(dt)  # noqa: E731
    args = [r(1, q), r(1, h), r(h, q, scale=q**-0.5), 1 + r(h, scale=0.1), r(2 * i, h, scale=h**-0.5),
            r(h, i, scale=i**-0.5), 1 + r(h, scale=0.1), r(n, h, scale=h**-0.5)]
    ws = qwen3_kernels.decode_chain_workspace(h, i, "cuda")
    out = torch.empty(1, n, dtype=dt, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for k in range(23):
        if k == 3:
            start.record()
        qwen3_kernels.decode_chain(*args, 1e-6, ws, out=out)
    end.record()
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    st = ws[STAMP_OFFSET:STAMP_OFFSET + 80 * sms].view(torch.int64).view(sms, 10).cpu().double()
    rel = (st[:, [8] + list(range(8)) + [9]] - st[:, 8].min()) / 1e3
    names = ["entry", "start", "s0 end", "s1 go", "s1 end", "s2 go", "s2 end", "s3 go", "s3 end",
             "exit"]
    print(f"Qwen3-{name} decode_chain, QWEN3_CHAIN_DEBUG={os.environ['QWEN3_CHAIN_DEBUG']}: "
          f"{start.elapsed_time(end) / 20 * 1e3:.1f} us a call")
    for c, label in enumerate(names):
        col = rel[:, c]
        print(f"  {label:7s} min {col.min():7.1f}  median {col.median():7.1f}  max {col.max():7.1f} us")


if __name__ == "__main__":
    main(*sys.argv[1:])

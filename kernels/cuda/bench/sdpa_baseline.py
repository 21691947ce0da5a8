# Baseline for kernels/cuda/bench/prefill_check.cu: torch's
# scaled_dot_product_attention (cuDNN and flash backends) on the same shapes
# (batch * seqlen = 16k, 16 heads, head_dim 128, bf16), median of 20 timed
# calls after 3 warm-ups, TFLOP/s with causal FLOPs = 4*B*H*S*S*D/2.
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def bench(backend, b, s, h, d, causal):
    q, k, v = (torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1) for _ in range(3))
    with sdpa_kernel([backend]):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
    ts.sort()
    ms = ts[len(ts) // 2]
    flops = 4.0 * b * h * s * s * d / (2.0 if causal else 1.0)
    return ms, flops / (ms * 1e-3) / 1e12


print("torch", torch.__version__, torch.cuda.get_device_name())
print(f"{'backend':8} {'seqlen':>7} {'batch':>6} {'causal':>6} {'ms':>9} {'TFLOP/s':>8}")
for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
    for s in (1024, 2048, 4096, 8192, 16384):
        for causal in (True, False):
            try:
                ms, tf = bench(be, 16384 // s, s, 16, 128, causal)
                print(f"{name:8} {s:7d} {16384 // s:6d} {int(causal):6d} {ms:9.3f} {tf:8.1f}")
            except Exception as e:  # a backend that refuses the shape
                print(f"{name:8} {s:7d} failed: {str(e)[:100]}")

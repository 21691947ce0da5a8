#!/usr/bin/env python3
"""PyTorch baselines for `tandem bench attention` (issue 19).

Reads the shapes as JSON (--shapes FILE, '-' or nothing for stdin):
  {"warmup": 3, "reps": 50, "max_case_seconds": 1.0,
   "prefill": [{"id", "batch", "heads", "kv_heads", "head_dim", "seqlen", "causal"}],
   "decode":  [{"id", "batch", "heads", "kv_heads", "head_dim", "context"}]}
and times torch.nn.functional.scaled_dot_product_attention on dense,
contiguous bf16 tensors [batch, heads, len, head_dim] of random data:
prefill with the cuDNN and the flash backend (torch.nn.attention.sdpa_kernel),
decode (one query, not causal: it sees the whole context) with torch's own
choice ("default") and with cuDNN and flash forced. Each case warms up, then
times every call with CUDA events and takes the median, rotating several input
sets where one would sit in L2. Prints one JSON object on stdout:
  {"available": true, "version", "cudnn_version", "device",
   "prefill": [{"id", "cudnn": {"ms", "reps", "sets"} | {"error"}, "flash": ...}],
   "decode":  [{"id", "default": ..., "cudnn": ..., "flash": ...}]}
or {"available": false, "why": "..."} where torch or a CUDA device is missing.
Progress goes to stderr.
"""
import argparse
import json
import math
import sys


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="-", help="JSON file of shapes ('-': stdin)")
    args = ap.parse_args()
    spec = json.load(sys.stdin if args.shapes == "-" else open(args.shapes))

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # no torch, or one too old for sdpa_kernel
        print(json.dumps({"available": False, "why": f"import torch failed: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"available": False, "why": "torch.cuda.is_available() is False"}))
        return 0

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    warmup = int(spec.get("warmup", 3))
    max_reps = int(spec.get("reps", 50))
    budget_ms = float(spec.get("max_case_seconds", 1.0)) * 1e3

    def sets_for(one_set_bytes):
        return max(1, min(8, math.ceil(4 * l2 / max(1, one_set_bytes))))

    def time_calls(fn, sets):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn(0)
        b.record()
        b.synchronize()
        first = a.elapsed_time(b)
        fit = int(budget_ms / max(first, 1e-3))
        w = max(min(1, warmup), min(warmup, fit // 4))
        reps = max(min(3, max_reps), min(max_reps, fit))
        for i in range(w):
            fn((i + 1) % sets)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for r in range(reps):
            ev[r][0].record()
            fn(r % sets)
            ev[r][1].record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in ev)
        n = len(ms)
        med = ms[n // 2] if n % 2 else 0.5 * (ms[n // 2 - 1] + ms[n // 2])
        return {"ms": med, "min_ms": ms[0], "reps": reps, "sets": sets}

    def run(backend, fn, sets):
        try:
            if backend is None:
                return time_calls(fn, sets)
            with sdpa_kernel(backend):
                return time_calls(fn, sets)
        except Exception as e:  # the backend does not take this shape
            torch.cuda.synchronize()
            return {"error": str(e).strip().split("\n")[0][:300]}

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    out = {
        "available": True,
        "version": torch.__version__,
        "cudnn_version": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(0),
        "prefill": [],
        "decode": [],
    }
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}

    for c in spec.get("prefill", []):
        B, H, KV, D, S = c["batch"], c["heads"], c["kv_heads"], c["head_dim"], c["seqlen"]
        causal = bool(c["causal"])
        one = 2 * (B * H * S * D + 2 * B * KV * S * D)
        sets = sets_for(one)
        qs = [randn(B, H, S, D) for _ in range(sets)]
        ks = [randn(B, KV, S, D) for _ in range(sets)]
        vs = [randn(B, KV, S, D) for _ in range(sets)]
        kw = {"enable_gqa": True} if KV != H else {}

        def fn(i):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=causal, **kw)

        row = {"id": c["id"]}
        for name, be in backends.items():
            row[name] = run(be, fn, sets)
        log(f"  torch prefill {'causal' if causal else 'full'} d={D} S={S}: "
            + ", ".join(f"{n} {row[n].get('ms', 'error')}" for n in backends))
        out["prefill"].append(row)
        del qs, ks, vs
        torch.cuda.empty_cache()

    for c in spec.get("decode", []):
        B, H, KV, D, T = c["batch"], c["heads"], c["kv_heads"], c["head_dim"], c["context"]
        one = 2 * (B * H * D + 2 * B * KV * T * D)
        sets = sets_for(one)
        row = {"id": c["id"]}
        try:
            qs = [randn(B, H, 1, D) for _ in range(sets)]
            ks = [randn(B, KV, T, D) for _ in range(sets)]
            vs = [randn(B, KV, T, D) for _ in range(sets)]
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e)[:200]}"
            out["decode"].append(row)
            torch.cuda.empty_cache()
            continue
        kw = {"enable_gqa": True} if KV != H else {}

        def fn(i):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=False, **kw)

        row["default"] = run(None, fn, sets)
        for name, be in backends.items():
            row[name] = run(be, fn, sets)
        log(f"  torch decode H={H} B={B} ctx={T}: "
            + ", ".join(f"{n} {row[n].get('ms', 'error')}" for n in ("default", *backends)))
        out["decode"].append(row)
        del qs, ks, vs
        torch.cuda.empty_cache()

    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""FlashAttention's error rule for tandem's CUDA paged attention, faithfully.

For each case: a float64 reference computed by torch on the GPU from the same
bf16 (f16) inputs; torch's own scaled_dot_product_attention in bf16 (f16)
against that reference (the baseline); our kernel (through the C ABI of
kernels/cuda/capi.cc, loaded with ctypes) against it. A case passes iff

    max|ours - ref| <= 2 * max|torch_sdpa - ref| + floor

where floor is FlashAttention's round-off allowance, 2 * max|(ref + 0.3) - 0.3
- ref| with ref + 0.3 rounded to the element type. Prints a table; exits 1 on
any failure (or if no usable GPU).

Usage: check_attention.py --lib path/to/libtandem_kernels_capi.so
"""
import argparse
import ctypes
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

DTYPES = {"bf16": (torch.bfloat16, 1), "f16": (torch.float16, 2)}


def load(path):
    lib = ctypes.CDLL(path)
    P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.tandem_cuda_available.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
    lib.tandem_cuda_available.restype = I
    lib.tandem_workspace_bytes.argtypes = [I, I, I]
    lib.tandem_workspace_bytes.restype = I64
    lib.tandem_take_error.argtypes = [P, P]
    lib.tandem_take_error.restype = ctypes.c_char_p
    lib.tandem_paged_attention.argtypes = [
        I, I, I, I, I, I64, I,  # dtype, layers, kv heads, head_dim, block, num_blocks, layer
        P, I64, P, P,  # q, q_stride_bytes, out, kv_cache
        I, ctypes.c_float, I, I,  # num_heads, scale, causal, num_seqs
        P, P, P, I,  # query_start, context_lens, block_tables, max_blocks_per_seq
        P, P,  # host_query_start, host_context_lens
        P, I64, P]  # workspace, workspace_bytes, stream
    lib.tandem_paged_attention.restype = ctypes.c_char_p
    return lib


def build_pool(seqs, ks, vs, kvh, hd, bs, dtype, gen):
    """Writes each sequence's K/V into a NaN-filled paged pool of 2 layers
    (layer 1 used) through block tables in random order."""
    nblk = [(c + bs - 1) // bs for _, c in seqs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(nblk) + 1
    tables = torch.full((len(seqs), max_blocks), num_blocks + 1000, dtype=torch.int32)
    pool = torch.full((num_blocks, 2, 2, kvh, bs, hd), float("nan"), dtype=dtype, device="cuda")
    view = pool.permute(0, 1, 2, 4, 3, 5)  # [block, layer, K|V, slot, head, dim]
    nxt = 0
    for s, (_, c) in enumerate(seqs):
        ids = perm[nxt:nxt + nblk[s]]
        nxt += nblk[s]
        tables[s, :nblk[s]] = ids.to(torch.int32)
        t = torch.arange(c)
        b = ids[t // bs].cuda()
        slot = (t % bs).cuda()
        view[b, 1, 0, slot] = ks[s]
        view[b, 1, 1, slot] = vs[s]
    return pool, tables.cuda(), num_blocks, max_blocks


def reference(q, ks, vs, seqs, qs, group, causal, scale):
    """float64 attention on the GPU, queries in chunks (bounded memory)."""
    out = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    for s, (ql, c) in enumerate(seqs):
        if ql == 0:
            continue
        k = ks[s].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, c, hd]
        v = vs[s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        for a in range(0, ql, 256):
            b = min(ql, a + 256)
            qq = q[qs[s] + a:qs[s] + b].double().transpose(0, 1)  # [H, n, hd]
            sc = (qq @ k.transpose(1, 2)) * scale
            if causal:
                pos = c - ql + torch.arange(a, b, device="cuda")
                mask = torch.arange(c, device="cuda")[None, :] > pos[:, None]
                sc = sc.masked_fill(mask[None], float("-inf"))
            out[qs[s] + a:qs[s] + b] = (torch.softmax(sc, dim=-1) @ v).transpose(0, 1)
    return out


def torch_sdpa(q, ks, vs, seqs, qs, group, causal, scale):
    """torch's own low-precision attention; the causal mask aligned to the
    end of the context (chunked prefill over a prefix)."""
    out = torch.empty_like(q)
    for s, (ql, c) in enumerate(seqs):
        if ql == 0:
            continue
        qq = q[qs[s]:qs[s] + ql].transpose(0, 1)[None]  # [1, H, ql, hd]
        k = ks[s].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        v = vs[s].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        if not causal:
            o = F.scaled_dot_product_attention(qq, k, v, scale=scale)
        elif ql == c:
            o = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=causal_lower_right(ql, c), scale=scale)
        out[qs[s]:qs[s] + ql] = o[0].transpose(0, 1)
    return out


def run_case(lib, name, seqs, kvh, group, hd, bs, causal=True, dt="bf16", seed=0):
    dtype, code = DTYPES[dt]
    gen = torch.Generator().manual_seed(seed)
    H = kvh * group
    qs = [0]
    for ql, _ in seqs:
        qs.append(qs[-1] + ql)
    T = qs[-1]
    q = torch.randn(T, H, hd, generator=gen).to(dtype).cuda()
    ks = [torch.randn(c, kvh, hd, generator=gen).to(dtype).cuda() for _, c in seqs]
    vs = [torch.randn(c, kvh, hd, generator=gen).to(dtype).cuda() for _, c in seqs]
    pool, tables, num_blocks, max_blocks = build_pool(seqs, ks, vs, kvh, hd, bs, dtype, gen)
    scale = 1.0 / math.sqrt(hd)

    host_qs = (ctypes.c_int * len(qs))(*qs)
    host_ctx = (ctypes.c_int * len(seqs))(*[c for _, c in seqs])
    qs_dev = torch.tensor(qs, dtype=torch.int32, device="cuda")
    ctx_dev = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
    ws_bytes = lib.tandem_workspace_bytes(T, H, hd)
    ws = torch.zeros(ws_bytes, dtype=torch.uint8, device="cuda")
    out = torch.full((T, H, hd), float("nan"), dtype=dtype, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    err = lib.tandem_paged_attention(code, 2, kvh, hd, bs, num_blocks, 1, q.data_ptr(), H * hd * 2,
                                     out.data_ptr(), pool.data_ptr(), H, scale, int(causal), len(seqs),
                                     qs_dev.data_ptr(), ctx_dev.data_ptr(), tables.data_ptr(), max_blocks,
                                     ctypes.cast(host_qs, ctypes.c_void_p),
                                     ctypes.cast(host_ctx, ctypes.c_void_p), ws.data_ptr(), ws_bytes,
                                     stream)
    if err is None:
        err = lib.tandem_take_error(ws.data_ptr(), stream)
    torch.cuda.synchronize()

    ref = reference(q, ks, vs, seqs, qs, group, causal, scale)
    base = torch_sdpa(q, ks, vs, seqs, qs, group, causal, scale)
    ours_err = (out.double() - ref).abs().max().item() if T else 0.0
    nonfinite = int((~torch.isfinite(out)).sum().item())
    torch_err = (base.double() - ref).abs().max().item() if T else 0.0
    floor = 2 * ((ref + 0.3).to(dtype).double() - 0.3 - ref).abs().max().item() if T else 0.0
    ok = err is None and nonfinite == 0 and ours_err <= 2 * torch_err + floor
    desc = " ".join(f"{ql}/{c}" for ql, c in seqs)
    if len(desc) > 40:
        desc = desc[:37] + "..."
    print(f"{'PASS' if ok else 'FAIL'} {name:<22} {dt:<4} hd={hd:<3} bs={bs:<2} kvh={kvh} g={group} "
          f"{'causal' if causal else 'full  '} ours={ours_err:.2e} torch={torch_err:.2e} floor={floor:.1e} "
          f"ratio={ours_err / max(torch_err, 1e-12):5.2f}  [{desc}]"
          + (f"  error: {err.decode()}" if err else "") + (f"  {nonfinite} non-finite" if nonfinite else ""),
          flush=True)
    return ok


def mixed(bs):
    return [(1, 1), (bs - 1, bs - 1), (1, bs), (3, bs + 1), (37, 300), (1, 1000), (0, 50), (bs + 1, bs + 1),
            (5, 1030), (1, bs - 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    args = ap.parse_args()
    lib = load(args.lib)
    why = ctypes.c_char_p()
    if not lib.tandem_cuda_available(ctypes.byref(why)):
        print(f"no usable GPU: {why.value.decode()}")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    seed = 1
    for bs in (16, 32, 64):
        for group in (1, 4, 8, 5):
            for hd in (64, 128):
                results.append(run_case(lib, "mixed", mixed(bs), 2, group, hd, bs, seed=seed))
                seed += 1
    for hd in (80, 96):
        results.append(run_case(lib, "mixed-fallback-dim", mixed(16), 2, 4, hd, 16, seed=seed))
        seed += 1
    for bs in (16, 64):
        results.append(run_case(lib, "mixed", mixed(bs), 2, 4, 128, bs, dt="f16", seed=seed))
        results.append(run_case(lib, "mixed", mixed(bs), 2, 3, 64, bs, dt="f16", seed=seed + 1))
        results.append(run_case(lib, "mixed", mixed(bs), 2, 4, 128, bs, causal=False, seed=seed + 2))
        seed += 3
    # Long contexts, Llama-3-8B head counts (32 query heads, 8 kv heads).
    for bs in (16, 64):
        results.append(run_case(lib, "decode-long", [(1, 1024), (1, 8192), (1, 32768), (1, 8191)], 8, 4, 128,
                                bs, seed=seed))
        results.append(run_case(lib, "chunk-over-8k", [(128, 8192), (1, 4000), (512, 1536)], 8, 4, 128, bs,
                                seed=seed + 1))
        results.append(run_case(lib, "prefill-2k", [(2048, 2048), (300, 300)], 8, 4, 128, bs, seed=seed + 2))
        results.append(run_case(lib, "prefill-2k-full", [(2048, 2048)], 8, 4, 128, bs, causal=False,
                                seed=seed + 3))
        seed += 4
    results.append(run_case(lib, "decode-long-hd64", [(1, 32768), (4, 8192)], 4, 8, 64, 32, seed=seed))
    results.append(run_case(lib, "decode-long-f16", [(1, 32768), (4, 8192)], 8, 4, 128, 16, dt="f16",
                            seed=seed + 1))
    failed = results.count(False)
    print(f"{len(results) - failed}/{len(results)} cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

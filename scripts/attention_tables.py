#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from `tandem bench attention --json` output.

Usage: scripts/attention_tables.py ATTN.json [--section prefill|decode|all]
"""
import argparse
import json


def prefill_table(d):
    rows = ["| mask | head dim | heads | S x B | ours ms | ours TFLOP/s | cuDNN | flash | ours / best torch |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in d["prefill"]:
        t = c.get("torch", {})
        cudnn = t.get("cudnn", {}).get("tflops")
        flash = t.get("flash", {}).get("tflops")
        ratio = c.get("ratio_to_best_torch")
        rows.append("| {} | {} | {} | {} x {} | {:.3f} | {:.1f} | {} | {} | {} |".format(
            "causal" if c["causal"] else "full", c["head_dim"], c["heads"], c["seqlen"], c["batch"],
            c["ours"]["ms"], c["ours"]["tflops"], f"{cudnn:.1f}" if cudnn else "-",
            f"{flash:.1f}" if flash else "-", f"**{ratio:.2f}**" if ratio else "-"))
    return "\n".join(rows)


def decode_table(d):
    rows = ["| model heads | batch | context | page | KV MiB | ours us | ours GB/s | / copy | torch us | ours vs torch (time ratio) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in d["decode"]:
        ours = c.get("ours", {})
        if not ours.get("us"):
            continue
        best = c.get("torch_best_backend")
        torch_us = c["torch"][best]["ms"] * 1000 if best else None
        rows.append("| {} | {} | {} | {} | {:.1f} | {:.1f} | {:.0f} | {:.2f} | {} | {} |".format(
            c["model"], c["batch"], c["context"], c["page_size"], c["kv_bytes"] / 2**20, ours["us"], ours["gbps"],
            c["ratio_to_copy"], f"{torch_us:.1f}" if torch_us else "-",
            f"{c['ratio_to_torch']:.2f}" if c.get("ratio_to_torch") else "-"))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--section", choices=["prefill", "decode", "all"], default="all")
    a = ap.parse_args()
    d = json.load(open(a.json))
    dev = d.get("device", {})
    print(f"<!-- {dev.get('name')}, command: {d.get('command')} -->")
    if a.section in ("prefill", "all") and d.get("prefill"):
        print(prefill_table(d))
        print()
    if a.section in ("decode", "all") and d.get("decode"):
        print(f"device-to-device copy: {d['copy']['gbps_read_plus_write']:.0f} GB/s (read + written)")
        print(decode_table(d))


if __name__ == "__main__":
    main()

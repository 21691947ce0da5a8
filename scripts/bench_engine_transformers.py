#!/usr/bin/python3
"""Hugging Face transformers baselines for `tandem bench engine --device cuda`.

Loads the checkpoint in bfloat16 on the GPU (sdpa attention) and times, with
CUDA events (median of --repeats after a warm-up):
  - prefill of one prompt of each length in --prefill-lens (a forward with
    logits for the last position only);
  - one decode step (a forward of one token per sequence over a cache of the
    context) for each BATCHxCONTEXT in --decode.
Random token ids, never special ones. Prints JSON:
  {"available": true, "transformers": "5.x", "prefill_ms": {"512": ...},
   "decode_step_ms": {"8x128": ...}}
with null where a case ran out of memory, or {"available": false, "why": ...}
without torch, transformers or a GPU.
"""

import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prefill-lens", default="512,2048,8192")
    p.add_argument("--decode", default="1x128,8x128,64x128,256x128,1x2048,64x2048")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, DynamicCache
    except ImportError as e:
        print(json.dumps({"available": False, "why": f"{e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"available": False, "why": "no CUDA device"}))
        return 0
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()
    vocab = min(model.config.vocab_size, 256)
    g = torch.Generator(device="cuda").manual_seed(0)

    def timed(fn):
        times = []
        for i in range(a.repeats + 1):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            if i > 0:
                times.append(start.elapsed_time(stop))
        times.sort()
        return times[len(times) // 2]

    out = {"available": True, "transformers": transformers.__version__, "prefill_ms": {}, "decode_step_ms": {}}
    with torch.no_grad():
        for n in [int(x) for x in a.prefill_lens.split(",") if x]:
            ids = torch.randint(0, vocab, (1, n), device="cuda", generator=g)
            try:
                out["prefill_ms"][str(n)] = timed(lambda: model(ids, logits_to_keep=1))
            except torch.cuda.OutOfMemoryError:
                out["prefill_ms"][str(n)] = None
            torch.cuda.empty_cache()
        for case in [c for c in a.decode.split(",") if c]:
            batch, context = (int(x) for x in case.split("x"))
            try:
                ids = torch.randint(0, vocab, (batch, context), device="cuda", generator=g)
                cache = DynamicCache()
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                step = torch.randint(0, vocab, (batch, 1), device="cuda", generator=g)

                def decode():
                    model(step, past_key_values=cache, use_cache=True)
                    cache.crop(context)  # the next repeat decodes at the same context

                out["decode_step_ms"][case] = timed(decode)
                del cache
            except torch.cuda.OutOfMemoryError:
                out["decode_step_ms"][case] = None
            torch.cuda.empty_cache()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

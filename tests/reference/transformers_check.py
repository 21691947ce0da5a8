#!/usr/bin/python3
"""Checks tandem against Hugging Face transformers itself.

Reads the checkpoints and tandem's logits that check_logits.py leaves in its
workdir (<case>_<name>/ and <case>_logits.json), loads each checkpoint with
transformers' AutoModelForCausalLM, runs it in float64 (eager attention), and
requires max|tandem - hf| <= 1e-4 * max|hf| on every position. Also loads the
exported tokenizer and chat template with AutoTokenizer.

transformers is not a Debian package, so this exits 77 (ctest: skipped) where
it cannot be imported, as on CI. Run where it is installed:
  python3 transformers_check.py --workdir build/tests/reference/work
"""

import argparse
import glob
import json
import os
import sys

REL_TOL = 1e-4
SKIP = 77


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    try:
        import numpy as np
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        print(f"skipped: {e} (transformers and torch are not installed here)")
        return SKIP
    print("transformers", transformers.__version__, "torch", torch.__version__)

    ok = True
    cases = 0
    for logits_file in sorted(glob.glob(os.path.join(args.workdir, "?_logits.json"))):
        key = os.path.basename(logits_file)[0]
        dirs = [d for d in glob.glob(os.path.join(args.workdir, f"{key}_*")) if os.path.isdir(d)]
        if len(dirs) != 1:
            continue
        model = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32,
                                                     attn_implementation="eager")
        model = model.to(torch.float64).eval()
        worst = 0.0
        for seq in json.load(open(logits_file))["sequences"]:
            with torch.no_grad():
                hf = model(torch.tensor([seq["tokens"]])).logits[0].numpy()
            got = np.array(seq["logits"], dtype=np.float64)
            worst = max(worst, float((np.abs(got - hf).max(axis=1) / np.abs(hf).max(axis=1)).max()))
        passed = worst <= REL_TOL
        ok &= passed
        cases += 1
        print(f"{key} {os.path.basename(dirs[0]):28s} {type(model).__name__:20s} "
              f"worst rel err {worst:.3e} {'OK' if passed else 'FAIL'}")
    if cases == 0:
        print(f"no checkpoints with logits in {args.workdir}: run check_logits.py first")
        return 1

    exported = os.path.join(args.workdir, "a_tiny_f32")
    tok = AutoTokenizer.from_pretrained(exported)
    text = "Hello, tandem! ünïcödé ✓ 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    bytes_ok = ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    template_ok = rendered.startswith("<|begin_of_text|><|start_header_id|>system")
    print("tokenizer: byte ids and round trip", "OK" if bytes_ok else "FAIL")
    print("chat template:", repr(rendered), "OK" if template_ok else "FAIL")
    return 0 if ok and bytes_ok and template_ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Checks tandem's Llama-family forward pass against llama_reference.py.

Drives tandem only through its CLI:
  TANDEM export-model --preset tiny OUTDIR [--dtype D] [--max-shard-bytes N]
  TANDEM logits --model DIR --tokens 1,2,3 [--tokens ...] --output FILE.json
and compares the full-vocabulary logits of every position with the float64
reference. A row passes when max|tandem - ref| <= 1e-4 * max|ref|.

Then checks that tandem rejects broken checkpoints (unknown architecture,
missing tensor, wrong shape, truncated file) with a nonzero exit and a stderr
message naming the culprit.

Exit status 0 when everything passes; 1 with a report otherwise.
Usage: check_logits.py --tandem build/tandem --workdir /tmp/refcheck [--only a,c]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference as ref  # noqa: E402

# Row tolerance, relative to the row's largest |logit|. tandem computes in
# float32 from the same (possibly bf16/f16) weights; float32 accumulation over
# a few tiny layers stays near 1e-6, so 1e-4 leaves margin while any
# convention error (RoPE pairing, mask, GQA grouping, bias) is O(1).
REL_TOL = 1e-4
SEQ_LENGTHS = (1, 7, 40, 100)
COMMAND_TIMEOUT_S = 120


def token_sequences(vocab_size, max_positions, seed):
    """Fixed sequences of lengths 1, 7, 40 and 100 (capped at max_positions),
    ids drawn from a fixed-seed generator over the whole vocabulary."""
    rng = np.random.default_rng(seed)
    seqs = []
    for n in SEQ_LENGTHS:
        n = min(n, max_positions) if max_positions else n
        seqs.append([int(t) for t in rng.integers(0, vocab_size, size=n)])
    # Make sure the extreme ids are exercised.
    seqs[-1][0], seqs[-1][-1] = 0, vocab_size - 1
    return seqs


def run(cmd):
    """Runs cmd; returns CompletedProcess with text stdout/stderr."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, e.stdout or "", f"timed out after {COMMAND_TIMEOUT_S}s")
    except OSError as e:  # e.g. the binary is being relinked
        return subprocess.CompletedProcess(cmd, 127, "", f"cannot run {cmd[0]}: {e}")


def describe_failure(proc):
    return (f"command: {' '.join(proc.args)}\n  exit status {proc.returncode}\n"
            f"  stderr: {proc.stderr.strip()[-2000:]}")


# ---------------------------------------------------------------------------
# Checkpoints written by this script (variants tandem cannot export)
# ---------------------------------------------------------------------------

def qwen2_config():
    # (c) transformers-5 style: rope_parameters holds rope_theta; "dtype" not
    # "torch_dtype"; eos as a list; tied embeddings; GQA 8:2 = 4:1.
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 2, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": [1, 2], "dtype": "float16",
    }


def llama_bias_config():
    # (d) attention_bias + mlp_bias, legacy rope_scaling {"type": "linear"},
    # head_dim 16 != hidden 48 / heads 4.
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 320, "hidden_size": 48, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "rope_theta": 10000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def mistral_config():
    # (e) no biases, rope_theta only, sliding_window null. rms_norm_eps is
    # unusually large so that a wrong or ignored eps shows (with eps 1e-5 and
    # O(1) activations its effect is ~1e-5, below the tolerance).
    return {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 0.05, "hidden_act": "silu",
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def llama3_rope_config():
    # (f) Llama 3.1 rope scaling given as transformers-5 rope_parameters; with
    # head_dim 16, theta 10000 and original context 32 the 8 frequencies span
    # all three bands (unchanged, blended, divided by factor).
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32},
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def write_random_checkpoint(model_dir, config_dict, dtype, seed, edit=None):
    """Random weights for config_dict in `dtype`; `edit(tensors)` may break them."""
    cfg = ref.parse_config(config_dict)
    tensors = ref.random_tensors(cfg, seed)
    if edit:
        edit(tensors)
    shutil.rmtree(model_dir, ignore_errors=True)
    ref.write_checkpoint(model_dir, config_dict, tensors, dtype)


# ---------------------------------------------------------------------------
# Logit comparison
# ---------------------------------------------------------------------------

class Report:
    def __init__(self):
        self.failures = []
        self.results = []  # (case, worst relative error or None, note)

    def fail(self, case, message):
        self.failures.append(f"[{case}] {message}")
        print(f"FAIL [{case}] {message}")


def logits_variants(tandem):
    """How to run `tandem logits`: one whole-sequence prefill always; when the
    binary offers --chunk/--block-size (not part of the required CLI), also
    chunked prefill over small KV blocks and token-by-token decode, which take
    other attention code paths."""
    variants = [("prefill", [])]
    help_text = run([tandem, "logits", "--help"])
    text = help_text.stdout + help_text.stderr
    if "--chunk" in text and "--block-size" in text:
        variants += [("chunk13_block5", ["--chunk", "13", "--block-size", "5"]),
                     ("decode", ["--chunk", "1"])]
    return variants


def compare_case(tandem, case, model_dir, workdir, report, seed, variants):
    """Runs tandem logits on model_dir (once per variant) and compares with the reference."""
    try:
        model = ref.ReferenceModel.load(model_dir)
    except (ref.CheckpointError, OSError, KeyError, ValueError) as e:
        report.fail(case, f"reference cannot read {model_dir}: {e}")
        report.results.append((case, None, "reference could not load"))
        return
    with open(os.path.join(model_dir, "config.json")) as f:
        max_pos = json.load(f).get("max_position_embeddings")
    seqs = token_sequences(model.cfg.vocab_size, max_pos, seed)
    want_all = [model.forward(s) for s in seqs]
    for variant, extra in variants:
        name = case if variant == "prefill" else f"{case}/{variant}"
        compare_variant(tandem, name, model_dir, workdir, report, model.cfg.vocab_size, seqs,
                        want_all, extra)


def compare_variant(tandem, case, model_dir, workdir, report, vocab, seqs, want_all, extra):
    out_path = os.path.join(workdir, case.replace("/", "_") + "_logits.json")
    cmd = [tandem, "logits", "--model", model_dir]
    for s in seqs:
        cmd += ["--tokens", ",".join(map(str, s))]
    cmd += ["--output", out_path] + extra
    proc = run(cmd)
    if proc.returncode != 0:
        report.fail(case, "tandem logits failed\n  " + describe_failure(proc))
        report.results.append((case, None, "tandem logits failed"))
        return
    with open(out_path) as f:
        out = json.load(f)
    if out.get("vocab_size") != vocab:
        report.fail(case, f"vocab_size {out.get('vocab_size')} in output, config says {vocab}")
    sequences = out.get("sequences", [])
    if len(sequences) != len(seqs):
        report.fail(case, f"{len(sequences)} sequences in output, {len(seqs)} requested")
        report.results.append((case, None, "bad output"))
        return

    worst = (-1.0, None)  # (relative error, description)
    case_ok = True
    for si, (seq, got_seq, want) in enumerate(zip(seqs, sequences, want_all)):
        if got_seq.get("tokens") != seq:
            report.fail(case, f"sequence {si}: output tokens differ from the request")
            case_ok = False
            continue
        got = np.asarray(got_seq.get("logits"), dtype=np.float64)
        if got.shape != (len(seq), vocab):
            report.fail(case, f"sequence {si}: logits shape {list(got.shape)}, "
                              f"expected [{len(seq)}, {vocab}]")
            case_ok = False
            continue
        if not np.isfinite(got).all():
            bad = np.argwhere(~np.isfinite(got))[0]
            report.fail(case, f"sequence {si} (length {len(seq)}): non-finite logit at "
                              f"position {bad[0]}, token id {bad[1]}")
            case_ok = False
            continue
        abs_err = np.abs(got - want).max(axis=1)            # per position
        scale = np.abs(want).max(axis=1)
        rel_err = abs_err / scale
        t = int(np.argmax(rel_err))
        if rel_err[t] > worst[0]:
            worst = (float(rel_err[t]),
                     f"sequence {si} (length {len(seq)}) position {t}: "
                     f"max abs err {abs_err[t]:.3e}, row max |ref| {scale[t]:.3e}")
        failing = np.nonzero(rel_err > REL_TOL)[0]
        if len(failing):
            case_ok = False
            first = int(failing[0])
            report.fail(case, f"sequence {si} (length {len(seq)}): {len(failing)}/{len(seq)} "
                              f"positions exceed {REL_TOL:g}; first at position {first} "
                              f"(rel err {rel_err[first]:.3e}), worst at {t} "
                              f"(rel err {rel_err[t]:.3e}); position 0 rel err "
                              f"{rel_err[0]:.3e}\n    {diagnose(got, want)}")
    note = worst[1] or ""
    report.results.append((case, worst[0] if worst[0] >= 0 else None, note))
    status = "ok  " if case_ok else "FAIL"
    print(f"{status} [{case}] worst relative error {worst[0]:.3e} ({note})")


def diagnose(got, want):
    """A hint for a failing comparison: is tandem off by a constant shift, by a
    scale, or unrelated?"""
    diff = got - want
    row_shift = diff.mean(axis=1, keepdims=True)
    if np.abs(diff - row_shift).max() <= REL_TOL * np.abs(want).max():
        return "difference is a per-row constant shift (softmax-invariant)"
    corr = np.corrcoef(got.ravel(), want.ravel())[0, 1]
    ratio = np.linalg.norm(got) / np.linalg.norm(want)
    return f"correlation tandem/ref {corr:.4f}, norm ratio {ratio:.4f}"


def check_bf16_export(f32_dir, bf16_dir, report):
    """The bfloat16 export must hold the float32 export's weights rounded to
    nearest even (as torch's .to(torch.bfloat16)), not truncated."""
    try:
        f32 = ref.read_checkpoint_tensors(f32_dir)
        bf16 = ref.read_checkpoint_tensors(bf16_dir)
    except (ref.CheckpointError, OSError, KeyError) as e:
        report.fail("b/rounding", f"cannot read the exports: {e}")
        return
    if set(f32) != set(bf16):
        report.fail("b/rounding", f"float32 and bfloat16 exports hold different tensors: "
                                  f"{sorted(set(f32) ^ set(bf16))[:5]}")
        return
    for name in sorted(f32):
        expected = ref.round_to_bf16(f32[name])
        if not np.array_equal(expected, bf16[name]):
            bad = int(np.argmax((expected != bf16[name]).ravel()))
            report.fail("b/rounding", f"tensor {name}: element {bad} is "
                                      f"{bf16[name].ravel()[bad]!r}, float32 export "
                                      f"{f32[name].ravel()[bad]!r} rounds to "
                                      f"{expected.ravel()[bad]!r}")
            return
    print(f"ok   [b/rounding] bfloat16 export == RNE(float32 export) for all {len(f32)} tensors")


# ---------------------------------------------------------------------------
# Rejection of broken checkpoints
# ---------------------------------------------------------------------------

def check_rejected(tandem, case, model_dir, must_name, report):
    """tandem must exit nonzero (not crash) and name `must_name` on stderr."""
    proc = run([tandem, "logits", "--model", model_dir, "--tokens", "1", "--output", os.devnull])
    first_line = (proc.stderr.strip().splitlines() or [""])[-1][:300]
    if proc.returncode == 0:
        report.fail(case, f"tandem accepted a broken checkpoint ({model_dir})")
    elif proc.returncode < 0:
        report.fail(case, f"tandem died from signal {-proc.returncode} instead of an error\n  "
                    + describe_failure(proc))
    elif must_name not in proc.stderr:
        report.fail(case, f"stderr does not name {must_name!r}\n  " + describe_failure(proc))
    else:
        print(f"ok   [{case}] rejected, exit {proc.returncode}: {first_line}")
        report.results.append((case, None, "rejected as expected"))
        return
    report.results.append((case, None, "NOT rejected properly"))


def rejection_cases(tandem, workdir, report):
    base = llama_bias_config()

    d = os.path.join(workdir, "bad_arch")
    cfg = dict(base, architectures=["FrobnicatorForCausalLM"])
    shutil.rmtree(d, ignore_errors=True)
    # The reference itself refuses this config, so write weights for `base`.
    ref.write_checkpoint(d, cfg, ref.random_tensors(ref.parse_config(base), 11), "F32")
    check_rejected(tandem, "bad_arch", d, "FrobnicatorForCausalLM", report)

    missing = "model.layers.1.mlp.down_proj.weight"
    d = os.path.join(workdir, "bad_missing_tensor")
    write_random_checkpoint(d, base, "F32", 12, edit=lambda t: t.pop(missing))
    check_rejected(tandem, "bad_missing_tensor", d, missing, report)

    wrong = "model.layers.0.self_attn.k_proj.weight"
    d = os.path.join(workdir, "bad_shape")

    def transpose_k(t):
        t[wrong] = t[wrong].T.copy()  # [48, 32] instead of [32, 48]
    write_random_checkpoint(d, base, "F32", 13, edit=transpose_k)
    check_rejected(tandem, "bad_shape", d, wrong, report)

    d = os.path.join(workdir, "bad_truncated")
    write_random_checkpoint(d, base, "F32", 14)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    check_rejected(tandem, "bad_truncated", d, "model.safetensors", report)


# ---------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tandem", required=True, help="path to the tandem binary")
    parser.add_argument("--workdir", required=True, help="scratch directory (recreated)")
    parser.add_argument("--only", default="", help="comma-separated case letters, e.g. a,c,bad")
    args = parser.parse_args()
    tandem = os.path.abspath(args.tandem)
    workdir = os.path.abspath(args.workdir)
    only = set(filter(None, args.only.split(",")))
    wanted = lambda c: not only or c in only  # noqa: E731

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    report = Report()
    if not os.access(tandem, os.X_OK):
        print(f"FAIL tandem binary not found or not executable: {tandem}")
        return 1

    variants = logits_variants(tandem)
    print("logits variants: " + ", ".join(v for v, _ in variants))

    def export(case, name, extra):
        d = os.path.join(workdir, name)
        proc = run([tandem, "export-model", "--preset", "tiny", d] + extra)
        if proc.returncode != 0:
            report.fail(case, "export-model failed\n  " + describe_failure(proc))
            report.results.append((case, None, "export failed"))
            return None
        return d

    if wanted("a"):
        d = export("a", "a_tiny_f32", ["--dtype", "float32"])
        if d:
            compare_case(tandem, "a", d, workdir, report, variants=variants, seed=101)
    if wanted("b"):
        d = export("b", "b_tiny_bf16_sharded", ["--dtype", "bfloat16", "--max-shard-bytes", "20000"])
        if d:
            index = os.path.join(d, "model.safetensors.index.json")
            shards = [f for f in os.listdir(d) if f.endswith(".safetensors")]
            if not os.path.exists(index) or len(shards) < 2:
                report.fail("b", f"--max-shard-bytes 20000 gave {len(shards)} shard(s), "
                                 f"index present: {os.path.exists(index)}")
            else:
                print(f"     [b] {len(shards)} shards")
            compare_case(tandem, "b", d, workdir, report, variants=variants, seed=102)
            a_dir = os.path.join(workdir, "a_tiny_f32")
            if os.path.isdir(a_dir):
                check_bf16_export(a_dir, d, report)
    if wanted("c"):
        d = os.path.join(workdir, "c_qwen2_f16_tied")
        write_random_checkpoint(d, qwen2_config(), "F16", seed=3)
        compare_case(tandem, "c", d, workdir, report, variants=variants, seed=103)
    if wanted("d"):
        d = os.path.join(workdir, "d_llama_bias_linear_rope")
        write_random_checkpoint(d, llama_bias_config(), "F32", seed=4)
        compare_case(tandem, "d", d, workdir, report, variants=variants, seed=104)
    if wanted("e"):
        d = os.path.join(workdir, "e_mistral")
        write_random_checkpoint(d, mistral_config(), "F32", seed=5)
        compare_case(tandem, "e", d, workdir, report, variants=variants, seed=105)
    if wanted("f"):
        d = os.path.join(workdir, "f_llama3_rope_bf16")
        write_random_checkpoint(d, llama3_rope_config(), "BF16", seed=6)
        compare_case(tandem, "f", d, workdir, report, variants=variants, seed=106)
    if wanted("bad"):
        rejection_cases(tandem, workdir, report)

    print("\nsummary (worst per-row max|tandem-ref| / max|ref|, tolerance %g):" % REL_TOL)
    for case, err, note in report.results:
        err_s = f"{err:.3e}" if err is not None else "-"
        print(f"  {case:24s} {err_s:>10s}  {note}")
    if report.failures:
        print(f"\n{len(report.failures)} failure(s):")
        for f in report.failures:
            print("  " + f)
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

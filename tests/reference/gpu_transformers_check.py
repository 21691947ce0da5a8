#!/usr/bin/python3
"""Checks tandem's GPU engine against Hugging Face transformers on the same GPU.

For each model family the GPU engine must serve (Llama 3 with llama3 RoPE and
tied embeddings, Qwen2 with QKV biases, Mistral-style GQA at head_dim 128),
transformers makes a randomly initialised checkpoint and writes it in
bfloat16 (the LM head scaled so logits spread like a trained model's, about
3 nats, rather than a near-uniform 0.6). Then, teacher-forced over
sequences of 300 random tokens:
  - transformers runs it in bfloat16 on the GPU (sdpa attention);
  - `tandem logits --device cuda` runs the same checkpoint;
  - `tandem logits --device cpu` runs it in float32 (the reference engine).
The CPU engine in float32 is the reference (reference_test checks it
against float64 numpy and transformers in float64 to 1e-4). Required: the
GPU engine is at least as close to it as transformers in bfloat16 is (max
|logprob difference| over the reference's 20 most likely tokens at every
position, and the share of positions whose top token agrees, within 0.01),
and agrees with transformers on the top token at >= 95% of positions.
Printed beside: the GPU engine against transformers directly, the issue's
first bar (top-1 >= 99%, max |difference| <= 0.05), which two bfloat16
engines that round differently do not meet on random-weight models: on an
H200 (2026-11-27) transformers itself was 0.14-0.21 from the reference
where tandem was 0.08-0.14.

Exits 77 (ctest: skipped) without torch, transformers or a CUDA device, as on
CI. On the GPU machine:
  python3 gpu_transformers_check.py --tandem PATH/tandem --workdir /tmp/gtc
"""

import argparse
import os
import subprocess
import sys

SKIP = 77
TOP1_MIN = 0.99  # the first bar, reported
LOGPROB_TOL = 0.05
HF_TOP1_MIN = 0.95
POSITIONS = 300


def variants(transformers):
    common = dict(vocab_size=32000, num_hidden_layers=4, max_position_embeddings=4096, rms_norm_eps=1e-5)
    llama = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024},
        **common)
    qwen = transformers.Qwen2Config(
        hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=2,
        rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False, **common)
    mistral = transformers.MistralConfig(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8,
        rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False, **common)
    return [("llama3-tied", llama), ("qwen2-bias", qwen), ("mistral-gqa", mistral)]


def log_softmax(np, x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def tandem_logits(np, tandem, model_dir, device, tokens, out, vocab):
    cmd = [tandem, "logits", "--model", model_dir, "--device", device, "--format", "f32", "--output", out,
           "--tokens", ",".join(str(t) for t in tokens)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed: {r.stderr[-2000:]}")
    return np.fromfile(out, dtype=np.float32).reshape(len(tokens), vocab).astype(np.float64)


def compare(np, ref_lp, got_lp, k=20):
    """Top-1 agreement, and max |diff| over ref's k most likely tokens."""
    top = np.argsort(-ref_lp, axis=1)[:, :k]
    rows = np.arange(ref_lp.shape[0])[:, None]
    diff = np.abs(ref_lp[rows, top] - got_lp[rows, top]).max()
    agree = float((ref_lp.argmax(axis=1) == got_lp.argmax(axis=1)).mean())
    return agree, float(diff)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tandem", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    try:
        import numpy as np
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"skipped: {e} (torch and transformers are not installed here)")
        return SKIP
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return SKIP
    print("transformers", transformers.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))
    os.makedirs(args.workdir, exist_ok=True)
    ok = True
    for name, config in variants(transformers):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(3.0 / (head.float().std().item() * config.hidden_size ** 0.5))
        model = model.to(torch.bfloat16)
        model_dir = os.path.join(args.workdir, name)
        model.save_pretrained(model_dir, safe_serialization=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").cuda().eval()
        rng = np.random.default_rng(7)
        tokens = rng.integers(0, config.vocab_size, size=POSITIONS).tolist()
        with torch.no_grad():
            hf = model(torch.tensor([tokens], device="cuda")).logits[0].float().cpu().numpy().astype(np.float64)
        del model
        torch.cuda.empty_cache()
        hf_lp = log_softmax(np, hf)
        gpu_lp = log_softmax(np, tandem_logits(np, args.tandem, model_dir, "cuda", tokens,
                                               os.path.join(args.workdir, f"{name}_cuda.f32"), config.vocab_size))
        cpu_lp = log_softmax(np, tandem_logits(np, args.tandem, model_dir, "cpu", tokens,
                                               os.path.join(args.workdir, f"{name}_cpu.f32"), config.vocab_size))
        agree, diff = compare(np, hf_lp, gpu_lp)
        cpu_agree, cpu_diff = compare(np, cpu_lp, gpu_lp)
        hf_cpu_agree, hf_cpu_diff = compare(np, cpu_lp, hf_lp)
        passed = cpu_diff <= hf_cpu_diff and cpu_agree >= hf_cpu_agree - 0.01 and agree >= HF_TOP1_MIN
        ok &= passed
        bar = "met" if agree >= TOP1_MIN and diff <= LOGPROB_TOL else "not met"
        print(f"{name:12s} against the f32 reference: tandem cuda top-1 {cpu_agree:.4f} max {cpu_diff:.4f}, "
              f"transformers bf16 top-1 {hf_cpu_agree:.4f} max {hf_cpu_diff:.4f} {'OK' if passed else 'FAIL'} | "
              f"tandem cuda vs transformers: top-1 {agree:.4f} max {diff:.4f} (0.99/0.05 bar {bar})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

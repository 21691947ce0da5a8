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
and agrees with transformers on the top token at >= 95% of positions. On the
trained models (below) also: top-1 >= 99% and max |difference| <= 0.05
against the reference, and top-1 >= 99% against transformers.
Printed beside: the GPU engine against transformers directly, the issue's
first bar (top-1 >= 99%, max |difference| <= 0.05), which two bfloat16
engines that round differently do not meet on random-weight models (on an
H200, 2026-11-27, transformers itself was 0.14-0.21 from the reference
where tandem was 0.08-0.14); and the same two comparisons for the GPU
engine with `--logits-dtype bfloat16` (its logits rounded to bfloat16, as
transformers leaves them).

`--weights trained` (and `both`, the default) first trains each model for
a few hundred steps on a synthetic language (a sparse Markov chain over
4,096 of the ids, with stretches that repeat an earlier stretch, so that
attention carries the prediction there), so its distributions are peaked
like a trained model's rather than decided by noise, then checks it on
held-out text of the same language. Printed beside for those: transformers
with its LM-head product in float32 (its last op rounds the logits to
bfloat16, up to 0.03 at |logit| 8-16 on its own).

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


def tandem_logits(np, tandem, model_dir, device, tokens, out, vocab, logits_dtype="float32"):
    cmd = [tandem, "logits", "--model", model_dir, "--device", device, "--format", "f32", "--output", out,
           "--logits-dtype", logits_dtype, "--tokens", ",".join(str(t) for t in tokens)]
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


class Language:
    """A synthetic language: each of `alphabet` ids (a random subset of the
    vocabulary) has four successors (probabilities 0.7 / 0.15 / 0.1 / 0.05),
    and from position 64 on a text may repeat the stretch 32-96 tokens back
    for a while (what induction heads learn to copy)."""

    def __init__(self, np, vocab, seed, alphabet=4096):
        rng = np.random.default_rng(seed)
        self.np = np
        self.ids = rng.choice(vocab, size=alphabet, replace=False)
        self.succ = rng.integers(0, alphabet, size=(alphabet, 4))
        self.p = np.array([0.7, 0.15, 0.1, 0.05])

    def texts(self, rng, n, length):
        np = self.np
        x = np.empty((n, length), dtype=np.int64)
        x[:, 0] = rng.integers(0, len(self.ids), size=n)
        choice = rng.choice(4, size=(n, length), p=self.p)
        start = rng.random((n, length)) < 0.02
        back = rng.integers(32, 97, size=(n, length))
        span = rng.integers(16, 48, size=(n, length))
        rows = np.arange(n)
        copy_from = np.zeros(n, dtype=np.int64)
        copy_left = np.zeros(n, dtype=np.int64)
        for i in range(1, length):
            begin = (copy_left == 0) & (i >= 64) & start[:, i]
            copy_from = np.where(begin, i - np.minimum(back[:, i], i), copy_from)
            copy_left = np.where(begin, span[:, i], copy_left)
            copying = copy_left > 0
            x[:, i] = np.where(copying, x[rows, copy_from], self.succ[x[:, i - 1], choice[:, i]])
            copy_from += copying
            copy_left -= copying
        return self.ids[x]


def train(np, torch, model, language, steps=300, batch=32, length=320):
    """AdamW on the language in bfloat16 autocast, float32 master weights."""
    rng = np.random.default_rng(11)
    model = model.cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    loss = None
    for _ in range(steps):
        x = torch.from_numpy(language.texts(rng, batch, length)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.eval().cpu(), float(loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tandem", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--weights", choices=["random", "trained", "both"], default="both")
    parser.add_argument("--train-steps", type=int, default=300)
    args = parser.parse_args()
    if args.train_steps < 1:
        parser.error("--train-steps must be at least 1")
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
    kinds = ["random", "trained"] if args.weights == "both" else [args.weights]
    for kind in kinds:
        for base, config in variants(transformers):
            ok &= check_one(np, torch, AutoModelForCausalLM, args, kind, base, config)
    return 0 if ok else 1


def check_one(np, torch, AutoModelForCausalLM, args, kind, base, config):
    name = base if kind == "random" else f"{base}-trained"
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config)
    note = ""
    if kind == "random":
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(3.0 / (head.float().std().item() * config.hidden_size ** 0.5))
        rng = np.random.default_rng(7)
        tokens = rng.integers(0, config.vocab_size, size=POSITIONS).tolist()
    else:
        language = Language(np, config.vocab_size, seed=5)
        model, loss = train(np, torch, model, language, steps=args.train_steps)
        tokens = language.texts(np.random.default_rng(7), 1, POSITIONS)[0].tolist()
        note = f" (trained {args.train_steps} steps, last loss {loss:.3f})"
    model = model.to(torch.bfloat16)
    model_dir = os.path.join(args.workdir, name)
    model.save_pretrained(model_dir, safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        ids = torch.tensor([tokens], device="cuda")
        hf = model(ids).logits[0].float().cpu().numpy().astype(np.float64)
        # The same forward pass with the LM-head product in float32.
        hidden = model.model(ids).last_hidden_state[0].float()
        head = model.get_output_embeddings()
        hf32 = hidden @ head.weight.float().T
        if getattr(head, "bias", None) is not None:
            hf32 = hf32 + head.bias.float()
        hf32 = hf32.cpu().numpy().astype(np.float64)
    del model
    torch.cuda.empty_cache()
    hf_lp = log_softmax(np, hf)
    hf32_lp = log_softmax(np, hf32)
    gpu_lp = log_softmax(np, tandem_logits(np, args.tandem, model_dir, "cuda", tokens,
                                           os.path.join(args.workdir, f"{name}_cuda.f32"), config.vocab_size))
    cpu_lp = log_softmax(np, tandem_logits(np, args.tandem, model_dir, "cpu", tokens,
                                           os.path.join(args.workdir, f"{name}_cpu.f32"), config.vocab_size))
    # Beside: the GPU engine with its logits rounded to bfloat16 as transformers leaves them.
    gpu16_lp = log_softmax(np, tandem_logits(np, args.tandem, model_dir, "cuda", tokens,
                                             os.path.join(args.workdir, f"{name}_cuda16.f32"), config.vocab_size,
                                             "bfloat16"))
    agree, diff = compare(np, hf_lp, gpu_lp)
    agree32, diff32 = compare(np, hf32_lp, gpu_lp)
    agree16, diff16 = compare(np, hf_lp, gpu16_lp)
    cpu_agree16, cpu_diff16 = compare(np, cpu_lp, gpu16_lp)
    cpu_agree, cpu_diff = compare(np, cpu_lp, gpu_lp)
    hf_cpu_agree, hf_cpu_diff = compare(np, cpu_lp, hf_lp)
    passed = cpu_diff <= hf_cpu_diff and cpu_agree >= hf_cpu_agree - 0.01 and agree >= HF_TOP1_MIN
    if kind == "trained":
        # Peaked distributions: the bars hold against the float32
        # reference, and the top token against transformers.
        passed = passed and cpu_agree >= TOP1_MIN and cpu_diff <= LOGPROB_TOL and agree >= TOP1_MIN
    top_lp = cpu_lp.max(axis=1)
    bar = "met" if agree >= TOP1_MIN and diff <= LOGPROB_TOL else "not met"
    print(f"{name:20s}{note} mean top-1 logprob {top_lp.mean():.3f}; against the f32 reference: tandem cuda "
          f"top-1 {cpu_agree:.4f} max {cpu_diff:.4f}, transformers bf16 top-1 {hf_cpu_agree:.4f} max "
          f"{hf_cpu_diff:.4f} {'OK' if passed else 'FAIL'} | tandem cuda vs transformers: top-1 {agree:.4f} max "
          f"{diff:.4f} (0.99/0.05 bar {bar}); vs transformers with an f32 LM head: top-1 {agree32:.4f} max "
          f"{diff32:.4f} | --logits-dtype bfloat16: vs transformers top-1 {agree16:.4f} max {diff16:.4f} (bar "
          f"{'met' if agree16 >= TOP1_MIN and diff16 <= LOGPROB_TOL else 'not met'}), vs the f32 reference top-1 "
          f"{cpu_agree16:.4f} max {cpu_diff16:.4f}", flush=True)
    return passed


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""A float64 numpy reference for the Hugging Face Llama-family decoder.

Independent of tandem: it reads a Hugging Face checkpoint directory by itself
(config.json plus safetensors, single file or sharded) and computes the logits
of every position of a token sequence in float64, straight from the published
model definitions (Llama 2/3, Mistral 7B, Qwen2), with no caching and no
fusion. check_logits.py compares tandem's logits against it.

Also holds a tiny safetensors writer (F32/F16/BF16, round-to-nearest-even) so
tests can build checkpoints of variants that tandem cannot export.

Run `llama_reference.py --self-test` to check the reference against itself:
reader/writer round trips, RoPE properties, causality and GQA == MHA.

Requires only numpy (Debian's /usr/bin/python3 has it).
"""

import argparse
import json
import math
import os
import struct
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

# ---------------------------------------------------------------------------
# safetensors
#
# Format (https://github.com/huggingface/safetensors, "Format" section):
#   8 bytes   N, unsigned little-endian 64-bit: length of the header
#   N bytes   JSON header: {name: {"dtype": "F32", "shape": [..],
#             "data_offsets": [begin, end]}, optional "__metadata__": {..}}
#   rest      the byte buffer; offsets are relative to its start, tensors are
#             row-major little-endian.
# ---------------------------------------------------------------------------

# Bytes per element of each dtype we read or write.
_DTYPE_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


class CheckpointError(Exception):
    """A checkpoint that cannot be read: the message names the file/tensor."""


def _bf16_bits_to_f32(bits_u16):
    # bfloat16 is the upper 16 bits of an IEEE float32: shift them back up.
    return (bits_u16.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path):
    """Returns {name: float64 ndarray} for every tensor of one .safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise CheckpointError(f"{path}: truncated (no header length)")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if 8 + header_len > len(blob):
        raise CheckpointError(f"{path}: truncated header ({header_len} bytes announced)")
    header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    data = memoryview(blob)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info["dtype"], list(info["shape"])
        begin, end = info["data_offsets"]
        if dtype not in _DTYPE_SIZE:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * _DTYPE_SIZE[dtype]:
            raise CheckpointError(f"{path}: tensor {name}: offsets do not match shape {shape}")
        if end > len(data):
            raise CheckpointError(f"{path}: truncated: tensor {name} ends at {end}, "
                                  f"data has {len(data)} bytes")
        raw = data[begin:end]
        if dtype == "F64":
            arr = np.frombuffer(raw, dtype="<f8")
        elif dtype == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif dtype == "F16":
            arr = np.frombuffer(raw, dtype="<f2")
        else:  # BF16
            arr = _bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
        tensors[name] = arr.astype(np.float64).reshape(shape)
    return tensors


def read_checkpoint_tensors(model_dir):
    """All tensors of a checkpoint directory: model.safetensors, or the shards
    listed in model.safetensors.index.json ({"weight_map": {name: file}})."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_tensors = read_safetensors(os.path.join(model_dir, shard))
            for name, arr in shard_tensors.items():
                if weight_map.get(name) == shard:
                    tensors[name] = arr
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise CheckpointError(f"{index_path}: tensors listed but absent: {missing}")
        return tensors
    return read_safetensors(os.path.join(model_dir, "model.safetensors"))


def round_to_bf16(x):
    """float64 -> the nearest bfloat16 value (ties to even), returned as float64.

    bfloat16 keeps float32's exponent range with 8 significant bits. Rounding
    directly from float64 avoids the double rounding of f64 -> f32 -> bf16.
    """
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    finite = np.isfinite(x)
    xf = x[finite]
    # Normal range: x = m * 2^e with 0.5 <= |m| < 1; keep 8 bits of m.
    # np.rint rounds half to even.
    m, e = np.frexp(xf)
    rounded = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)
    # Subnormal range (|x| < 2^-126): the grid is fixed at 2^-133.
    tiny = np.abs(xf) < 2.0 ** -126
    rounded[tiny] = np.ldexp(np.rint(np.ldexp(xf[tiny], 133)), -133)
    # Largest bf16 is (2 - 2^-7) * 2^127; anything that rounds past it overflows.
    max_bf16 = (2.0 - 2.0 ** -7) * 2.0 ** 127
    rounded[np.abs(rounded) > max_bf16] = np.copysign(np.inf, xf[np.abs(rounded) > max_bf16])
    out[finite] = rounded
    out[~finite] = x[~finite]  # inf stays inf, nan stays nan
    return out


def _encode(arr, dtype):
    """Little-endian bytes of `arr` in safetensors dtype `dtype`, rounded to
    nearest even."""
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if dtype == "F64":
        return arr.astype("<f8").tobytes()
    if dtype == "F32":
        return arr.astype("<f4").tobytes()  # numpy casts round half to even
    if dtype == "F16":
        return arr.astype("<f2").tobytes()  # numpy casts round half to even
    if dtype == "BF16":
        # Exact in f32 after rounding, so the top 16 bits are the bf16 value.
        f32 = round_to_bf16(arr).astype(np.float32)
        bits = (f32.view(np.uint32) >> 16).astype("<u2")
        nan = np.isnan(f32)
        bits[nan] = 0x7FC0  # a quiet NaN (truncation could turn NaN into inf)
        return bits.tobytes()
    raise ValueError(f"unsupported dtype {dtype}")


def write_safetensors(path, tensors, dtype="F32"):
    """Writes {name: array} to `path`, every tensor in `dtype` (F32/F16/BF16/F64)."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        payload = _encode(arr, dtype)
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(payload)]}
        chunks.append(payload)
        offset += len(payload)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad the header with spaces so the data starts 8-byte aligned, as the
    # reference implementation does.
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for chunk in chunks:
            f.write(chunk)


# ---------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ReferenceConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per layer: a window size W (query i sees keys j with i - W < j <= i) or
    # None for full causal attention.
    sliding_windows: list = field(default_factory=list)
    rope: RopeSpec = field(default_factory=RopeSpec)


def parse_rope(cfg):
    """RoPE settings from either
      - rope_theta + rope_scaling {"rope_type"|"type": ..., "factor": ...}
        (transformers 4.x; "type" is the legacy key), or
      - rope_parameters {"rope_type": ..., "rope_theta": ..., ...} (transformers 5).
    """
    rope = RopeSpec()
    params = cfg.get("rope_parameters")
    if params is not None:
        rope.theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    else:
        rope.theta = float(cfg.get("rope_theta", 10000.0))
        params = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(f"unsupported rope type {rope_type!r}")
    rope.rope_type = rope_type
    if rope_type in ("linear", "llama3"):
        rope.factor = float(params["factor"])
    if rope_type == "llama3":
        rope.low_freq_factor = float(params["low_freq_factor"])
        rope.high_freq_factor = float(params["high_freq_factor"])
        rope.original_max_position_embeddings = int(params["original_max_position_embeddings"])
    return rope


def parse_config(cfg):
    """ReferenceConfig from the dict of a config.json."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"unsupported architectures {archs}")
    arch = archs[0]
    layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    # All three model files: num_key_value_heads None means plain MHA.
    kv_heads = cfg.get("num_key_value_heads") or heads
    # head_dim: given explicitly (Llama >= 4.44, Mistral) or hidden / heads.
    head_dim = cfg.get("head_dim") or hidden // heads
    if arch == "Qwen2ForCausalLM":
        # Qwen2Attention: q/k/v have bias=True, o_proj bias=False; MLP unbiased.
        qkv_bias, o_bias, mlp_bias = True, False, False
        # Qwen2 windows only some layers: those marked "sliding_attention" in
        # layer_types (transformers 5), else, when use_sliding_window is set,
        # layers >= max_window_layers (Qwen2Config: "the first max_window_layers
        # layers use full attention"; default 28).
        window = cfg.get("sliding_window")
        if cfg.get("layer_types") is not None:
            windowed = [t == "sliding_attention" for t in cfg["layer_types"]]
        else:
            first = int(cfg.get("max_window_layers", 28))
            windowed = [bool(cfg.get("use_sliding_window")) and l >= first for l in range(layers)]
        sliding_windows = [window if w and window is not None else None for w in windowed]
    elif arch == "MistralForCausalLM":
        # MistralAttention and MistralMLP have no biases. MistralConfig's
        # sliding_window defaults to 4096 when absent; null means full attention.
        qkv_bias, o_bias, mlp_bias = False, False, False
        window = cfg["sliding_window"] if "sliding_window" in cfg else 4096
        sliding_windows = [window] * layers
    else:
        # LlamaAttention: attention_bias biases q, k, v and o; mlp_bias biases
        # gate, up and down.
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
        sliding_windows = [None] * layers
    if heads % kv_heads != 0:
        raise CheckpointError(f"num_attention_heads {heads} not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    return ReferenceConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # LlamaConfig, MistralConfig and Qwen2Config all default this to False.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        sliding_windows=sliding_windows,
        rope=parse_rope(cfg),
    )


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

def rope_inv_freq(rope, head_dim):
    """Per-pair inverse frequencies, shape [head_dim / 2].

    default (RoFormer, Su et al. 2021): inv_freq[i] = theta^(-2i/d), i < d/2.
    linear (position interpolation, Chen et al. 2023): positions are divided by
        `factor`, i.e. inv_freq / factor.
    llama3 (Meta Llama 3.1 `apply_scaling`), with L = original_max_position_embeddings:
        wavelen = 2*pi / inv_freq
        wavelen < L / high_freq_factor  -> unchanged          (high frequencies)
        wavelen > L / low_freq_factor   -> inv_freq / factor  (low frequencies)
        otherwise blend: s = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                         inv_freq * ((1 - s) / factor + s)
    """
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    inv_freq = 1.0 / (rope.theta ** (i / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        L = rope.original_max_position_embeddings
        low_wavelen = L / rope.low_freq_factor
        high_wavelen = L / rope.high_freq_factor
        wavelen = 2.0 * math.pi / inv_freq
        smooth = (L / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = inv_freq * ((1.0 - smooth) / rope.factor + smooth)
        return np.where(wavelen < high_wavelen, inv_freq,
                        np.where(wavelen > low_wavelen, inv_freq / rope.factor, blended))
    return inv_freq


def apply_rope(x, positions, inv_freq):
    """Rotates x [T, heads, d] in Hugging Face's rotate_half convention:
    element i pairs with element i + d/2 (not 2i with 2i+1):
        angle[t, i] = positions[t] * inv_freq[i]            (i < d/2)
        out[:, i]       = x[:, i] * cos - x[:, i + d/2] * sin
        out[:, i + d/2] = x[:, i + d/2] * cos + x[:, i] * sin
    """
    half = x.shape[-1] // 2
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]   # [T, d/2]
    cos = np.cos(angle)[:, None, :]
    sin = np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_norm(x, weight, eps):
    """RMSNorm (Zhang & Sennrich 2019, as LlamaRMSNorm): x * rsqrt(mean(x^2) + eps) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def linear(x, tensors, prefix, bias):
    """y = x W^T (+ b); HF stores Linear weights as [out_features, in_features]."""
    y = x @ tensors[prefix + ".weight"].T
    if bias:
        y = y + tensors[prefix + ".bias"]
    return y


def expected_shapes(cfg):
    """{tensor name: shape} for every tensor the model needs."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (inter,)
            shapes[p + "mlp.up_proj.bias"] = (inter,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


class ReferenceModel:
    """A checkpoint held in float64, with forward(tokens) -> logits [T, vocab]."""

    def __init__(self, cfg, tensors):
        self.cfg = cfg
        for name, shape in expected_shapes(cfg).items():
            if name not in tensors:
                raise CheckpointError(f"missing tensor {name}")
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(f"tensor {name}: shape {list(tensors[name].shape)}, "
                                      f"expected {list(shape)}")
        self.t = tensors
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)

    @classmethod
    def load(cls, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = parse_config(json.load(f))
        return cls(cfg, read_checkpoint_tensors(model_dir))

    def attention(self, x, layer, positions):
        cfg, t = self.cfg, self.t
        p = f"model.layers.{layer}.self_attn."
        T, H, KV, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = linear(x, t, p + "q_proj", cfg.qkv_bias).reshape(T, H, d)
        k = linear(x, t, p + "k_proj", cfg.qkv_bias).reshape(T, KV, d)
        v = linear(x, t, p + "v_proj", cfg.qkv_bias).reshape(T, KV, d)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        # Causal mask: query i sees keys j <= i; with a sliding window W only
        # keys with i - j < W (transformers' sliding_window_overlay:
        # kv_idx > q_idx - W).
        i = np.arange(T)[:, None]
        j = np.arange(T)[None, :]
        visible = j <= i
        window = cfg.sliding_windows[layer]
        if window is not None:
            visible &= (i - j) < int(window)
        group = H // KV
        out = np.empty((T, H, d))
        for h in range(H):
            kv = h // group  # GQA (Ainslie et al. 2023), HF repeat_kv: head h -> kv head h // group
            scores = q[:, h, :] @ k[:, kv, :].T / math.sqrt(d)          # [T, T]
            scores = np.where(visible, scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, h, :] = probs @ v[:, kv, :]
        return linear(out.reshape(T, H * d), t, p + "o_proj", cfg.o_bias)

    def mlp(self, x, layer):
        cfg, t = self.cfg, self.t
        p = f"model.layers.{layer}.mlp."
        # SwiGLU (Shazeer 2020), as LlamaMLP: down(silu(gate(x)) * up(x)).
        gate = linear(x, t, p + "gate_proj", cfg.mlp_bias)
        up = linear(x, t, p + "up_proj", cfg.mlp_bias)
        return linear(silu(gate) * up, t, p + "down_proj", cfg.mlp_bias)

    def forward(self, tokens):
        """Logits [T, vocab] (float64) for every position of `tokens`."""
        cfg, t = self.cfg, self.t
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError("token id outside the vocabulary")
        positions = np.arange(len(tokens))
        x = t["model.embed_tokens.weight"][tokens]
        for l in range(cfg.num_layers):
            p = f"model.layers.{l}."
            # Pre-norm residual blocks (LlamaDecoderLayer).
            x = x + self.attention(rms_norm(x, t[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                                   l, positions)
            x = x + self.mlp(rms_norm(x, t[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps),
                             l)
        x = rms_norm(x, t["model.norm.weight"], cfg.rms_norm_eps)
        head = t["model.embed_tokens.weight"] if cfg.tie_word_embeddings else t["lm_head.weight"]
        return x @ head.T


# ---------------------------------------------------------------------------
# Building random checkpoints (used by check_logits.py and the self-test)
# ---------------------------------------------------------------------------

def random_tensors(cfg, seed):
    """Random weights for every tensor of `cfg`, scaled so activations stay
    O(1) and attention is far from uniform (a wrong RoPE or mask shows)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.3 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        else:
            fan_in = shape[1]
            scale = 2.0 if (".q_proj." in name or ".k_proj." in name) else 1.0
            w = scale * rng.standard_normal(shape) / math.sqrt(fan_in)
        tensors[name] = w
    return tensors


def write_checkpoint(model_dir, config_dict, tensors, dtype="F32", max_shard_tensors=None):
    """Writes config.json and the tensors, as model.safetensors or, when
    max_shard_tensors is given, as shards plus model.safetensors.index.json."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    names = sorted(tensors)
    if max_shard_tensors is None:
        write_safetensors(os.path.join(model_dir, "model.safetensors"), tensors, dtype)
        return
    groups = [names[i:i + max_shard_tensors] for i in range(0, len(names), max_shard_tensors)]
    weight_map = {}
    for n, group in enumerate(groups):
        shard = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(model_dir, shard), {k: tensors[k] for k in group}, dtype)
        weight_map.update({k: shard for k in group})
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------------
# Self-test
# ---------------------------------------------------------------------------

def _tiny_config_dict(**overrides):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg


def _check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"  ok  {what}")


def self_test():
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        # 1. Reader round trips exactly for values representable in each dtype.
        base = rng.standard_normal((5, 7)) * 3.0
        for dtype, representable in (("F32", base.astype(np.float32).astype(np.float64)),
                                     ("F16", base.astype(np.float16).astype(np.float64)),
                                     ("BF16", round_to_bf16(base))):
            path = os.path.join(tmp, f"rt_{dtype}.safetensors")
            write_safetensors(path, {"a": representable, "b": representable[1:, :3]}, dtype)
            back = read_safetensors(path)
            _check(np.array_equal(back["a"], representable)
                   and np.array_equal(back["b"], representable[1:, :3]),
                   f"{dtype} write/read round trip is exact")
        # Round-to-nearest-even at ties, and bf16 == top 16 bits of f32.
        ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 1 + 2.0 ** -8 + 2.0 ** -30])
        _check(np.array_equal(round_to_bf16(ties), [1.0, 1 + 2.0 ** -6, -1.0, 1 + 2.0 ** -7]),
               "BF16 rounding: ties go to even, above-tie rounds up")
        path = os.path.join(tmp, "bits.safetensors")
        write_safetensors(path, {"x": np.array([1.0, -2.5, 3.140625])}, "BF16")
        with open(path, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack("<Q", blob[:8])
        bits = np.frombuffer(blob[8 + n:], dtype="<u2")
        f32_top = (np.array([1.0, -2.5, 3.140625], dtype=np.float32).view(np.uint32) >> 16)
        _check(np.array_equal(bits, f32_top), "BF16 bytes are the upper 16 bits of float32")
        f16_ties = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11])
        write_safetensors(path, {"x": f16_ties}, "F16")
        _check(np.array_equal(read_safetensors(path)["x"], [1.0, 1 + 2.0 ** -9]),
               "F16 rounding: ties go to even")
        # Truncation is reported with the file name.
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 2)
        try:
            read_safetensors(path)
            _check(False, "truncated file rejected")
        except CheckpointError as e:
            _check(path in str(e), "truncated file rejected, naming the file")

        # 2. Sharded and single-file checkpoints give identical models.
        cfg_dict = _tiny_config_dict()
        cfg = parse_config(cfg_dict)
        tensors = {k: round_to_bf16(v) for k, v in random_tensors(cfg, seed=1).items()}
        write_checkpoint(os.path.join(tmp, "single"), cfg_dict, tensors, "BF16")
        write_checkpoint(os.path.join(tmp, "sharded"), cfg_dict, tensors, "BF16", max_shard_tensors=3)
        single = ReferenceModel.load(os.path.join(tmp, "single"))
        sharded = ReferenceModel.load(os.path.join(tmp, "sharded"))
        _check(all(np.array_equal(single.t[k], tensors[k]) for k in tensors)
               and all(np.array_equal(sharded.t[k], tensors[k]) for k in tensors),
               "single-file and sharded BF16 checkpoints read back exactly")

    # 3. RoPE properties.
    d = 16
    plain = rope_inv_freq(RopeSpec(theta=10000.0), d)
    _check(np.allclose(plain, 10000.0 ** (-np.arange(0, d, 2) / d), rtol=0, atol=1e-15),
           "default inv_freq = theta^(-2i/d)")
    lin = rope_inv_freq(RopeSpec(theta=10000.0, rope_type="linear", factor=4.0), d)
    _check(np.allclose(lin, plain / 4.0, rtol=1e-15), "linear scaling divides inv_freq by factor")
    l3 = RopeSpec(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=32)
    scaled = rope_inv_freq(l3, d)
    wavelen = 2 * math.pi / plain
    high = wavelen < 32 / 4.0
    low = wavelen > 32 / 1.0
    mid = ~high & ~low
    _check(high.any() and low.any() and mid.any(), "llama3 test spans all three bands")
    _check(np.array_equal(scaled[high], plain[high]), "llama3 leaves high frequencies unchanged")
    _check(np.allclose(scaled[low], plain[low] / 8.0, rtol=1e-15), "llama3 divides low frequencies by factor")
    _check(np.all((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)),
           "llama3 blends medium frequencies between the two")
    x = rng.standard_normal((6, 2, d))
    pos = np.arange(6)
    rotated = apply_rope(x, pos, plain)
    _check(np.allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1)),
           "RoPE preserves norms")
    _check(np.array_equal(rotated[0], x[0]), "RoPE at position 0 is the identity")
    # Rotating q and k by positions m and n gives a score depending only on m - n.
    qv, kv = rng.standard_normal(d), rng.standard_normal(d)
    def score(m, n):
        return apply_rope(qv[None, None], np.array([m]), plain)[0, 0] @ \
            apply_rope(kv[None, None], np.array([n]), plain)[0, 0]
    _check(abs(score(7, 3) - score(24, 20)) < 1e-12, "RoPE scores depend only on relative position")
    # rotate_half pairing: element 0 mixes with element d/2, not element 1.
    e0 = np.zeros((1, 1, d)); e0[0, 0, 0] = 1.0
    r = apply_rope(e0, np.array([1]), plain)[0, 0]
    _check(abs(r[d // 2] - math.sin(1.0)) < 1e-15 and r[1] == 0.0,
           "RoPE pairs element i with i + d/2 (rotate_half)")

    # 4. Causality: logits at position t ignore tokens after t.
    cfg_dict = _tiny_config_dict()
    model = ReferenceModel(parse_config(cfg_dict), random_tensors(parse_config(cfg_dict), seed=2))
    toks = rng.integers(0, 64, size=20)
    changed = toks.copy()
    changed[12:] = (changed[12:] + 5) % 64
    a, b = model.forward(toks), model.forward(changed)
    _check(np.allclose(a[:12], b[:12], rtol=0, atol=1e-12) and not np.allclose(a[12:], b[12:]),
           "causal: positions < 12 unchanged when tokens >= 12 change")
    _check(np.allclose(model.forward(toks[:9]), a[:9], rtol=0, atol=1e-12),
           "a prefix's logits equal the full sequence's first rows")

    # 5. GQA with kv_heads == heads is standard multi-head attention; and a GQA
    # model equals an MHA model whose k/v heads are repeated (h -> h // group).
    mha_dict = _tiny_config_dict(num_key_value_heads=4)
    mha_cfg = parse_config(mha_dict)
    mha = ReferenceModel(mha_cfg, random_tensors(mha_cfg, seed=3))
    _check(_naive_mha_logits(mha, toks).shape == (20, 64)
           and np.allclose(_naive_mha_logits(mha, toks), mha.forward(toks), rtol=0, atol=1e-10),
           "kv_heads == heads matches a textbook multi-head attention")
    gqa_cfg = parse_config(_tiny_config_dict(num_key_value_heads=2))
    gqa_t = random_tensors(gqa_cfg, seed=4)
    rep_t = dict(gqa_t)
    for l in range(gqa_cfg.num_layers):
        for w in ("k_proj", "v_proj"):
            name = f"model.layers.{l}.self_attn.{w}.weight"
            heads = gqa_t[name].reshape(2, 8, 32)
            rep_t[name] = np.repeat(heads, 2, axis=0).reshape(32, 32)  # kv 0,0,1,1
    _check(np.allclose(ReferenceModel(gqa_cfg, gqa_t).forward(toks),
                       ReferenceModel(mha_cfg, rep_t).forward(toks), rtol=0, atol=1e-10),
           "GQA 4:2 equals MHA with each kv head repeated for its query group")

    # 6. Tied embeddings use embed^T; head_dim may differ from hidden / heads.
    tied_dict = _tiny_config_dict(tie_word_embeddings=True, head_dim=16, attention_bias=True,
                                  mlp_bias=True)
    tied_cfg = parse_config(tied_dict)
    _check(tied_cfg.head_dim == 16 and "lm_head.weight" not in expected_shapes(tied_cfg)
           and expected_shapes(tied_cfg)["model.layers.0.self_attn.q_proj.weight"] == (64, 32),
           "explicit head_dim and tie_word_embeddings shape the tensors")
    tied = ReferenceModel(tied_cfg, random_tensors(tied_cfg, seed=5))
    _check(np.isfinite(tied.forward(toks)).all(), "biased, tied, head_dim=16 model runs")
    qwen_cfg = parse_config(_tiny_config_dict(architectures=["Qwen2ForCausalLM"],
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1e6}))
    _check(qwen_cfg.qkv_bias and not qwen_cfg.o_bias and qwen_cfg.rope.theta == 1e6,
           "Qwen2: q/k/v biased, o not; rope_parameters read")
    # 7. Sliding windows: in a one-layer Mistral with W = 4, token p reaches
    # positions p .. p+3 only; Qwen2 windows layers >= max_window_layers.
    swa_cfg = parse_config(_tiny_config_dict(architectures=["MistralForCausalLM"],
                                             num_hidden_layers=1, sliding_window=4))
    swa = ReferenceModel(swa_cfg, random_tensors(swa_cfg, seed=6))
    poked = toks.copy()
    poked[5] = (poked[5] + 1) % 64
    d_swa = np.abs(swa.forward(toks) - swa.forward(poked)).max(axis=1)
    _check(np.all(d_swa[:5] == 0) and np.all(d_swa[5:9] > 0) and np.all(d_swa[9:] < 1e-12),
           "sliding window 4: token 5 changes positions 5..8 only")
    _check(parse_config(_tiny_config_dict(architectures=["MistralForCausalLM"])).sliding_windows
           == [4096, 4096]
           and parse_config(_tiny_config_dict(architectures=["MistralForCausalLM"],
                                              sliding_window=None)).sliding_windows == [None, None],
           "Mistral sliding_window: absent -> 4096, null -> full attention")
    _check(parse_config(_tiny_config_dict(architectures=["Qwen2ForCausalLM"], sliding_window=8,
                                          use_sliding_window=True, max_window_layers=1)
                        ).sliding_windows == [None, 8],
           "Qwen2 windows only layers >= max_window_layers")
    try:
        parse_config(_tiny_config_dict(architectures=["GPT2LMHeadModel"]))
        _check(False, "unknown architecture rejected")
    except CheckpointError:
        _check(True, "unknown architecture rejected")
    print("self-test passed")


def _naive_mha_logits(model, tokens):
    """The same network with attention written as one loop over (head, query),
    the textbook Vaswani et al. 2017 form, to cross-check the vectorized code."""
    cfg, t = model.cfg, model.t
    T, d = len(tokens), cfg.head_dim
    x = t["model.embed_tokens.weight"][np.asarray(tokens)]
    pos = np.arange(T)
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        hn = rms_norm(x, t[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = apply_rope((hn @ t[p + "self_attn.q_proj.weight"].T).reshape(T, -1, d), pos, model.inv_freq)
        k = apply_rope((hn @ t[p + "self_attn.k_proj.weight"].T).reshape(T, -1, d), pos, model.inv_freq)
        v = (hn @ t[p + "self_attn.v_proj.weight"].T).reshape(T, -1, d)
        att = np.zeros((T, cfg.num_heads, d))
        for h in range(cfg.num_heads):
            for i in range(T):
                s = np.array([q[i, h] @ k[j, h] / math.sqrt(d) for j in range(i + 1)])
                w = np.exp(s - s.max())
                w /= w.sum()
                att[i, h] = sum(w[j] * v[j, h] for j in range(i + 1))
        x = x + att.reshape(T, -1) @ t[p + "self_attn.o_proj.weight"].T
        hn = rms_norm(x, t[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        g = hn @ t[p + "mlp.gate_proj.weight"].T
        u = hn @ t[p + "mlp.up_proj.weight"].T
        x = x + (silu(g) * u) @ t[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, t["model.norm.weight"], cfg.rms_norm_eps)
    return x @ t["lm_head.weight"].T


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--self-test", action="store_true", help="check the reference itself")
    parser.add_argument("--model", help="checkpoint directory to run")
    parser.add_argument("--tokens", help="comma-separated token ids")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    if args.model and args.tokens:
        model = ReferenceModel.load(args.model)
        logits = model.forward([int(s) for s in args.tokens.split(",")])
        json.dump({"vocab_size": model.cfg.vocab_size, "logits": logits.tolist()}, sys.stdout)
        print()
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

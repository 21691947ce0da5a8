#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora and dictionaries (run from the repo root).

The seeds are small, valid inputs of each format that reach deep into the
code: real chat templates with real conversations, small tokenizer.json files
in the shapes real ones have, the example router config, hand-made HTTP
requests, OpenAI request bodies, safetensors files and GenerateRequests. Run
again after changing it; the fuzzers' own finds stay in their build trees.
"""
import hashlib
import json
import os
import re
import struct
from collections import Counter

ROOT = os.getcwd()


def write_seeds(folder, seeds):
    path = os.path.join(ROOT, folder)
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.startswith("seed-"):
            os.remove(os.path.join(path, name))
    for name, data in seeds:
        if isinstance(data, str):
            data = data.encode()
        with open(os.path.join(path, f"seed-{name}"), "wb") as f:
            f.write(data)


def write_dict(path, words):
    with open(os.path.join(ROOT, path), "w") as f:
        f.write("# libFuzzer dictionary (scripts/make_fuzz_seeds.py)\n")
        for w in words:
            esc = "".join(c if 0x20 <= ord(c) < 0x7F and c not in '"\\' else
                          ("\\" + c if c in '"\\' else "".join(f"\\x{b:02x}" for b in c.encode()))
                          for c in w)
            f.write(f'"{esc}"\n')


# --- HTTP -------------------------------------------------------------------
def http_seeds():
    body = '{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    seeds = {
        "get_health": "GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "post_chat": f"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nX-Echo: 1\r\nX-A: b\r\n\r\n{body}",
        "chunked": "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: t\r\n\r\n",
        "expect_continue": "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                           "Content-Length: 2\r\n\r\n{}",
        "pipelined": "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\n\r\n"
                     "DELETE /health HTTP/1.1\r\n\r\nPOST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\n\r\nx",
        "http10": "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /health HTTP/1.0\r\n\r\n",
        "close": "POST /v1/chat/completions HTTP/1.1\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc",
        "too_large": "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 999999\r\n\r\nabc",
        "hang": "GET /hang HTTP/1.1\r\n\r\nGET /health HTTP/1.1\r\n\r\n",
        "big_header": "GET /health HTTP/1.1\r\nX-Big: " + "a" * 2100 + "\r\n\r\n",
        "bad": "GET / HTTP/9.9\r\n\r\n",
        "partial": "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc",
    }
    write_seeds("orchestrator/http/testdata/http_request_fuzzer", sorted(seeds.items()))
    write_dict("orchestrator/http/testdata/http_request_fuzzer.dict", [
        "GET ", "POST ", "HEAD ", "PUT ", "DELETE ", "OPTIONS ", " HTTP/1.1\r\n", " HTTP/1.0\r\n", "\r\n", "\r\n\r\n",
        "Host: ", "Content-Length: ", "Transfer-Encoding: chunked\r\n", "Connection: close\r\n",
        "Connection: keep-alive\r\n", "Expect: 100-continue\r\n", "Content-Type: application/json\r\n",
        "/v1/chat/completions", "/v1/completions", "/health", "/hang", "?", "0\r\n\r\n", ";", ":",
        "Upgrade: ", "Trailer: ", "X-Echo: ", "X-A: "])


# --- OpenAI requests ----------------------------------------------------------
def openai_seeds():
    seeds = {
        "chat_min": {"model": "m", "messages": [{"role": "user", "content": "Hello"}]},
        "chat_full": {"model": "m", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bob"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 16, "max_completion_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
            "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "seed": -5, "stop": ["\n", "END"], "stop_token_ids": [1, 2], "n": 2, "user": "u",
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": False,
            "min_tokens": 1, "return_tokens_as_token_ids": True, "logprobs": True, "top_logprobs": 3,
            "chat_template_kwargs": {"enable_thinking": False}, "tools": None},
        "chat_nulls": {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": None,
                       "stop": "s", "max_tokens": 1.6e1},
        "completion_text": {"model": "m", "prompt": "Once upon", "max_tokens": 5, "echo": True, "logprobs": 2,
                            "stream": True},
        "completion_ids": {"model": "m", "prompt": [1, 2, 3], "suffix": None},
        "completion_nested_ids": {"model": "m", "prompt": [[5, 6]], "n": 3, "seed": 9007199254740993},
        "completion_batch": {"model": "m", "prompt": ["a", "b"]},
    }
    out = [(k, json.dumps(v, ensure_ascii=False)) for k, v in sorted(seeds.items())]
    out.append(("invalid_utf8", b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}'))
    out.append(("escapes", '{"model":"m","prompt":"\\ud83d\\ude00 \\u0000 \\ud800","stop":["\\n"]}'))
    write_seeds("orchestrator/openai/testdata/openai_request_fuzzer", out)
    keys = ["model", "messages", "role", "content", "name", "tool_call_id", "tool_calls", "type", "text",
            "system", "user", "assistant", "tool", "developer", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "stop", "stop_token_ids", "n", "stream", "stream_options",
            "include_usage", "ignore_eos", "min_tokens", "return_tokens_as_token_ids", "logprobs",
            "top_logprobs", "prompt", "suffix", "echo", "chat_template_kwargs", "image_url"]
    write_dict("orchestrator/openai/testdata/openai_request_fuzzer.dict",
               [f'"{k}"' for k in keys] + ["null", "true", "false", "[]", "{}", "1e400", "-0", "1.5",
                                           "9223372036854775808", "\\u0000", "\\ud800"])


# --- Chat templates ------------------------------------------------------------
def chat_template_seeds():
    base = "orchestrator/chat_template/testdata"
    conv = json.load(open(os.path.join(ROOT, base, "conversations.json")))
    seeds = []
    for name in sorted(os.listdir(os.path.join(ROOT, base, "templates"))):
        tpl_name = name[:-len(".jinja")]
        source = open(os.path.join(ROOT, base, "templates", name)).read()
        tokens = conv["templates"].get(tpl_name, {})
        for c in conv["conversations"]:
            if c["templates"] != "*" and tpl_name not in c["templates"]:
                continue
            if c["name"] not in ("multi_turn", "tools", "tool_call_round_trip", "thinking_history", "unicode",
                                 "content_parts_list", "system_multi_turn", "enable_thinking_false"):
                continue
            context = dict(tokens)
            context.update(c["context"])
            seeds.append((f"{tpl_name}-{c['name']}", source + "{#context#}" + json.dumps(context, ensure_ascii=False)))
    # Each snippet exercises one feature: "=== name", a JSON context line, the template.
    text = open(os.path.join(ROOT, base, "snippets.txt")).read()
    for case in re.split(r"^=== ", text, flags=re.M)[1:]:
        name, context, template = case.split("\n", 2)
        seeds.append((f"snippet-{name.strip()}", template + "{#context#}" + context))
    write_seeds(f"{base}/chat_template_fuzzer", seeds)
    words = ["{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "{{-", "-}}", "{#context#}",
             "if", "elif", "else", "endif", "for", "in", "endfor", "set", "endset", "macro", "endmacro",
             "call", "filter", "endfilter", "with", "endwith", "raw", "endraw", "generation", "endgeneration",
             "break", "continue", "namespace", "loop.index", "loop.first", "loop.last", "loop.length",
             "not", "and", "or", "is", "defined", "none", "true", "false", "range(", "raise_exception(",
             "strftime_now(", "|tojson", "|trim", "|length", "|join(", "|items", "|selectattr(", "|map(",
             "|default(", "|replace(", "|upper", "|string", "|int", "|float", "|list", "|first", "|last",
             "|reverse", "|sort", "|unique", "|safe", "|escape", "|indent(", "|round", "|abs", "|dictsort",
             ".split(", ".strip(", ".startswith(", ".endswith(", ".lower()", ".get(", ".items()", ".keys()",
             ".values()", ".append(", ".update(", "[::-1]", "[1:]", "~", "**", "//", "%", "messages",
             "message['content']", "message.role", "add_generation_prompt", "bos_token", "eos_token",
             "tools", "documents", "\"messages\":", "\"add_generation_prompt\":", "\"bos_token\":"]
    write_dict(f"{base}/chat_template_fuzzer.dict", words)


# --- Tokenizers ----------------------------------------------------------------
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(words, symbols, merges_wanted):
    """Plain BPE on a Counter of words (each a tuple of symbols)."""
    vocab = Counter(words)
    merges = []
    for _ in range(merges_wanted):
        pairs = Counter()
        for w, n in vocab.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append((a, b))
        symbols.append(a + b)
        new = Counter()
        for w, n in vocab.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += n
        vocab = new
    return merges


CORPUS_FILES = ["README.md", "docs/architecture.md"]
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus_text():
    return "\n".join(open(os.path.join(ROOT, f), encoding="utf-8").read() for f in CORPUS_FILES)[:60000]


def byte_level_tokenizer(regex, normalizer, specials, merges_wanted):
    b2u = bytes_to_unicode()
    symbols = [b2u[b] for b in range(256)]
    words = Counter()
    for w in re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", corpus_text()):
        words[tuple(b2u[b] for b in w.encode())] += 1
    merges = train_bpe(words, symbols, merges_wanted)
    vocab = {s: i for i, s in enumerate(dict.fromkeys(symbols))}
    added = [{"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(specials)]
    bos = specials[0]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [added[0]["id"]], "tokens": [bos]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


def sentencepiece_tokenizer(metaspace, merges_wanted):
    sp = "\u2581"
    symbols = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    text = corpus_text()
    chars = sorted({c for c in text if not c.isspace()} | {sp})
    symbols += chars
    words = Counter()
    for w in re.findall(r"\S+", text):
        words[tuple(sp + w)] += 1
    merges = train_bpe(words, symbols, merges_wanted)
    vocab = {s: i for i, s in enumerate(dict.fromkeys(symbols))}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(["<unk>", "<s>", "</s>"])]
    post = {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": vocab, "merges": [[a, b] for a, b in merges]}
    if metaspace:
        return {"version": "1.0", "added_tokens": added, "normalizer": None,
                "pre_tokenizer": {"type": "Metaspace", "replacement": sp, "prepend_scheme": "first", "split": False},
                "post_processor": post,
                "decoder": {"type": "Metaspace", "replacement": sp, "prepend_scheme": "first", "split": False},
                "model": model}
    return {"version": "1.0", "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": sp}, {"type": "Replace", "pattern": {"String": " "}, "content": sp}]},
            "pre_tokenizer": None, "post_processor": post,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": sp}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": model}


def tokenizer_seeds():
    sample = "Hello, world! It's 2026: caf\u00e9 \u65e5\u672c\u8a9e \U0001F600  tabs\tand\nnewlines <s> <|eot_id|> 12345"
    toks = {
        "llama3_style": byte_level_tokenizer(LLAMA3_REGEX, None, ["<|begin_of_text|>", "<|eot_id|>"], 400),
        "qwen_style": byte_level_tokenizer(QWEN_REGEX, {"type": "NFC"}, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 300),
        "llama2_style": sentencepiece_tokenizer(False, 300),
        "metaspace": sentencepiece_tokenizer(True, 200),
    }
    seeds = []
    for name, tok in toks.items():
        seeds.append((f"{name}.json", json.dumps(tok, ensure_ascii=False).encode() + b"\0" + sample.encode()))
    write_seeds("orchestrator/tokenizer/testdata/tokenizer_json_fuzzer", seeds)
    texts = [sample, "", " ", "a" * 300, "<s><s></s>", "\xff\xfe invalid", "\u0301\u0065\u0301 NFC",
             "<|im_start|>user\nhi<|im_end|>", "   leading and trailing   ", "x\u2581y"]
    enc = []
    for i, t in enumerate(texts):
        data = t.encode("utf-8", "surrogateescape") if isinstance(t, str) else t
        enc.append((f"text{i}", bytes([(i * 5) % 256]) + data))
    enc.append(("ids", bytes([3]) + struct.pack("<16H", *[0, 1, 2, 3, 259, 260, 300, 65535, 5, 6, 7, 8, 9, 10, 200, 201])))
    write_seeds("orchestrator/tokenizer/testdata/tokenizer_encode_fuzzer", enc)
    write_dict("orchestrator/tokenizer/testdata/tokenizer_json_fuzzer.dict", [
        '"type"', '"Sequence"', '"Split"', '"ByteLevel"', '"Metaspace"', '"NFC"', '"NFKC"', '"NFD"', '"NFKD"',
        '"Prepend"', '"Replace"', '"Strip"', '"Fuse"', '"ByteFallback"', '"TemplateProcessing"', '"BPE"',
        '"normalizer"', '"normalizers"', '"pre_tokenizer"', '"pretokenizers"', '"decoder"', '"decoders"',
        '"post_processor"', '"processors"', '"model"', '"vocab"', '"merges"', '"added_tokens"', '"id"',
        '"content"', '"special"', '"normalized"', '"pattern"', '"Regex"', '"String"', '"behavior"',
        '"Isolated"', '"Removed"', '"replacement"', '"prepend_scheme"', '"always"', '"first"', '"never"',
        '"unk_token"', '"byte_fallback"', '"fuse_unk"', '"ignore_merges"', '"single"', '"SpecialToken"',
        '"special_tokens"', '"ids"', '"tokens"', '"start"', '"stop"', '"prepend"', '"split"',
        "1073741824", "2147483647", "-1", "null", "\\u2581", "<0x", ">"])


# --- Router config ---------------------------------------------------------------
def config_seeds():
    seeds = [("example", open(os.path.join(ROOT, "orchestrator/config/router.example.yaml")).read()),
             ("bad_policy_param", open(os.path.join(ROOT, "orchestrator/config/testdata/bad_policy_param.yaml")).read()),
             ("minimal", "disaggregation: {mode: never}\npools:\n  decode:\n    workers: [decode-0:50051]\n"),
             ("flow", "{listener: {host: '::', port: 8080}, pools: {prefill: {workers: ['[::1]:1', 'a:2']},"
                      " decode: {discovery: {dns: d.local, port: 5, interval_s: 1}, policy: {name: prefix_aware,"
                      " params: {virtual_nodes: 100}}}}, disaggregation: {mode: auto, auto_threshold_tokens: 1}}\n"),
             ("anchors", "x: &a {mode: always}\ndisaggregation: *a\npools:\n  decode:\n    workers: [a:1]\n  prefill:\n"
                         "    workers: [b:1]\n---\nsecond: doc\n")]
    write_seeds("orchestrator/config/testdata/router_config_fuzzer", seeds)
    keys = set(re.findall(r"^\s*([a-z_]+):", seeds[0][1], flags=re.M))
    write_dict("orchestrator/config/testdata/router_config_fuzzer.dict",
               sorted(k + ":" for k in keys) + ["- ", "{", "}", "[", "]", "&a ", "*a", "!!str ", "!!int ", "---\n",
                                               "...\n", "<<: ", "? ", "|\n", ">\n", "~", "0x", "1e9", ".inf", ".nan"])


# --- Safetensors -------------------------------------------------------------------
def safetensors(entries, metadata=None, pad=8):
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, blob in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header).encode()
    text += b" " * ((-len(text)) % pad)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    f32 = struct.pack("<6f", 1, -2, 0.5, float("inf"), float("nan"), 3e-39)
    f16 = struct.pack("<4H", 0x3C00, 0x8001, 0x7C00, 0x7E00)
    bf16 = struct.pack("<4H", 0x3F80, 0xFF80, 0x0001, 0x7FC0)
    seeds = [
        ("f32", safetensors([("w", "F32", [2, 3], f32)], {"format": "pt"})),
        ("mixed", safetensors([("a.weight", "F16", [4], f16), ("b.bias", "BF16", [2, 2], bf16),
                               ("ids", "I64", [1], struct.pack("<q", 7)), ("empty", "F32", [0, 5], b"")])),
        ("scalar", safetensors([("s", "F32", [], struct.pack("<f", 2.0))], {"format": "pt", "k": "v"})),
        ("truncated", safetensors([("w", "F32", [2, 3], f32)])[:-8]),
        ("short", b"\x10\x00\x00"),
    ]
    write_seeds("worker/model/testdata/safetensors_fuzzer", seeds)
    write_dict("worker/model/testdata/safetensors_fuzzer.dict", [
        '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"F32"', '"F16"', '"BF16"', '"I64"', '"U8"',
        '"BOOL"', '"F64"', "18446744073709551615", "9223372036854775807", "4294967296", "[]", "[0]", "-1", "1e3"])


# --- GenerateRequest (protobuf wire format) ---------------------------------------
def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    return varint((num << 3) | wire) + payload


def vint(num, n):
    return field(num, 0, varint(n))


def ln(num, data):
    return field(num, 2, varint(len(data)) + data)


def f32(num, x):
    return field(num, 5, struct.pack("<f", x))


def packed(num, values):
    return ln(num, b"".join(varint(v) for v in values))


def generate_request_seeds():
    prompt = packed(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
    sampling = (f32(1, 0.0) + vint(2, 5) + f32(3, 0.9) + f32(4, 0.05) + f32(5, 1.1) + f32(6, 0.5) +
                f32(7, -0.5) + vint(8, 4) + vint(9, 1) + packed(10, [2, 3]) + vint(11, 1) + vint(12, 2) + vint(13, 42))
    seeds = [
        ("plain", ln(1, b"r1") + prompt + ln(3, vint(8, 2))),
        ("sampling", ln(1, b"r2") + prompt + ln(3, sampling)),
        ("receive", ln(1, b"r3") + prompt + ln(3, vint(8, 3)) + ln(20, vint(1, 1) + vint(2, 50))),
        ("send", ln(1, b"r4") + prompt + ln(3, vint(8, 3)) +
         ln(20, vint(1, 2) + ln(3, b"127.0.0.1:1") + vint(4, 7) + vint(5, 16) + ln(6, b"decode-1"))),
        ("bad_ids", prompt + packed(2, [-1, 1 << 30])),
        ("empty", b""),
        ("long_prompt", packed(2, list(range(1, 256)) * 2) + ln(3, vint(8, 1))),
        ("bad_sampling", prompt + ln(3, f32(1, float("nan")) + vint(2, -7) + f32(3, 0.0) + vint(12, 99))),
        ("bad_mode", prompt + ln(20, vint(1, 7) + vint(2, 1 << 31))),
    ]
    write_seeds("worker/server/testdata/generate_request_fuzzer", seeds)


if __name__ == "__main__":
    http_seeds()
    openai_seeds()
    chat_template_seeds()
    tokenizer_seeds()
    config_seeds()
    safetensors_seeds()
    generate_request_seeds()

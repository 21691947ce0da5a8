#!/usr/bin/env python3
"""Renders chat_template_test's cases with Jinja2, as transformers does.

The Jinja2 environment is the one transformers' apply_chat_template builds
(transformers/utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
loopcontrols extension and the {% generation %} tag, the raise_exception and
strftime_now globals, and json.dumps as the tojson filter.

Usage: render_reference.py TESTDATA_DIR OUTPUT_JSON

Reads the cases (the same expansion as chat_template_test.cc's LoadCases):
  snippets.txt        "=== name" / one line of JSON context / template lines
  conversations.json  templates (testdata/templates/NAME.jinja, with default
                      context) x conversations
and writes {"jinja2_version", "today", "cases": {name: {"template",
"context", "result"}}} where result is {"output": text}, {"error": class, "message": m}
for a render-time exception, or {"syntax_error": m} when Jinja2 rejects the
template itself.
"""
import datetime
import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker without the mask bookkeeping: the body
    of {% generation %} is rendered through a caller, as there."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def read_text(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def load_snippets(path):
    """Yields (name, template, context). A case is a "=== name" line, one line
    of JSON context, then the template: every line up to the next "=== "
    line, joined with "\\n" (so a blank last line gives a trailing newline).
    Lines before the first case are comments."""
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i = 0
    while i < len(lines) and not lines[i].startswith("=== "):
        i += 1
    while i < len(lines):
        name = lines[i][4:].strip()
        context = json.loads(lines[i + 1])
        j = i + 2
        while j < len(lines) and not lines[j].startswith("=== "):
            j += 1
        yield name, "\n".join(lines[i + 2 : j]), context
        i = j


def load_conversations(testdata):
    spec = json.loads(read_text(os.path.join(testdata, "conversations.json")))
    for conversation in spec["conversations"]:
        names = conversation["templates"]
        if names == "*":
            names = list(spec["templates"])
        for template_name in names:
            template = read_text(os.path.join(testdata, "templates", template_name + ".jinja"))
            context = dict(spec["templates"][template_name])
            context.update(conversation["context"])
            yield f"{template_name}/{conversation['name']}", template, context


def render(env, template, context, compiled_cache):
    try:
        if template not in compiled_cache:
            compiled_cache[template] = env.from_string(template)
        compiled = compiled_cache[template]
    except Exception as e:  # TemplateSyntaxError, or Python's SyntaxError for a misplaced {% break %}
        return {"syntax_error": f"{type(e).__name__}: {e}"}
    try:
        return {"output": compiled.render(**context)}
    except Exception as e:  # the class name tells raise_exception (TemplateError) apart
        return {"error": type(e).__name__, "message": str(e)}


def main():
    testdata, output = sys.argv[1], sys.argv[2]
    env = make_environment()
    cases = {}
    compiled_cache = {}
    sources = [load_snippets(os.path.join(testdata, "snippets.txt")), load_conversations(testdata)]
    for source in sources:
        for name, template, context in source:
            if name in cases:
                sys.exit(f"duplicate case name {name!r}")
            cases[name] = {"template": template, "context": context,
                           "result": render(env, template, context, compiled_cache)}
    tmp = f"{output}.{os.getpid()}.tmp"  # concurrent writers each rename a whole file
    with open(tmp, "w", encoding="utf-8") as f:
        # strftime_now renders today's date: the test regenerates a reference from another day.
        today = datetime.date.today().isoformat()
        reference = {"jinja2_version": jinja2.__version__, "today": today, "cases": cases}
        json.dump(reference, f, ensure_ascii=False, indent=1)
    os.replace(tmp, output)


if __name__ == "__main__":
    main()

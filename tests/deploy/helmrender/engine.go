// The template engine: one text/template set holding every file under
// templates/ (so define/include work across files), Sprig's functions
// without env/expandenv, and Helm's own functions.

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"regexp"
	"sort"
	"strings"
	"text/template"

	sprig "github.com/Masterminds/sprig"
	"gopkg.in/yaml.v2"
)

// maxIncludeDepth bounds include/tpl nesting, so a template that includes
// itself fails with a message instead of overflowing the stack (Helm: 1000).
const maxIncludeDepth = 1000

type renderer struct{ depth int }

// funcs is the function map for the template set t; include and tpl run
// templates of t.
func (r *renderer) funcs(t *template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	f["toYaml"] = toYAML
	f["fromYaml"], f["fromYamlArray"] = fromMap(parseYAML), fromArray(parseYAML)
	f["fromJson"], f["fromJsonArray"] = fromMap(json.Unmarshal), fromArray(json.Unmarshal)
	f["toJson"] = func(v interface{}) string {
		j, err := json.Marshal(v)
		if err != nil {
			return ""
		}
		return string(j)
	}
	f["toToml"] = func(interface{}) (string, error) {
		return "", errors.New("toToml is not supported by helmrender (no TOML library in Debian's Go packages)")
	}
	f["required"] = func(msg string, v interface{}) (interface{}, error) {
		if s, ok := v.(string); v == nil || (ok && s == "") {
			return v, errors.New(msg)
		}
		return v, nil
	}
	// `helm template` has no cluster: lookup finds nothing.
	f["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	f["include"] = func(name string, data interface{}) (string, error) {
		return r.execute(t, name, data)
	}
	f["tpl"] = func(text string, data interface{}) (string, error) {
		// A clone, so that the string may define templates of its own and
		// include the chart's without changing the chart's set.
		c, err := t.Clone()
		if err != nil {
			return "", err
		}
		c.Funcs(r.funcs(c))
		name := "tpl"
		if m, ok := data.(map[string]interface{}); ok {
			if tm, ok := m["Template"].(map[string]interface{}); ok {
				if n, ok := tm["Name"].(string); ok && n != "" {
					name = n // errors then point at the calling file, as in Helm
				}
			}
		}
		if _, err := c.New(name).Parse(text); err != nil {
			return "", err
		}
		out, err := r.execute(c, name, data)
		return strings.ReplaceAll(out, "<no value>", ""), err
	}
	return f
}

func (r *renderer) execute(t *template.Template, name string, data interface{}) (string, error) {
	if r.depth >= maxIncludeDepth {
		return "", fmt.Errorf("template %q nests more than %d include/tpl calls (does it include itself?)", name, maxIncludeDepth)
	}
	r.depth++
	defer func() { r.depth-- }()
	var b strings.Builder
	err := t.ExecuteTemplate(&b, name, data)
	return b.String(), err
}

// fromMap and fromArray make fromYaml, fromJson and their Array forms: a parse
// error comes back in the result, as in Helm, not as a template error.
func fromMap(parse func([]byte, interface{}) error) func(string) map[string]interface{} {
	return func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := parse([]byte(s), &m); err != nil {
			return map[string]interface{}{"Error": err.Error()}
		}
		return m
	}
}

func fromArray(parse func([]byte, interface{}) error) func(string) []interface{} {
	return func(s string) []interface{} {
		a := []interface{}{}
		if err := parse([]byte(s), &a); err != nil {
			return []interface{}{err.Error()}
		}
		return a
	}
}

// toYAML marshals as sigs.k8s.io/yaml does (through JSON, so json tags and
// key names apply and keys come out sorted), without the final newline.
func toYAML(v interface{}) string {
	j, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	var o interface{}
	if err := yaml.Unmarshal(j, &o); err != nil {
		return ""
	}
	out, err := yaml.Marshal(o)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(out), "\n")
}

// render parses every template into one set and executes each one that is
// not a partial (base name starting with '_'). It returns the output by
// template name ("CHART/templates/x.yaml").
func render(c *chart, top map[string]interface{}) (map[string]string, error) {
	r := &renderer{}
	// missingkey=zero: a missing map key prints "<no value>", which Helm then
	// removes from the output, as below.
	t := template.New("gotpl").Option("missingkey=zero")
	t.Funcs(r.funcs(t))
	// Helm's parse order: deeper paths first, then reverse lexical order; a
	// name defined twice keeps the definition parsed last.
	names := make([]string, 0, len(c.templates))
	for name := range c.templates {
		names = append(names, name)
	}
	sort.Slice(names, func(i, j int) bool {
		di, dj := strings.Count(names[i], "/"), strings.Count(names[j], "/")
		if di != dj {
			return di > dj
		}
		return names[i] > names[j]
	})
	for _, name := range names {
		full := c.meta.Name + "/" + name
		if _, err := t.New(full).Parse(c.templates[name]); err != nil {
			return nil, templateError("parse error", err)
		}
	}
	out := map[string]string{}
	for _, name := range names {
		if strings.HasPrefix(path.Base(name), "_") {
			continue
		}
		full := c.meta.Name + "/" + name
		vals := make(map[string]interface{}, len(top)+1)
		for k, v := range top {
			vals[k] = v
		}
		vals["Template"] = map[string]interface{}{"Name": full, "BasePath": c.meta.Name + "/templates"}
		text, err := r.execute(t, full, vals)
		if err != nil {
			return nil, templateError("execution error", err)
		}
		out[full] = strings.ReplaceAll(text, "<no value>", "")
	}
	return out, nil
}

var (
	// text/template's "template: NAME:LINE[:COL]: ..." prefixes; include and
	// tpl nest them, the last is where the error happened.
	templateLocRe = regexp.MustCompile(`template: ([^\s:]+:\d+(?::\d+)?): `)
	calledRe      = regexp.MustCompile(`error calling (?:required|fail): `)
)

// templateError rewrites text/template's error as Helm shows it:
// "execution error at (tandem/templates/x.yaml:12:5): message" for required
// and fail, otherwise the innermost location followed by Go's message.
func templateError(kind string, err error) error {
	msg := err.Error()
	locs := templateLocRe.FindAllStringSubmatchIndex(msg, -1)
	if locs == nil {
		return fmt.Errorf("%s: %s", kind, msg)
	}
	last := locs[len(locs)-1]
	loc := msg[last[2]:last[3]]
	if calls := calledRe.FindAllStringIndex(msg, -1); calls != nil {
		return fmt.Errorf("%s at (%s): %s", kind, loc, msg[calls[len(calls)-1][1]:])
	}
	return fmt.Errorf("%s at (%s): %s", kind, loc, msg[last[1]:])
}

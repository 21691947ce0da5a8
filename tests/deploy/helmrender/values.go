// .Values: the chart's values.yaml, then -f files, --set and --set-string,
// merged as Helm 3 does, then checked against values.schema.json.

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/xeipuuv/gojsonschema"
	"gopkg.in/yaml.v2"
)

// parseYAML reads YAML the way Helm does (sigs.k8s.io/yaml): YAML 1.1
// scalars through yaml.v2, then through JSON into out, so every number is a
// float64 (which is why Helm prints 1000000 as 1e+06) and every key a string.
func parseYAML(data []byte, out interface{}) error {
	var raw interface{}
	if err := yaml.Unmarshal(data, &raw); err != nil {
		return err
	}
	j, err := json.Marshal(stringKeys(raw))
	if err != nil {
		return err
	}
	if string(j) == "null" {
		return nil
	}
	return json.Unmarshal(j, out)
}

// stringKeys turns yaml.v2's map[interface{}]interface{} into JSON's maps.
func stringKeys(v interface{}) interface{} {
	switch t := v.(type) {
	case map[interface{}]interface{}:
		m := make(map[string]interface{}, len(t))
		for k, x := range t {
			m[fmt.Sprint(k)] = stringKeys(x)
		}
		return m
	case []interface{}:
		a := make([]interface{}, len(t))
		for i, x := range t {
			a[i] = stringKeys(x)
		}
		return a
	}
	return v
}

// buildValues merges the user's values into one map (later -f files win,
// maps merge, a null is kept as a null), applies --set and --set-string, and
// coalesces that over the chart's values.yaml, where a null deletes the key.
func buildValues(c *chart, o *options) (map[string]interface{}, error) {
	user := map[string]interface{}{}
	for _, f := range o.valueFiles {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		m := map[string]interface{}{}
		if err := parseYAML(data, &m); err != nil {
			return nil, fmt.Errorf("values file %s: %v", f, err)
		}
		mergeMaps(user, m)
	}
	for _, s := range o.sets {
		if err := parseSet(s, user, true); err != nil {
			return nil, fmt.Errorf("--set %s: %v", s, err)
		}
	}
	for _, s := range o.setStrings {
		if err := parseSet(s, user, false); err != nil {
			return nil, fmt.Errorf("--set-string %s: %v", s, err)
		}
	}
	coalesce(c.values, user)
	return c.values, nil
}

func mergeMaps(dst, src map[string]interface{}) {
	for k, v := range src {
		dm, dok := dst[k].(map[string]interface{})
		sm, sok := v.(map[string]interface{})
		if dok && sok {
			mergeMaps(dm, sm)
		} else {
			dst[k] = v
		}
	}
}

func coalesce(dst, user map[string]interface{}) {
	for k, v := range user {
		dm, dok := dst[k].(map[string]interface{})
		um, uok := v.(map[string]interface{})
		switch {
		case v == nil:
			delete(dst, k)
		case dok && uok:
			coalesce(dm, um)
		case uok:
			m := map[string]interface{}{}
			coalesce(m, um) // drops the nulls inside
			dst[k] = m
		default:
			dst[k] = v
		}
	}
}

// parseSet applies one --set argument: comma-separated key=value pairs,
// keys dotted ('\.' and '\,' escape), {a,b} for a list. typed gives Helm's
// typing: true/false, null, integers (not floats: Helm keeps "1.5" a string);
// otherwise every value is a string. List indexes (a[0]=x) are not supported.
func parseSet(s string, dst map[string]interface{}, typed bool) error {
	for _, pair := range splitUnescaped(s, ',', true) {
		eq := strings.IndexByte(pair, '=')
		if eq <= 0 {
			return fmt.Errorf("%q is not key=value", pair)
		}
		var val interface{}
		raw := pair[eq+1:]
		switch {
		case typed && len(raw) >= 2 && raw[0] == '{' && raw[len(raw)-1] == '}':
			list := []interface{}{}
			for _, item := range splitUnescaped(raw[1:len(raw)-1], ',', false) {
				list = append(list, typedValue(unescape(item)))
			}
			val = list
		case typed:
			val = typedValue(unescape(raw))
		default:
			val = unescape(raw)
		}
		keys := splitUnescaped(pair[:eq], '.', false)
		m := dst
		for i, k := range keys {
			k = unescape(k)
			if k == "" || strings.ContainsAny(k, "[]") {
				return fmt.Errorf("key %q: empty part or a list index (not supported)", pair[:eq])
			}
			if i == len(keys)-1 {
				m[k] = val
				break
			}
			next, ok := m[k].(map[string]interface{})
			if !ok {
				next = map[string]interface{}{}
				m[k] = next
			}
			m = next
		}
	}
	return nil
}

func typedValue(s string) interface{} {
	switch {
	case strings.EqualFold(s, "true"):
		return true
	case strings.EqualFold(s, "false"):
		return false
	case strings.EqualFold(s, "null"):
		return nil
	case s == "0":
		return int64(0)
	}
	if s != "" && s[0] != '0' {
		if i, err := strconv.ParseInt(s, 10, 64); err == nil {
			return i
		}
	}
	return s
}

// splitUnescaped splits on sep outside backslash escapes (and, with braces,
// outside {...}); escapes are kept for unescape.
func splitUnescaped(s string, sep byte, braces bool) []string {
	var parts []string
	depth, start := 0, 0
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\':
			i++
		case braces && s[i] == '{':
			depth++
		case braces && s[i] == '}' && depth > 0:
			depth--
		case s[i] == sep && depth == 0:
			parts = append(parts, s[start:i])
			start = i + 1
		}
	}
	return append(parts, s[start:])
}

func unescape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+1 < len(s) {
			i++
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// validateSchema checks the final values against values.schema.json and
// lists every violation, as Helm does before rendering.
func validateSchema(c *chart, vals map[string]interface{}) error {
	if c.schema == nil {
		return nil
	}
	doc, err := json.Marshal(vals)
	if err != nil {
		return err
	}
	res, err := gojsonschema.Validate(gojsonschema.NewBytesLoader(c.schema), gojsonschema.NewBytesLoader(doc))
	if err != nil {
		return fmt.Errorf("values.schema.json: %v", err)
	}
	if res.Valid() {
		return nil
	}
	var b strings.Builder
	fmt.Fprintf(&b, "values don't meet the specifications of the schema(s) in the following chart(s):\n%s:\n", c.meta.Name)
	for _, e := range res.Errors() {
		fmt.Fprintf(&b, "- %s\n", e.String())
	}
	return errors.New(strings.TrimSuffix(b.String(), "\n"))
}

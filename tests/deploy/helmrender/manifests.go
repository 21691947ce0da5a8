// From rendered templates to `helm template`'s output: documents split at
// "---", sorted in Helm's install order, hooks after the rest.

package main

import (
	"fmt"
	"path"
	"regexp"
	"sort"
	"strings"

	"gopkg.in/yaml.v2"
	yaml3 "gopkg.in/yaml.v3"
)

// installOrder is Helm 3's install order by kind; other kinds come after
// these, sorted by kind name.
var installOrder = strings.Fields(`PriorityClass Namespace NetworkPolicy ResourceQuota
	LimitRange PodSecurityPolicy PodDisruptionBudget ServiceAccount Secret SecretList
	ConfigMap StorageClass PersistentVolume PersistentVolumeClaim CustomResourceDefinition
	ClusterRole ClusterRoleList ClusterRoleBinding ClusterRoleBindingList Role RoleList
	RoleBinding RoleBindingList Service DaemonSet Pod ReplicationController ReplicaSet
	Deployment HorizontalPodAutoscaler StatefulSet Job CronJob IngressClass Ingress
	APIService MutatingWebhookConfiguration ValidatingWebhookConfiguration`)

// docSep splits a rendered file into YAML documents as Helm does.
var docSep = regexp.MustCompile(`(?:^|\s*\n)---\s*`)

// manifest is one YAML document of one template.
type manifest struct {
	source  string // "CHART/templates/x.yaml"
	index   int    // position within the file
	content string
	kind    string
	hook    bool // has a helm.sh/hook annotation
}

// head is what Helm reads of every document: a parse failure is an error.
type head struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
}

func assemble(c *chart, rendered map[string]string, o *options) (string, error) {
	notesName := c.meta.Name + "/templates/NOTES.txt"
	var manifests []manifest
	notes := ""
	matched := make([]bool, len(o.showOnly))
	sources := make([]string, 0, len(rendered))
	for source := range rendered {
		sources = append(sources, source)
	}
	sort.Strings(sources) // so that the first error reported is always the same
	for _, source := range sources {
		text := rendered[source]
		if source == notesName && !o.notes {
			continue
		}
		if len(o.showOnly) > 0 {
			rel := strings.TrimPrefix(source, c.meta.Name+"/")
			keep := false
			for i, pattern := range o.showOnly {
				a, _ := path.Match(pattern, rel)
				b, _ := path.Match(pattern, source)
				if a || b {
					keep, matched[i] = true, true
				}
			}
			if !keep {
				continue
			}
		}
		if source == notesName {
			notes = strings.TrimSpace(text)
			continue
		}
		for i, doc := range docSep.Split(strings.TrimSpace(text), -1) {
			if doc = strings.TrimSpace(doc); doc == "" {
				continue
			}
			var h head
			if err := yaml.Unmarshal([]byte(doc), &h); err != nil {
				return "", fmt.Errorf("YAML parse error on %s (document %d): %v", source, i+1, err)
			}
			if o.validateYAML {
				if err := validateDoc(doc); err != nil {
					return "", fmt.Errorf("%s (document %d): %v", source, i+1, err)
				}
			}
			_, isHook := h.Metadata.Annotations["helm.sh/hook"]
			if isHook && o.noHooks {
				continue
			}
			manifests = append(manifests, manifest{source: source, index: i, content: doc, kind: h.Kind, hook: isHook})
		}
	}
	for i, ok := range matched {
		if !ok {
			return "", fmt.Errorf("could not find template %s in chart", o.showOnly[i])
		}
	}
	rank := map[string]int{}
	for i, k := range installOrder {
		rank[k] = i
	}
	sort.Slice(manifests, func(i, j int) bool {
		a, b := manifests[i], manifests[j]
		if a.hook != b.hook {
			return !a.hook
		}
		ra, aok := rank[a.kind]
		rb, bok := rank[b.kind]
		switch {
		case aok && bok && ra != rb:
			return ra < rb
		case aok != bok:
			return aok
		case !aok && a.kind != b.kind:
			return a.kind < b.kind
		case a.source != b.source:
			return a.source < b.source
		}
		return a.index < b.index
	})
	var b strings.Builder
	for _, m := range manifests {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", m.source, m.content)
	}
	if notes != "" {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", notesName, notes)
	}
	return b.String(), nil
}

// validateDoc is --validate-yaml: the document parses under yaml.v3's stricter
// rules (duplicate keys are errors) and names its apiVersion, kind and name.
func validateDoc(doc string) error {
	var m map[string]interface{}
	if err := yaml3.Unmarshal([]byte(doc), &m); err != nil {
		return err
	}
	str := func(v interface{}) string { s, _ := v.(string); return s }
	if str(m["apiVersion"]) == "" {
		return fmt.Errorf("no apiVersion")
	}
	if str(m["kind"]) == "" {
		return fmt.Errorf("no kind")
	}
	meta, _ := m["metadata"].(map[string]interface{})
	if str(meta["name"]) == "" {
		return fmt.Errorf("no metadata.name")
	}
	return nil
}

// Loading a chart directory, and the objects templates see besides .Values:
// .Chart, .Files and .Capabilities.

package main

import (
	"encoding/base64"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"gopkg.in/yaml.v2"
)

// chartMeta is Chart.yaml, exposed as .Chart with Helm's field names (yaml.v2
// matches untagged fields by their lowercased name). A struct, as in Helm,
// so a misspelt field is an error rather than empty.
type chartMeta struct {
	Name, Version, Description, Type, Home, Icon, Condition, Tags string
	APIVersion                                                    string `yaml:"apiVersion"`
	AppVersion                                                    string `yaml:"appVersion"`
	KubeVersion                                                   string `yaml:"kubeVersion"`
	Keywords                                                      []string
	Sources                                                       []string
	Maintainers                                                   []struct{ Name, Email, URL string }
	Annotations                                                   map[string]string
	Deprecated                                                    bool
	Dependencies                                                  []interface{}
}

// chart is a loaded chart directory.
type chart struct {
	meta      *chartMeta
	values    map[string]interface{} // values.yaml
	schema    []byte                 // values.schema.json, nil if absent
	templates map[string]string      // "templates/x.yaml" -> text
	files     files                  // everything else, for .Files
}

func loadChart(dir string) (*chart, error) {
	c := &chart{meta: &chartMeta{}, values: map[string]interface{}{},
		templates: map[string]string{}, files: files{}}
	raw, err := os.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, fmt.Errorf("chart %s: %v", dir, err)
	}
	if err := yaml.Unmarshal(raw, c.meta); err != nil {
		return nil, fmt.Errorf("%s: %v", filepath.Join(dir, "Chart.yaml"), err)
	}
	if c.meta.Name == "" || c.meta.Version == "" {
		return nil, fmt.Errorf("%s: name and version are required", filepath.Join(dir, "Chart.yaml"))
	}
	ignore, err := loadHelmignore(dir)
	if err != nil {
		return nil, err
	}
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		if d.IsDir() && rel != "." && ignore.match(rel, true) {
			return filepath.SkipDir
		} else if d.IsDir() || ignore.match(rel, false) {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case rel == "values.yaml":
			if err := parseYAML(data, &c.values); err != nil {
				return fmt.Errorf("%s: %v", p, err)
			}
		case rel == "values.schema.json":
			c.schema = data
		case rel == "Chart.yaml", rel == "Chart.lock", rel == ".helmignore",
			rel == "requirements.yaml", rel == "requirements.lock":
		case strings.HasPrefix(rel, "charts/"):
			return fmt.Errorf("%s: subcharts are not supported by helmrender", p)
		case strings.HasPrefix(rel, "templates/"):
			c.templates[rel] = string(data)
		default:
			c.files[rel] = data
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// helmignore is .helmignore's globs: '#' comments, a trailing '/' for
// directories only; a pattern without '/' matches a base name anywhere, one
// with '/' the path from the chart root. ('!' negation is not supported.)
type helmignore []string

func loadHelmignore(dir string) (helmignore, error) {
	raw, err := os.ReadFile(filepath.Join(dir, ".helmignore"))
	if os.IsNotExist(err) {
		return nil, nil
	}
	var h helmignore
	for _, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); line != "" && line[0] != '#' {
			h = append(h, line)
		}
	}
	return h, err
}

func (h helmignore) match(rel string, dir bool) bool {
	for _, p := range h {
		if strings.HasSuffix(p, "/") && !dir {
			continue
		}
		p = strings.Trim(p, "/")
		subject := rel
		if !strings.Contains(p, "/") {
			subject = path.Base(rel)
		}
		if ok, _ := path.Match(p, subject); ok {
			return true
		}
	}
	return false
}

// files is .Files: the chart's files outside templates/, by path from the
// chart root.
type files map[string][]byte

func (f files) GetBytes(name string) []byte { return f[name] }
func (f files) Get(name string) string      { return string(f[name]) }

// Glob returns the files matching a glob where '*' and '?' stop at '/' and
// '**' does not (Helm uses gobwas/glob with '/' as the separator).
func (f files) Glob(pattern string) files {
	re := regexp.QuoteMeta(pattern)
	re = strings.NewReplacer(`\*\*`, `.*`, `\*`, `[^/]*`, `\?`, `[^/]`).Replace(re)
	out := files{}
	for name, data := range f {
		if ok, _ := regexp.MatchString("^"+re+"$", name); ok {
			out[name] = data
		}
	}
	return out
}

// AsConfig is the files as a ConfigMap's data: base name -> content, as YAML.
func (f files) AsConfig() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	return toYAML(m)
}

// AsSecrets is the files as a Secret's data: base name -> base64 content.
func (f files) AsSecrets() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = base64.StdEncoding.EncodeToString(data)
	}
	return toYAML(m)
}

// Lines splits a file into lines, without the empty one after a final newline.
func (f files) Lines(name string) []string {
	s := string(f[name])
	if s == "" {
		return []string{}
	}
	return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
}

// capabilities is .Capabilities.
type capabilities struct {
	KubeVersion kubeVersion
	APIVersions versionSet
	HelmVersion helmVersion
}

type kubeVersion struct{ Version, Major, Minor string }

func (k kubeVersion) String() string     { return k.Version }
func (k kubeVersion) GitVersion() string { return k.Version } // deprecated in Helm, still used

type helmVersion struct{ Version, GitCommit, GitTreeState, GoVersion string }

// versionSet is .Capabilities.APIVersions; Has takes "group/version" or
// "group/version/Kind".
type versionSet []string

func (v versionSet) Has(s string) bool {
	for _, x := range v {
		if x == s {
			return true
		}
	}
	return false
}

// defaultAPIs stands in for the API server's discovery that `helm template`
// does without a cluster: Kubernetes 1.29's stable groups, with the kinds
// charts usually probe ("group/version:Kind,Kind").
const defaultAPIs = `v1:Pod,Service,ConfigMap,Secret,ServiceAccount,Namespace,PersistentVolumeClaim,PersistentVolume,Endpoints,LimitRange,ResourceQuota
	apps/v1:Deployment,StatefulSet,DaemonSet,ReplicaSet,ControllerRevision batch/v1:Job,CronJob
	policy/v1:PodDisruptionBudget networking.k8s.io/v1:Ingress,IngressClass,NetworkPolicy
	autoscaling/v1:HorizontalPodAutoscaler autoscaling/v2:HorizontalPodAutoscaler
	rbac.authorization.k8s.io/v1:Role,RoleBinding,ClusterRole,ClusterRoleBinding
	storage.k8s.io/v1:StorageClass,CSIDriver,CSINode,VolumeAttachment apiextensions.k8s.io/v1:CustomResourceDefinition
	admissionregistration.k8s.io/v1:MutatingWebhookConfiguration,ValidatingWebhookConfiguration
	scheduling.k8s.io/v1:PriorityClass coordination.k8s.io/v1:Lease discovery.k8s.io/v1:EndpointSlice
	node.k8s.io/v1:RuntimeClass certificates.k8s.io/v1:CertificateSigningRequest events.k8s.io/v1:Event
	apiregistration.k8s.io/v1:APIService authentication.k8s.io/v1:TokenReview authorization.k8s.io/v1:SubjectAccessReview`

var kubeVersionRe = regexp.MustCompile(`^v?(\d+)\.(\d+)(?:\.(\d+))?`)

func newCapabilities(kube string, extra []string) (*capabilities, error) {
	m := kubeVersionRe.FindStringSubmatch(kube)
	if m == nil {
		return nil, fmt.Errorf("--kube-version %q: want vMAJOR.MINOR[.PATCH]", kube)
	}
	patch := m[3]
	if patch == "" {
		patch = "0"
	}
	caps := &capabilities{
		KubeVersion: kubeVersion{Version: fmt.Sprintf("v%s.%s.%s", m[1], m[2], patch), Major: m[1], Minor: m[2]},
		HelmVersion: helmVersion{Version: "v3.14.0", GitTreeState: "clean", GoVersion: "go1.19"},
	}
	for _, entry := range strings.Fields(defaultAPIs) {
		gv, kinds, _ := strings.Cut(entry, ":")
		caps.APIVersions = append(caps.APIVersions, gv)
		for _, k := range strings.Split(kinds, ",") {
			caps.APIVersions = append(caps.APIVersions, gv+"/"+k)
		}
	}
	for _, e := range extra {
		for _, v := range strings.Split(e, ",") {
			if v = strings.TrimSpace(v); v != "" {
				caps.APIVersions = append(caps.APIVersions, v)
			}
		}
	}
	sort.Strings(caps.APIVersions)
	return caps, nil
}

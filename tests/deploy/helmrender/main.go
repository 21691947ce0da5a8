// helmrender is a test tool: it renders a Helm chart the way `helm template`
// does (Helm 3), so that tandem's chart tests can check the chart's output on a
// machine with no helm binary and no Kubernetes API server. It is built from
// Debian's Go sources only: text/template, Sprig, gojsonschema, yaml.v2/v3.
// It is not shipped and is not a Helm replacement. Not implemented: subcharts
// (charts/ is an error), crds/, toToml (an error), --set list indexes,
// .helmignore's '!', a real cluster's API list (a fixed Kubernetes 1.29 set
// plus --api-versions), post-renderers, --strict/lint.
//
// Build (GOPATH mode: Debian installs the sources under /usr/share/gocode):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS= GOCACHE=$TMP/gocache \
//	  go build -o $BUILD/helmrender ./tests/deploy/helmrender
//
// Usage: helmrender --chart DIR [-f values.yaml]... [--set a.b=c]... [flags];
// -h lists the flags.
//
// It prints every rendered manifest as `---\n# Source: CHART/templates/FILE\n...`
// in Helm's install order, and exits 1 with a message naming the template and
// line on a template error, a `required` or `fail`, or a values-schema violation.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// multiFlag collects a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// options is the parsed command line.
type options struct {
	chartDir     string
	valueFiles   multiFlag // -f/--values, merged in order
	sets         multiFlag // --set a.b=c (typed values)
	setStrings   multiFlag // --set-string a.b=c (always strings)
	release      string
	namespace    string
	apiVersions  multiFlag // added to .Capabilities.APIVersions; comma lists allowed
	kubeVersion  string
	showOnly     multiFlag // like helm's -s/--show-only: template path globs
	noHooks      bool      // leave out helm.sh/hook manifests
	notes        bool      // print NOTES.txt too
	validateYAML bool      // every document needs apiVersion, kind, metadata.name
	output       string    // "" is stdout
}

func parseFlags(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("helmrender", flag.ContinueOnError)
	fs.StringVar(&o.chartDir, "chart", "", "chart directory (required)")
	fs.Var(&o.valueFiles, "f", "values file (repeatable; later files win)")
	fs.Var(&o.valueFiles, "values", "same as -f")
	fs.Var(&o.sets, "set", "set values: a.b=c,d[0]=e (repeatable)")
	fs.Var(&o.setStrings, "set-string", "set string values: a.b=c (repeatable)")
	fs.StringVar(&o.release, "release", "tandem", ".Release.Name")
	fs.StringVar(&o.namespace, "namespace", "default", ".Release.Namespace")
	fs.Var(&o.apiVersions, "api-versions", "extra API versions for .Capabilities.APIVersions (repeatable)")
	fs.Var(&o.apiVersions, "a", "same as --api-versions")
	fs.StringVar(&o.kubeVersion, "kube-version", "v1.29.0", ".Capabilities.KubeVersion")
	fs.Var(&o.showOnly, "show-only", "only print templates matching this path (repeatable)")
	fs.Var(&o.showOnly, "s", "same as --show-only")
	fs.BoolVar(&o.noHooks, "no-hooks", false, "leave out hook manifests")
	fs.BoolVar(&o.notes, "notes", false, "print templates/NOTES.txt too")
	fs.BoolVar(&o.validateYAML, "validate-yaml", false, "require apiVersion, kind and metadata.name in every document")
	fs.StringVar(&o.output, "output", "", "write to this file instead of stdout")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (the chart is given with --chart)", fs.Arg(0))
	}
	if o.chartDir == "" {
		return nil, errors.New("--chart DIR is required")
	}
	return o, nil
}

func run(o *options, stdout io.Writer) error {
	c, err := loadChart(o.chartDir)
	if err != nil {
		return err
	}
	vals, err := buildValues(c, o)
	if err != nil {
		return err
	}
	if err := validateSchema(c, vals); err != nil {
		return err
	}
	caps, err := newCapabilities(o.kubeVersion, o.apiVersions)
	if err != nil {
		return err
	}
	top := map[string]interface{}{
		"Values":       vals,
		"Chart":        c.meta,
		"Capabilities": caps,
		"Files":        c.files,
		"Release": map[string]interface{}{
			"Name":      o.release,
			"Namespace": o.namespace,
			"Service":   "Helm",
			"Revision":  1,
			"IsInstall": true,
			"IsUpgrade": false,
		},
	}
	rendered, err := render(c, top)
	if err != nil {
		return err
	}
	out, err := assemble(c, rendered, o)
	if err != nil {
		return err
	}
	if o.output == "" {
		_, err = io.WriteString(stdout, out)
		return err
	}
	return os.WriteFile(o.output, []byte(out), 0o644)
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(os.Stderr, "helmrender: %v\n", err)
		}
		os.Exit(2)
	}
	if err := run(o, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "helmrender: %v\n", err)
		os.Exit(1)
	}
}

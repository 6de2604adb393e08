// Command promcheck checks PromQL the way Prometheus itself reads it: the rule groups of a
// PrometheusRule's spec (Prometheus's own rule-file parser and validation, model/rulefmt) and the
// queries of a Grafana dashboard (promql/parser). It prints, as JSON, the metric names the
// queries and rules select, so a test can check that each is one the node plugin serves.
//
//	promcheck -rules groups.yaml -dashboard dashboard.json
//
// Exit status 1, with every error on stderr, when a rule or query does not parse or validate.
//
//	promcheck -scrape job.yaml -target 127.0.0.1:9477
//
// scrapes target once the way Prometheus scrapes a job: the job's YAML (one entry of
// scrape_configs) read into Prometheus's own HTTP client configuration (scheme, metrics_path,
// tls_config, authorization... from prometheus/common/config, validated, relative files from
// the job file's directory), its HTTP client (config.NewClientFromConfig), Prometheus's
// default Accept header, and the body parsed with Prometheus's own parser (model/textparse).
// It prints {"status", "contentType", "samples", "metrics"}; exit status 1 when the job does
// not load, the scrape fails or answers other than 200, or the body does not parse.
//
// Test tooling only; nothing here ships.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"sort"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

// dashboard is the part of a Grafana dashboard that holds queries.
type dashboard struct {
	Panels []struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

func main() {
	rules := flag.String("rules", "", "rule groups (YAML), as a PrometheusRule's spec holds them")
	dash := flag.String("dashboard", "", "Grafana dashboard (JSON)")
	job := flag.String("scrape", "", "one scrape job (YAML) to scrape -target with")
	target := flag.String("target", "", "host:port scraped with -scrape")
	flag.Parse()
	if *job != "" {
		os.Exit(scrapeOnce(*job, *target))
	}
	p := parser.NewParser(parser.Options{})
	metrics := map[string]bool{}
	failed := false
	fail := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
		failed = true
	}
	collect := func(where, expr string) {
		e, err := p.ParseExpr(expr)
		if err != nil {
			fail("%s: %q: %v", where, expr, err)
			return
		}
		parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
			if v, ok := n.(*parser.VectorSelector); ok && v.Name != "" {
				metrics[v.Name] = true
			}
			return nil
		})
	}
	if *rules != "" {
		content, err := os.ReadFile(*rules)
		if err != nil {
			fail("%v", err)
		} else {
			groups, errs := rulefmt.Parse(content, false, model.UTF8Validation, p, slog.New(slog.DiscardHandler))
			for _, e := range errs {
				fail("%s: %v", *rules, e)
			}
			if groups != nil {
				for _, g := range groups.Groups {
					for _, r := range g.Rules {
						collect(fmt.Sprintf("rule %s/%s", g.Name, r.Alert+r.Record), r.Expr)
					}
				}
			}
		}
	}
	if *dash != "" {
		content, err := os.ReadFile(*dash)
		var d dashboard
		if err == nil {
			err = json.Unmarshal(content, &d)
		}
		if err != nil {
			fail("%s: %v", *dash, err)
		}
		for _, panel := range d.Panels {
			if len(panel.Targets) == 0 {
				fail("panel %q has no query", panel.Title)
			}
			for _, t := range panel.Targets {
				collect(fmt.Sprintf("panel %q", panel.Title), t.Expr)
			}
		}
	}
	names := make([]string, 0, len(metrics))
	for n := range metrics {
		names = append(names, n)
	}
	sort.Strings(names)
	out, _ := json.Marshal(map[string][]string{"metrics": names})
	fmt.Println(string(out))
	if failed {
		os.Exit(1)
	}
}

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/prometheus/common/config"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/textparse"
	"go.yaml.in/yaml/v2"
)

// scrapeJob is the part of Prometheus's ScrapeConfig that decides how a target is reached:
// the same YAML keys, with the HTTP client configuration inlined as Prometheus inlines it.
type scrapeJob struct {
	JobName          string                  `yaml:"job_name"`
	Scheme           string                  `yaml:"scheme,omitempty"`
	MetricsPath      string                  `yaml:"metrics_path,omitempty"`
	ScrapeTimeout    string                  `yaml:"scrape_timeout,omitempty"`
	HTTPClientConfig config.HTTPClientConfig `yaml:",inline"`
}

// acceptHeader is Prometheus's Accept header for its default scrape protocols
// (config.DefaultScrapeProtocols, scrape.acceptHeader, UTF-8 escaping off).
const acceptHeader = "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5," +
	"application/openmetrics-text;version=0.0.1;q=0.4," +
	"text/plain;version=1.0.0;escaping=underscores;q=0.3," +
	"text/plain;version=0.0.4;q=0.2,*/*;q=0.1"

func scrapeOnce(path, target string) int {
	if err := scrape(path, target); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func scrape(path, target string) error {
	content, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	job := scrapeJob{Scheme: "http", MetricsPath: "/metrics", HTTPClientConfig: config.DefaultHTTPClientConfig}
	if err := yaml.Unmarshal(content, &job); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	job.HTTPClientConfig.SetDirectory(filepath.Dir(path))
	if err := job.HTTPClientConfig.Validate(); err != nil {
		return fmt.Errorf("%s: job %q: %w", path, job.JobName, err)
	}
	client, err := config.NewClientFromConfig(job.HTTPClientConfig, job.JobName)
	if err != nil {
		return fmt.Errorf("job %q: %w", job.JobName, err)
	}
	timeout := 10 * time.Second
	if job.ScrapeTimeout != "" {
		if timeout, err = time.ParseDuration(job.ScrapeTimeout); err != nil {
			return fmt.Errorf("scrape_timeout: %w", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	url := fmt.Sprintf("%s://%s%s", job.Scheme, target, job.MetricsPath)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", acceptHeader)
	req.Header.Set("Accept-Encoding", "identity")
	req.Header.Set("X-Prometheus-Scrape-Timeout-Seconds", fmt.Sprintf("%g", timeout.Seconds()))
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	contentType := resp.Header.Get("Content-Type")
	result := map[string]any{"status": resp.StatusCode, "contentType": contentType}
	if resp.StatusCode != http.StatusOK {
		result["body"] = string(body)
		out, _ := json.Marshal(result)
		fmt.Println(string(out))
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	p, err := textparse.New(body, contentType, labels.NewSymbolTable(), textparse.ParserOptions{})
	if err != nil {
		return fmt.Errorf("%s: %w", contentType, err)
	}
	samples := 0
	names := map[string]bool{}
	for {
		entry, err := p.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("parsing the scrape: %w", err)
		}
		if entry == textparse.EntrySeries {
			var l labels.Labels
			p.Labels(&l)
			names[l.Get("__name__")] = true
			samples++
		}
	}
	list := make([]string, 0, len(names))
	for n := range names {
		list = append(list, n)
	}
	sort.Strings(list)
	result["samples"] = samples
	result["metrics"] = list
	out, _ := json.Marshal(result)
	fmt.Println(string(out))
	return nil
}

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
)

// scenarioLine turns testdata files into one batch line: every YAML/JSON document an object.
func scenarioLine(t *testing.T, id string, names ...string) string {
	t.Helper()
	var objects []json.RawMessage
	for _, name := range names {
		data, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		docs := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			var raw json.RawMessage
			if err := docs.Decode(&raw); err != nil {
				break
			}
			if len(raw) > 0 && string(raw) != "null" {
				objects = append(objects, raw)
			}
		}
	}
	line, err := json.Marshal(batchScenario{ID: id, Objects: objects})
	if err != nil {
		t.Fatal(err)
	}
	return string(line)
}

func TestBatchMatchesFileMode(t *testing.T) {
	cases := [][]string{
		{"gpus.yaml", "claim-h100.yaml"},
		{"gpus.yaml", "claim-three.yaml"},
		{"gpus.yaml", "in-use.json"},
		{"partitionable.yaml", "claim-whole.yaml"},
		{"consumable.yaml"},
		{"invalid-slice.yaml"},
		{"gpus.yaml", "claim-unknown-class.yaml"},
	}
	var lines []string
	for i, names := range cases {
		lines = append(lines, scenarioLine(t, strings.Join(names, "+")+"#"+string(rune('a'+i)), names...))
	}
	lines = append(lines, "not json")
	for _, jobs := range []int{1, 3} {
		var out bytes.Buffer
		if err := runBatch(context.Background(), strings.NewReader(strings.Join(lines, "\n")+"\n"), &out, jobs, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		answers := strings.Split(strings.TrimSpace(out.String()), "\n")
		if len(answers) != len(lines) {
			t.Fatalf("jobs %d: %d answers for %d lines:\n%s", jobs, len(answers), len(lines), out.String())
		}
		for i, names := range cases {
			var got batchAnswer
			if err := json.Unmarshal([]byte(answers[i]), &got); err != nil {
				t.Fatalf("answer %d: %v", i, err)
			}
			if !strings.HasPrefix(got.ID, strings.Join(names, "+")) {
				t.Errorf("answer %d out of order: id %q", i, got.ID)
			}
			in, err := loadFiles(testdata(names...))
			if err != nil {
				if got.Invalid == "" || !strings.Contains(got.Invalid, "only one of `sharedCounters` or `devices`") {
					t.Errorf("%v: file mode refuses (%v), batch says %s", names, err, answers[i])
				}
				continue
			}
			want := runDefault(t, in)
			if got.Output == nil || len(got.Output.Nodes) != len(want.Nodes) {
				t.Fatalf("%v: got %s", names, answers[i])
			}
			for j := range want.Nodes {
				g, w := outcome(got.Output.Nodes[j]), outcome(want.Nodes[j])
				// Shared devices get random share IDs; outcome() does not show them.
				if g != w {
					t.Errorf("%v node %d: batch %q, file mode %q", names, j, g, w)
				}
			}
		}
		var last batchAnswer
		if err := json.Unmarshal([]byte(answers[len(answers)-1]), &last); err != nil || last.Invalid == "" {
			t.Errorf("bad line: %s", answers[len(answers)-1])
		}
	}
}

func TestBatchScenarioOptions(t *testing.T) {
	line := scenarioLine(t, "x", "gpus.yaml", "claim-h100.yaml")
	var sc map[string]any
	_ = json.Unmarshal([]byte(line), &sc)
	sc["node"] = "node-2"
	onlyNode, _ := json.Marshal(sc)
	sc["node"] = "nosuch"
	badNode, _ := json.Marshal(sc)
	sc["node"] = "node-1"
	sc["timeout"] = "1ns"
	timeout, _ := json.Marshal(sc)
	input := string(onlyNode) + "\n" + string(badNode) + "\n" + string(timeout) + "\n"
	var out bytes.Buffer
	if err := runBatch(context.Background(), strings.NewReader(input), &out, 2, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	answers := strings.Split(strings.TrimSpace(out.String()), "\n")
	var a [3]batchAnswer
	for i := range a {
		if err := json.Unmarshal([]byte(answers[i]), &a[i]); err != nil {
			t.Fatal(err)
		}
	}
	if a[0].Output == nil || len(a[0].Output.Nodes) != 1 || a[0].Output.Nodes[0].Name != "node-2" {
		t.Errorf("node: %s", answers[0])
	}
	if !strings.Contains(a[1].Invalid, `node "nosuch" is not in the input`) {
		t.Errorf("unknown node: %s", answers[1])
	}
	if a[2].Output == nil || outcome(a[2].Output.Nodes[0]) != "error:node node-1: timed out trying to allocate devices" {
		t.Errorf("timeout: %s", answers[2])
	}
}

func TestBatchCommandLine(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "in.jsonl")
	if err := os.WriteFile(path, []byte(scenarioLine(t, "one", "gpus.yaml", "claim-h100.yaml")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if rc := mainWithArgs([]string{"--batch", path, "--jobs", "2"}, &stdout, &stderr); rc != 0 {
		t.Fatalf("exit %d: %s", rc, stderr.String())
	}
	if !strings.HasPrefix(stdout.String(), `{"id":"one","output":{"nodes":[{"name":"node-1","allocated":true`) {
		t.Errorf("stdout: %s", stdout.String())
	}
	if rc := mainWithArgs([]string{"--batch", path, "-f", path}, &stdout, &stderr); rc != 2 {
		t.Errorf("--batch with -f: exit %d", rc)
	}
}

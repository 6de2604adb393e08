package main

// Batch mode: many scenarios in one process, so that differential tests with thousands of
// scenarios pay for one process start and one feature-gate setup.
//
//	allocoracle --batch FILE|- [--jobs N]
//
// Input: JSON Lines, one scenario per line:
//
//	{"id": "...", "objects": [<object or List>, ...], "node": "NAME", "timeout": "10s"}
//
// "node" and "timeout" are optional (as --node and --timeout). Every scenario gets a fresh
// decoder (so duplicates are per scenario), allocator and CEL cache, exactly as one run of the
// file mode would.
//
// Output: JSON Lines in input order, one per scenario:
//
//	{"id": "...", "output": {"nodes": [...]}}   the file mode's stdout
//	{"id": "...", "invalid": "message"}         what the file mode would exit 2 with
//
// A line that is not a scenario is an "invalid" answer too (with an empty id when none could be
// read); the exit status is 0 unless reading the input or writing the output fails.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

type batchScenario struct {
	ID      string            `json:"id"`
	Objects []json.RawMessage `json:"objects"`
	Node    string            `json:"node,omitempty"`
	Timeout string            `json:"timeout,omitempty"`
}

type batchAnswer struct {
	ID      string  `json:"id"`
	Output  *output `json:"output,omitempty"`
	Invalid string  `json:"invalid,omitempty"`
}

// runScenario answers one input line.
func runScenario(ctx context.Context, line []byte, defaultTimeout time.Duration) batchAnswer {
	var sc batchScenario
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&sc); err != nil {
		return batchAnswer{ID: sc.ID, Invalid: fmt.Sprintf("scenario: %v", err)}
	}
	timeout := defaultTimeout
	if sc.Timeout != "" {
		t, err := time.ParseDuration(sc.Timeout)
		if err != nil {
			return batchAnswer{ID: sc.ID, Invalid: fmt.Sprintf("scenario %s: timeout: %v", sc.ID, err)}
		}
		timeout = t
	}
	d := newDecoder()
	in := &input{}
	for i, raw := range sc.Objects {
		if err := d.document(fmt.Sprintf("scenario %s: object %d", sc.ID, i), raw, in); err != nil {
			return batchAnswer{ID: sc.ID, Invalid: err.Error()}
		}
	}
	out, err := run(ctx, in, options{node: sc.Node, filterTimeout: timeout})
	if err != nil {
		return batchAnswer{ID: sc.ID, Invalid: err.Error()}
	}
	return batchAnswer{ID: sc.ID, Output: out}
}

// runBatch reads scenarios from r and writes answers to w in input order, with up to jobs
// scenarios in flight.
func runBatch(ctx context.Context, r io.Reader, w io.Writer, jobs int, defaultTimeout time.Duration) error {
	if jobs < 1 {
		jobs = 1
	}
	type pending struct {
		done   chan struct{}
		answer batchAnswer
	}
	queue := make(chan *pending, jobs)
	var writeErr error
	var writer sync.WaitGroup
	writer.Add(1)
	go func() {
		defer writer.Done()
		bw := bufio.NewWriter(w)
		enc := json.NewEncoder(bw)
		for p := range queue {
			<-p.done
			if writeErr != nil {
				continue
			}
			if err := enc.Encode(p.answer); err != nil {
				writeErr = err
				continue
			}
			// Flush per answer so that a reader sees each one as soon as it is done.
			if err := bw.Flush(); err != nil {
				writeErr = err
			}
		}
	}()
	slots := make(chan struct{}, jobs)
	br := bufio.NewReaderSize(r, 1<<20)
	var readErr error
	for {
		line, err := br.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			p := &pending{done: make(chan struct{})}
			slots <- struct{}{}
			queue <- p
			go func(line []byte) {
				defer func() { <-slots }()
				defer close(p.done)
				p.answer = runScenario(ctx, line, defaultTimeout)
			}(line)
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				readErr = err
			}
			break
		}
	}
	close(queue)
	writer.Wait()
	if readErr != nil {
		return fmt.Errorf("reading scenarios: %w", readErr)
	}
	if writeErr != nil {
		return fmt.Errorf("writing answers: %w", writeErr)
	}
	return nil
}

// batchMain is the --batch entry point.
func batchMain(path string, jobs int, timeout time.Duration, stdin io.Reader, stdout, stderr io.Writer) int {
	r := stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			_, _ = fmt.Fprintf(stderr, "allocoracle: %v\n", err)
			return 2
		}
		defer func() { _ = f.Close() }()
		r = f
	}
	ctx := klog.NewContext(context.Background(), klog.Background())
	if err := runBatch(ctx, r, stdout, jobs, timeout); err != nil {
		_, _ = fmt.Fprintf(stderr, "allocoracle: %v\n", err)
		return 1
	}
	return 0
}
